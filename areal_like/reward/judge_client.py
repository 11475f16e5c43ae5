"""What a custom reward function gets as its `judge` argument: the run's judge servers, for grading
prompts and parsers of the user's own (issue 43 item 3).

    def compute_score(data_source, solution_str, ground_truth, extra_info, judge):
        reply = judge.generate(f"Question: {judge.question}\\nAnswer: {solution_str}\\nCorrect? yes/no:")
        return 1.0 if reply.strip().lower().startswith("yes") else 0.0

A function whose parameters include `judge` is called with one `JudgeClient` per sample (its
`question` is the sample's prompt as text); without a judge component in the allocation such a function
is refused when it loads, unless its `judge` parameter has a default (then it is called without one).
The call runs in the reward worker process under `custom_reward_function.timeout_s`, like the rest of
the function. Set `judge.weight=0` (the built-in grading is then not run) and `judge.rule_weight=1` to
make the function's score the reward.

Standard library only: the reward worker loads this file by location (reward/_worker.py imports nothing
of areal_like for a user's function).
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request

JUDGE_CLIENT_ENV = "AREAL_LIKE_JUDGE_CLIENT"
"""The reward worker's environment variable holding the judge servers and settings (JSON; it holds the
servers' API key, which stays out of argv)."""


class JudgeError(RuntimeError):
    """A judge request failed; the message names the server (and the setting to change)."""


class JudgeClient:
    def __init__(self, urls: list[str], *, question: str = "", api_key: str | None = None, timeout_s: float = 60.0,
                 max_retries: int = 2, max_new_tokens: int = 16, temperature: float = 0.0, prompt_template: str = ""):
        if not urls:
            raise JudgeError("JudgeClient needs at least one judge server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.question = question
        """The sample's prompt as text (a chat prompt's last user message)."""
        self.prompt_template = prompt_template
        """judge.prompt_template, for functions that reuse it (`{question}`, `{response}`, `{reference}`)."""
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self._api_key = api_key
        self._next = 0

    @classmethod
    def from_env(cls, question: str) -> "JudgeClient | None":
        spec = os.environ.get(JUDGE_CLIENT_ENV)
        return None if not spec else cls(question=question, **json.loads(spec))

    def generate(self, prompt: str, *, max_new_tokens: int | None = None, temperature: float | None = None,
                 stop: list[str] | None = None) -> str:
        """The judge's reply to `prompt` (text in, text out: the judge server applies its tokenizer; no chat
        template). Defaults: judge.max_new_tokens, judge.temperature. A request that times out
        (judge.timeout_s) is sent to the next judge server, up to judge.max_retries more times; one that
        cannot connect (a judge server restarting) is tried again with backoff for up to judge.timeout_s;
        then JudgeError names the last servers tried. An HTTP error is raised at once. The function's own
        limit, custom_reward_function.timeout_s, still bounds the whole call."""
        sp: dict = {"max_new_tokens": self.max_new_tokens if max_new_tokens is None else max_new_tokens,
                    "temperature": self.temperature if temperature is None else temperature}
        if stop:
            sp["stop"] = list(stop)
        body = json.dumps({"text": prompt, "sampling_params": sp}).encode()
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        tried: list[str] = []
        timeouts = 0
        deadline = time.monotonic() + self.timeout_s  # for a server that cannot be reached (e.g. restarting)
        backoff = 0.25
        while True:
            url = self.urls[self._next % len(self.urls)]
            self._next += 1
            req = urllib.request.Request(url + "/generate", data=body, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    reply = json.loads(r.read())
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace")
                raise JudgeError(f"judge server {url}/generate answered HTTP {e.code}: {detail}") from None
            except (TimeoutError, socket.timeout, urllib.error.URLError, ConnectionError) as e:
                reason = getattr(e, "reason", e)
                tried.append(f"{url} ({type(reason).__name__}: {reason})")
                if isinstance(reason, (TimeoutError, socket.timeout)):
                    timeouts += 1  # sent again up to max_retries times
                    if timeouts > self.max_retries:
                        break
                elif time.monotonic() + backoff > deadline:  # refused / reset: wait for it, up to timeout_s
                    break
                else:
                    time.sleep(backoff)
                    backoff = min(2.0, backoff * 2)
                continue
            if isinstance(reply, list):
                reply = reply[0]
            return str(reply.get("text", ""))
        raise JudgeError(f"judge request failed on {len(tried)} attempt(s) (judge.timeout_s={self.timeout_s:g}, "
                         f"judge.max_retries={self.max_retries}): {'; '.join(tried[-3:])}")
