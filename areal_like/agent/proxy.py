"""The OpenAI-compatible agent proxy: a user's agent talks to the policy through the `openai` SDK,
and every completion's tokens, logprobs and versions are recorded for training.

```
 agent.run(data, base_url, api_key)          AgentProxy (aiohttp, in the rollout worker's loop)
   openai.AsyncOpenAI ── POST /v1/chat/completions ──► chat template(messages, tools) → prompt ids
                                                      client.generate(ids, run's sampling settings)
                       ◄── message, tool_calls ─────── record Completion(prompt_ids, output_ids,
                                                                         logprobs, versions)
                       ── POST /rl/set_reward ───────► completion.reward
 runner: session_trajectories(session) → Trajectory list (concat / individual)
```

One `Session` per sample (open_session → a random bearer key); the key is how requests find their
session, so many agents share one proxy. Endpoints (OpenAI wire format): `POST /v1/chat/completions`,
`POST /v1/completions`, `GET /v1/models`, and `POST /rl/set_reward` (`{"completion_id": optional,
"reward": float}`; no id = the session's last completion).

What differs from OpenAI, on purpose:
- Sampling: the run's `generation.temperature/top_p/top_k` are always used, because the learner
  recomputes logprobs at those settings and importance weights are biased otherwise. A request asking
  for different ones (or for `seed`, penalties, `min_p`, `logit_bias`) is served at the run's settings;
  the reply names the ignored fields in the header `X-Areal-Like-Sampling-Overridden` (comma
  separated) and the field `sampling_overridden` (a list). The seed is the run's, stable per
  (group, sample, completion) — as `EpisodeContext.sampling_seed` with turn = completion number.
- Limits: a completion generates at most min(max_tokens / max_completion_tokens,
  rollout.multi_turn.max_tokens_per_turn or generation.max_new_tokens) tokens, and never past
  min(rollout.multi_turn.max_total_tokens, server.max_context_len) in total; a prompt that leaves no
  room is a 400 with code `context_length_exceeded` (the agent should end its episode).
- Completions per session (one agent sample = one episode): at most
  `rollout.multi_turn.max_completions_per_episode` (null = `max_assistant_turns`) are admitted; the
  next is a 400 with code `max_completions_per_episode_exceeded`, generates nothing and is not
  recorded, so an agent looping on completions cannot grow its group (issue 24: 301 completions with
  max_assistant_turns 2). 400, not 429: the `openai` SDK retries 429s, and waiting does not help.
  A request that fails (4xx/5xx) before its completion is recorded gives its admission back.
  Refusals are counted per session (`Session.refused`) and per proxy (`AgentProxy.refused_completions`).
- Refused with a 400 naming the field (never silently changed): `n`/`best_of` other than 1, `stop`
  strings (the recorded tokens must be exactly the generated ones: end turns with EOS or
  `generation.stop_token_ids`), `top_logprobs` > 0, `echo`, `suffix`, non-text `response_format`, and
  `tool_choice` that forces a call. Other unknown fields are ignored.
- With `rollout.multi_turn.reasoning_parser` (SGLang's names: qwen3, deepseek-r1) a reply's think block
  goes to `message.reasoning_content` (agent/reasoning.py) and tool calls are parsed from the rest.
- Tool calls are parsed from the Hermes format (`<tool_call>{json}</tool_call>`, workflow/tool_parser.py)
  into `message.tool_calls` (finish_reason `tool_calls`); a malformed call stays in `content` as the
  model wrote it and is described in the extension field `message.tool_call_errors`.
- Request size (issue 24: a 50 MB body grew the rollout worker to 17.7 GB; a 2 MB one held every
  other agent ~2.4 s behind the one tokenizer thread): a body over `max_request_bytes`
  (max_total_tokens × `rollout.multi_turn.max_request_bytes_per_token` + 64 KiB) is a 413 naming that
  key, sent when the headers arrive (Content-Length) or as soon as a chunked body passes it — the
  body is never held whole; a chat whose text (contents + tools) or a text prompt longer than
  max_total_tokens × that key in characters is a 400 `context_length_exceeded` before any
  tokenization. Tokenization runs off the event loop in two
  lanes, each one thread with its own tokenizer: bodies over 64 KiB in one, all others (and decoding)
  in the other, so a large request never queues the small ones of other agents.
- Streaming is emulated: the whole reply comes as one chunk, then the finish chunk, then `[DONE]`.
- A completion is recorded (trained) only once its reply was delivered: when the agent disconnected
  before that (a streamed reply it closed, or a request it gave up on while generating), the
  completion is dropped and its admission given back (issue 24).
- Extensions: `return_token_ids: true` adds `prompt_token_ids` and per-choice `token_ids`.
- Errors are OpenAI-shaped `{"error": {"message", "type", "param", "code"}}`: 401 for a missing or
  unknown key, 404 for an unknown completion id, 502 for any generation failure (naming the server
  error; the request is not recorded), 409 when the session closed while a completion generated.

Exporting (`session_trajectories`) — rewards follow AReaL: a returned float is the reward of the
session's last completion, a dict gives rewards by completion id, and rewards set via /rl/set_reward
hold for the completions the return value does not name. Then, from the last completion backwards,
each completion's reward becomes its own (0.0 when none was set; the last one unset is logged) plus
`turn_discount` × the next completion's: `r[i] += turn_discount * r[i+1]`. A float reward therefore
gives completion i `reward * turn_discount ** (turns from the last)`.
Style `concat`: when every completion's prompt starts with the previous completion's prompt + output
(token prefix — what a chat loop that re-sends the conversation produces when the template re-renders
the model's turn exactly), one Trajectory: the first prompt, each output (loss mask 1, its logprobs
and versions) and the tokens between (tool results, template glue: loss mask 0, version −1), with the
last completion's reward. Otherwise, or with style `individual`, one Trajectory per completion.

This module knows nothing of the rollout worker, rewards functions or the buffer.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from areal_like.api.config import GenerationConfig, MultiTurnConfig
from areal_like.api.trajectory import Trajectory
from areal_like.agent.reasoning import split_reasoning
from areal_like.workflow.tool_parser import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tool_calls

log = logging.getLogger(__name__)

EXPORT_STYLES = ("concat", "individual")
MODEL_ID = "areal_like"
OVERRIDE_HEADER = "X-Areal-Like-Sampling-Overridden"
_BODY_OVERHEAD = 64 << 10  # JSON structure, field names, small tool schemas: on top of the per-token bound
_BIG_LANE_BYTES = 64 << 10  # bodies above this are tokenized in their own lane (module doc)
_BYTES_KEY = "rollout.multi_turn.max_request_bytes_per_token"
_BODY_BYTES = web.RequestKey("body_bytes", int)  # the request body's size, read by `_body`
_RECORDED = web.RequestKey("completion_recorded", bool)  # set once the request's completion is recorded


# ---- records ------------------------------------------------------------------------------------
@dataclass
class Completion:
    """One recorded completion: exactly the server's tokens, logprobs and versions."""

    id: str
    """`chatcmpl-…` / `cmpl-…`: the reply's `id`, the key of /rl/set_reward."""
    seq: int
    """k: the completion's number in its session (rid `{group}-{index}-c{k}`, seed turn k)."""
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str
    """The generation's: "stop" | "length" (the chat reply says "tool_calls" on top of it)."""
    reward: float | None = None
    """Set via /rl/set_reward; None until then."""
    messages: list[dict[str, Any]] | None = None
    """Chat: the messages as sent. None for /v1/completions."""
    tools: list[dict[str, Any]] | None = None
    prompt: Any = None
    """/v1/completions: the prompt as sent (text or token ids)."""
    text: str = ""
    """The decoded output as returned (without a final stop token)."""
    created: float = 0.0


@dataclass
class Session:
    """One sample's conversation(s) with the proxy; `api_key` identifies it."""

    group_id: str
    index: int
    api_key: str
    completions: list[Completion] = field(default_factory=list)
    """Recorded completions, ordered by `seq` (arrival order), whatever order they finished in."""
    closed: bool = False
    next_seq: int = 0
    admitted: int = 0
    """Completion requests admitted under the per-episode cap (recorded or still generating)."""
    refused: int = 0
    """Completion requests refused by the cap (rollout.multi_turn.max_completions_per_episode)."""
    inflight: set = field(default_factory=set, repr=False)

    def add(self, c: Completion) -> None:
        pos = len(self.completions)
        while pos > 0 and self.completions[pos - 1].seq > c.seq:
            pos -= 1
        self.completions.insert(pos, c)

    def find(self, completion_id: str) -> Completion | None:
        return next((c for c in self.completions if c.id == completion_id), None)


class _ApiError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                            "code": self.code}}, status=self.status)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except _ApiError as e:
        return e.response()
    except web.HTTPException as e:  # aiohttp's own (unknown route, 405, 413): OpenAI-shaped too
        if e.status < 400:
            raise
        return _ApiError(e.status, f"{request.method} {request.path}: {e.reason}").response()


def _bad(message: str, param: str | None = None, code: str | None = None) -> _ApiError:
    return _ApiError(400, message, param=param, code=code)


# ---- the proxy ----------------------------------------------------------------------------------
class AgentProxy:
    """OpenAI-compatible HTTP front of a `GenerationClient` that records every completion (module doc)."""

    def __init__(self, client, tokenizer, gen: GenerationConfig, multi_turn: MultiTurnConfig, *,
                 host: str = "127.0.0.1", port: int = 0, seed: int | None = None, max_context_len: int = 512):
        self.client = client
        self.tokenizer = tokenizer
        self.gen = gen
        self.multi_turn = multi_turn
        self.host = host
        self.port = port
        self.seed = seed
        self.max_context_len = max_context_len
        self._sessions: dict[str, Session] = {}
        self._runner: web.AppRunner | None = None
        self.refused_completions = 0
        """Completion requests refused by the per-episode cap, over the proxy's life (all sessions)."""
        # Two tokenizer lanes, one thread each with its own tokenizer (module doc): template rendering stays
        # off the event loop, a fast tokenizer is never used from two threads at once ("Already borrowed"),
        # and a large request (up to max_request_bytes) never queues the small ones behind it.
        self._tok_pool: ThreadPoolExecutor | None = None
        self._big_pool: ThreadPoolExecutor | None = None
        self._big_tokenizer = tokenizer
        stop = list(gen.stop_token_ids)
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None and int(eos) not in stop:
            stop.append(int(eos))
        self.stop_token_ids = [int(t) for t in stop]

    # ---------------------------------------------------------------- lifecycle
    @property
    def base_url(self) -> str:
        if self._runner is None:
            raise RuntimeError("AgentProxy.base_url before start()")
        return f"http://{self.host}:{self.port}/v1"

    @property
    def max_tokens_per_turn(self) -> int:
        return self.multi_turn.max_tokens_per_turn or self.gen.max_new_tokens

    @property
    def max_completions_per_episode(self) -> int:
        return self.multi_turn.max_completions_per_episode or self.multi_turn.max_assistant_turns

    @property
    def max_total_tokens(self) -> int:
        limits = [x for x in (self.multi_turn.max_total_tokens, self.max_context_len) if x]
        return min(limits)

    @property
    def max_prompt_chars(self) -> int:
        """Longest chat text (contents + tools, characters) tokenized at all (module doc, Request size)."""
        return self.max_total_tokens * self.multi_turn.max_request_bytes_per_token

    @property
    def max_request_bytes(self) -> int:
        """Largest request body accepted (module doc, Request size)."""
        return self.max_prompt_chars + _BODY_OVERHEAD

    async def start(self) -> "AgentProxy":
        if self._runner is not None:
            return self
        app = web.Application(client_max_size=self.max_request_bytes, middlewares=[_errors])
        app.router.add_post("/v1/chat/completions", self._capped(self._chat))
        app.router.add_post("/v1/completions", self._capped(self._completions))
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/rl/set_reward", self._set_reward)
        self._tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-proxy-tokenizer")
        self._big_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-proxy-tokenizer-large")
        try:  # the large lane's own copy: the two threads never share a (Rust) tokenizer
            self._big_tokenizer = copy.deepcopy(self.tokenizer)
        except Exception as e:  # not copyable: both lanes share one thread (correct, only slower for others)
            log.warning("agent proxy: the tokenizer cannot be copied (%s: %s); large requests share the "
                        "tokenizer thread with the small ones", type(e).__name__, e)
            self._big_pool.shutdown(wait=False)
            self._big_pool = None
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self._runner = runner
        self.port = runner.addresses[0][1]
        return self

    async def close(self) -> None:
        for s in list(self._sessions.values()):
            self.close_session(s)
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        for pool in (self._tok_pool, self._big_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._tok_pool = self._big_pool = None

    async def __aenter__(self) -> "AgentProxy":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---------------------------------------------------------------- sessions
    def open_session(self, group_id: str, index: int) -> Session:
        key = "sk-areal-like-" + secrets.token_urlsafe(24)
        s = Session(group_id=str(group_id), index=int(index), api_key=key)
        self._sessions[key] = s
        return s

    def close_session(self, session: Session) -> None:
        """Forget the key (later requests get 401) and cancel the session's generations in flight
        (their requests answer 409 and are not recorded)."""
        session.closed = True
        self._sessions.pop(session.api_key, None)
        for t in list(session.inflight):
            t.cancel()

    def session_trajectories(self, session: Session, **kw: Any) -> list[Trajectory]:
        """`session_trajectories(session, …)` (module function), for callers holding the proxy."""
        return session_trajectories(session, **kw)

    # ---------------------------------------------------------------- HTTP plumbing
    def _capped(self, handler):
        """`handler` behind the per-episode completion cap (module doc, Limits). Checked before the body
        is parsed or tokenized: a refused request costs nothing."""

        async def capped(request: web.Request) -> web.StreamResponse:
            s = self._session(request)
            cap = self.max_completions_per_episode
            if s.admitted >= cap:
                s.refused += 1
                self.refused_completions += 1
                if self.refused_completions == 1:
                    log.warning("agent session %s-%d asked for completion %d past the per-episode cap %d "
                                "(rollout.multi_turn.max_completions_per_episode): refused; further refusals are "
                                "only counted", s.group_id, s.index, s.admitted + 1, cap)
                raise _bad(f"this episode already made {cap} completion(s), the most "
                           f"rollout.multi_turn.max_completions_per_episode allows (null = max_assistant_turns): "
                           f"end the episode and return its reward", code="max_completions_per_episode_exceeded")
            s.admitted += 1
            try:
                resp = await handler(request)
            except BaseException:
                if not request.get(_RECORDED):
                    s.admitted -= 1  # nothing recorded (bad request, generation failure): not a completion
                raise
            if not request.get(_RECORDED):
                s.admitted -= 1  # the agent left before its reply was delivered: nothing recorded
            return resp

        return capped

    def _session(self, request: web.Request) -> Session:
        auth = request.headers.get("Authorization", "")
        if not auth:
            raise _ApiError(401, "missing Authorization header: send 'Authorization: Bearer <api_key of the "
                                 "session>' (the api_key the agent was given)", code="invalid_api_key")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _ApiError(401, "the Authorization header must be 'Bearer <api_key>'", code="invalid_api_key")
        s = self._sessions.get(key.strip())
        if s is None:
            raise _ApiError(401, "unknown or closed session api_key: use the api_key the agent was given, "
                                 "while its episode runs", code="invalid_api_key")
        return s

    def _too_large(self, size: str) -> _ApiError:
        return _ApiError(413, f"the request body ({size}) is larger than the agent proxy accepts: "
                              f"{self.max_request_bytes} bytes = {self.max_total_tokens} tokens of context × "
                              f"{_BYTES_KEY} ({self.multi_turn.max_request_bytes_per_token}) + {_BODY_OVERHEAD} "
                              f"(a conversation that long cannot fit the context): end the episode, or raise "
                              f"{_BYTES_KEY}", code="request_too_large")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        # Refused from the headers when the size is declared, never reading the body; a chunked body is read
        # only up to the bound (aiohttp's client_max_size, the same number).
        if request.content_length is not None and request.content_length > self.max_request_bytes:
            raise self._too_large(f"{request.content_length} bytes")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise self._too_large(f"more than {self.max_request_bytes} bytes, chunked") from None
        request[_BODY_BYTES] = len(raw)
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON: {e}"[:500]) from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        return body

    async def _tok(self, fn, *args, request: web.Request | None = None):
        """``fn(tokenizer, *args)`` in a tokenizer lane: the large one for a body over 64 KiB (module doc)."""
        if self._tok_pool is None:
            raise _ApiError(503, "the agent proxy is closed", type_="server_error")
        big = request is not None and request.get(_BODY_BYTES, 0) > _BIG_LANE_BYTES and self._big_pool is not None
        pool, tok = (self._big_pool, self._big_tokenizer) if big else (self._tok_pool, self.tokenizer)
        return await asyncio.get_running_loop().run_in_executor(pool, fn, tok, *args)

    def _check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse text that cannot fit the context before tokenizing it (module doc, Request size)."""
        if chars > self.max_prompt_chars:
            raise _bad(f"This model's maximum context length is {self.max_total_tokens} tokens; the prompt has "
                       f"{chars} characters, more than {self.max_prompt_chars} (= {self.max_total_tokens} × "
                       f"{_BYTES_KEY}), so it cannot fit: it is not tokenized. End the episode.", param=param,
                       code="context_length_exceeded")

    def _record(self, request: web.Request, s: Session, c: Completion) -> bool:
        """Record ``c`` once its reply is delivered; False (nothing recorded) when the agent left first."""
        if s.closed:
            raise _ApiError(409, "the session was closed while this completion was generating", type_="conflict_error")
        transport = request.transport
        if transport is None or transport.is_closing():
            log.info("agent session %s-%d disconnected before completion %s was delivered: not recorded",
                     s.group_id, s.index, c.id)
            return False
        s.add(c)
        request[_RECORDED] = True
        return True

    # ---------------------------------------------------------------- endpoints
    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response({"object": "list", "data": [{
            "id": MODEL_ID, "object": "model", "created": 0, "owned_by": "areal_like",
            "max_model_len": self.max_total_tokens}]})

    async def _set_reward(self, request: web.Request) -> web.Response:
        s = self._session(request)
        body = await self._body(request)
        r = body.get("reward")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise _bad(f"'reward' must be a finite number, got {r!r}"[:200], param="reward")
        cid = body.get("completion_id")
        if cid is None:
            if not s.completions:
                raise _ApiError(404, "the session has no completion yet to reward", type_="not_found_error",
                                param="completion_id")
            c = s.completions[-1]
        else:
            c = s.find(str(cid))
            if c is None:
                raise _ApiError(404, f"no completion {cid!r} in this session", type_="not_found_error",
                                param="completion_id")
        c.reward = float(r)
        return web.json_response({"completion_id": c.id, "reward": c.reward})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        s = self._session(request)
        body = await self._body(request)
        self._check_common(body)
        tc = body.get("tool_choice")
        if not (tc is None or tc in ("auto", "none")):
            raise _bad("tool_choice other than 'auto'/'none' is not supported: the proxy cannot force a tool "
                       "call without changing the sampled tokens", param="tool_choice")
        if body.get("top_logprobs"):
            raise _bad("top_logprobs is not supported by the agent proxy (only the sampled tokens' logprobs are "
                       "recorded)", param="top_logprobs")
        rf = body.get("response_format")
        if rf not in (None, {}) and not (isinstance(rf, dict) and rf.get("type") == "text"):
            raise _bad("response_format other than text is not supported", param="response_format")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                     for m in messages):
            raise _bad("'messages' must be a non-empty list of objects with a 'role'", param="messages")
        if not isinstance(body.get("separate_reasoning", True), bool):
            raise _bad("separate_reasoning must be true or false", param="separate_reasoning")
        tools = body.get("tools") or None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise _bad("'tools' must be a list of tool objects", param="tools")
        self._check_prompt_chars(_chat_chars(messages, tools), "messages")
        try:
            prompt_ids = await self._tok(self._render_chat, messages, tools, request=request)
        except _ApiError:
            raise
        except Exception as e:  # template errors (roles, tool shapes) are the caller's
            raise _bad(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                       param="messages") from None
        c, overridden = await self._generate(s, prompt_ids, body, "chatcmpl-", "messages",
                                             messages=messages, tools=tools)
        text, reasoning = c.text, None
        if self.multi_turn.reasoning_parser and body.get("separate_reasoning", True) is not False:
            reasoning, text = split_reasoning(text, self.multi_turn.reasoning_parser)
        content, calls, errors = _split_tool_calls(text, id_prefix=f"call_{c.id[-8:]}_{c.seq}")
        finish = "tool_calls" if calls else c.finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [t.to_openai() for t in calls]
        if errors:
            message["tool_call_errors"] = errors
        choice = {"index": 0, "message": message, "finish_reason": finish,
                  "logprobs": {"content": self._lp_content(c)} if body.get("logprobs") else None}
        if body.get("return_token_ids"):
            choice["token_ids"] = c.output_ids
        reply = self._envelope(c, body, "chat.completion", choice, overridden)
        if body.get("stream"):
            delta = {"role": "assistant", "content": content}
            if reasoning is not None:
                delta["reasoning_content"] = reasoning
            if calls:
                delta["tool_calls"] = [{"index": i, **t.to_openai()} for i, t in enumerate(calls)]
            first = {**choice, "delta": delta, "finish_reason": None}
            first.pop("message")
            last = {"index": 0, "delta": {}, "finish_reason": finish, "logprobs": None}
            return await self._stream(request, s, c, reply, "chat.completion.chunk", [first, last], overridden,
                                      _include_usage(body))
        self._record(request, s, c)
        return self._json(reply, overridden)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        s = self._session(request)
        body = await self._body(request)
        self._check_common(body)
        if body.get("echo"):
            raise _bad("echo is not supported by the agent proxy", param="echo")
        if body.get("suffix"):
            raise _bad("suffix is not supported by the agent proxy", param="suffix")
        lp = body.get("logprobs")
        if lp not in (None, 0, 1) or isinstance(lp, bool):
            raise _bad("logprobs must be 0 or 1 here: only the sampled tokens' logprobs are recorded",
                       param="logprobs")
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            self._check_prompt_chars(len(prompt), "prompt")
            prompt_ids = await self._tok(self._encode, prompt, request=request)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            vocab = len(self.tokenizer)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise _bad(f"'prompt' has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param="prompt")
            prompt_ids = list(prompt)
        else:
            raise _bad("'prompt' must be one non-empty string or one non-empty list of token ids (batches are "
                       "not supported: one completion per request)", param="prompt")
        if not prompt_ids:
            raise _bad("'prompt' tokenizes to nothing", param="prompt")
        c, overridden = await self._generate(s, prompt_ids, body, "cmpl-", "prompt", prompt=prompt)
        choice = {"index": 0, "text": c.text, "finish_reason": c.finish_reason,
                  "logprobs": self._lp_legacy(c) if lp is not None else None}
        if body.get("return_token_ids"):
            choice["token_ids"] = c.output_ids
        reply = self._envelope(c, body, "text_completion", choice, overridden)
        if body.get("stream"):
            first = {**choice, "finish_reason": None}
            last = {"index": 0, "text": "", "finish_reason": c.finish_reason, "logprobs": None}
            return await self._stream(request, s, c, reply, "text_completion", [first, last], overridden,
                                      _include_usage(body))
        self._record(request, s, c)
        return self._json(reply, overridden)

    # ---------------------------------------------------------------- request checks and shaping
    def _check_common(self, body: dict[str, Any]) -> None:
        for name in ("n", "best_of"):
            v = body.get(name)
            if v is not None and v != 1:
                raise _bad(f"{name} must be 1 in the agent proxy (got {v!r}): every sample is its own agent run, "
                           f"with its own session", param=name)
        stop = body.get("stop")
        if stop not in (None, "", []):
            raise _bad("stop strings are not supported by the agent proxy (the recorded tokens must be exactly "
                       "the generated ones): end turns with EOS or generation.stop_token_ids", param="stop")
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            raise _bad("stream must be true or false", param="stream")

    def _overridden(self, body: dict[str, Any]) -> list[str]:
        """The request's sampling fields that the run's settings replace (module doc)."""
        g = self.gen
        out = [name for name, run in (("temperature", g.temperature), ("top_p", g.top_p), ("top_k", g.top_k))
               if body.get(name) is not None and body[name] != run]
        out += [name for name, neutral in (("frequency_penalty", 0), ("presence_penalty", 0),
                                           ("repetition_penalty", 1), ("min_p", 0))
                if body.get(name) is not None and body[name] != neutral]
        out += [name for name in ("seed", "logit_bias") if body.get(name) not in (None, {})]
        return out

    def _max_new_tokens(self, body: dict[str, Any], prompt_len: int, prompt_field: str) -> int:
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        req = body.get(name)
        if req is not None and (type(req) is not int or req < 1):
            raise _bad(f"{name} must be a positive integer, got {req!r}"[:200], param=name)
        total = self.max_total_tokens
        room = total - prompt_len
        if room <= 0:
            raise _bad(f"This model's maximum context length is {total} tokens (rollout.multi_turn.max_total_tokens "
                       f"/ server.max_context_len); the prompt has {prompt_len} tokens, which leaves no room to "
                       f"generate. End the episode.", param=prompt_field, code="context_length_exceeded")
        per_turn = self.max_tokens_per_turn
        return min(per_turn if req is None else min(req, per_turn), room)

    async def _generate(self, s: Session, prompt_ids: list[int], body: dict[str, Any], id_prefix: str,
                        prompt_field: str, **record: Any) -> tuple[Completion, list[str]]:
        max_new = self._max_new_tokens(body, len(prompt_ids), prompt_field)
        overridden = self._overridden(body)
        k = s.next_seq
        s.next_seq += 1
        g = self.gen
        gen_task = asyncio.ensure_future(self.client.generate(
            list(prompt_ids), max_new_tokens=max_new, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
            stop_token_ids=self.stop_token_ids, sampling_seed=self._seed(s, k), rid=f"{s.group_id}-{s.index}-c{k}",
            key=s.group_id))  # a group's samples share one server: prefix cache, one weight version
        s.inflight.add(gen_task)
        try:
            res = await gen_task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if s.closed and gen_task.cancelled() and not (me is not None and me.cancelling()):
                raise _ApiError(409, "the session was closed while this completion was generating",
                                type_="conflict_error") from None
            raise
        except Exception as e:  # every generation failure is the server's, not the agent's request
            raise _ApiError(502, f"generation failed: {type(e).__name__}: {e}"[:2000], type_="server_error",
                            code="generation_failed") from None
        finally:
            s.inflight.discard(gen_task)
        if s.closed:
            raise _ApiError(409, "the session was closed while this completion was generating", type_="conflict_error")
        ids = [int(t) for t in res.output_ids]
        text_ids = ids[:-1] if res.finish_reason == "stop" and ids and ids[-1] in self.stop_token_ids else ids
        text = await self._tok(self._decode, text_ids)
        c = Completion(id=id_prefix + uuid.uuid4().hex, seq=k, prompt_ids=list(prompt_ids), output_ids=ids,
                       output_logprobs=[float(x) for x in res.output_logprobs],
                       output_versions=[int(v) for v in res.output_versions], finish_reason=res.finish_reason,
                       text=text, created=time.time(), **record)
        return c, overridden  # recorded by `_record` once the reply is delivered

    def _seed(self, s: Session, k: int) -> int | None:
        from areal_like.workflow.rlvr import sample_seed

        if self.seed is None:
            return None
        # same stream as EpisodeContext.sampling_seed(index, turn=k): a first turn samples like rlvr's
        return sample_seed(self.seed, s.group_id if k == 0 else f"{s.group_id}/t{k}", s.index)

    # tokenizer thread
    @classmethod
    def _render_chat(cls, tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        flat = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise _bad("only text content parts are supported", param="messages")
                content = "".join(str(p.get("text", "")) for p in content)
            flat.append({**m, "content": "" if content is None else content})  # None renders as "None"
        kwargs = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True, **kwargs)
        if not isinstance(text, str) or not text:
            raise _bad("the chat template produced an empty prompt", param="messages")
        return cls._encode(tokenizer, text)

    @staticmethod
    def _encode(tokenizer, text: str) -> list[int]:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

    @staticmethod
    def _decode(tokenizer, ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    def _token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _lp_content(self, c: Completion) -> list[dict[str, Any]]:
        out = []
        for tid, lp in zip(c.output_ids, c.output_logprobs):
            t = self._token_text(tid)
            out.append({"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []})
        return out

    def _lp_legacy(self, c: Completion) -> dict[str, Any]:
        toks = [self._token_text(t) for t in c.output_ids]
        offsets, pos = [], 0
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": toks, "token_logprobs": list(c.output_logprobs), "top_logprobs": [None] * len(toks),
                "text_offset": offsets}

    @staticmethod
    def _envelope(c: Completion, body: dict[str, Any], obj: str, choice: dict[str, Any],
                  overridden: list[str]) -> dict[str, Any]:
        reply: dict[str, Any] = {
            "id": c.id, "object": obj, "created": int(c.created), "model": body.get("model") or MODEL_ID,
            "choices": [choice],
            "usage": {"prompt_tokens": len(c.prompt_ids), "completion_tokens": len(c.output_ids),
                      "total_tokens": len(c.prompt_ids) + len(c.output_ids)}}
        if body.get("return_token_ids"):
            reply["prompt_token_ids"] = c.prompt_ids
        if overridden:
            reply["sampling_overridden"] = overridden
        return reply

    @staticmethod
    def _json(reply: dict[str, Any], overridden: list[str]) -> web.Response:
        headers = {OVERRIDE_HEADER: ",".join(overridden)} if overridden else None
        return web.json_response(reply, headers=headers)

    async def _stream(self, request: web.Request, s: Session, c: Completion, reply: dict[str, Any], obj: str,
                      choices: list[dict[str, Any]], overridden: list[str], include_usage: bool) -> web.StreamResponse:
        """Stream the reply, then record ``c`` if the agent is still there to have read it all (`_record`)."""
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        if overridden:
            headers[OVERRIDE_HEADER] = ",".join(overridden)
        resp = web.StreamResponse(headers=headers)
        if s.closed:
            self._record(request, s, c)  # raises the 409
        base = {k: v for k, v in reply.items() if k not in ("choices", "usage")}
        try:
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("the agent disconnected while the completion was generating")
            await resp.prepare(request)
            for ch in choices:
                await resp.write(b"data: " + json.dumps({**base, "object": obj, "choices": [ch]}).encode() + b"\n\n")
            if include_usage:
                await resp.write(b"data: " + json.dumps({**base, "object": obj, "choices": [],
                                                          "usage": reply["usage"]}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError as e:  # aiohttp's ClientConnectionResetError is one
            log.info("agent session %s-%d disconnected from the stream of completion %s (%s): not recorded",
                     s.group_id, s.index, c.id, e)
            return resp
        self._record(request, s, c)
        return resp


def _chat_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """Characters of a chat's text (every content, text part and tool-call argument; tools as JSON): what
    the template renders, bounded cheaply before any tokenization."""
    n = 0
    for m in messages:
        for v in m.values():
            if isinstance(v, str):
                n += len(v)
            elif isinstance(v, (list, dict)):
                n += len(json.dumps(v))
    if tools:
        n += len(json.dumps(tools))
    return n


def _include_usage(body: dict[str, Any]) -> bool:
    so = body.get("stream_options")
    return isinstance(so, dict) and so.get("include_usage") is True


def _split_tool_calls(text: str, *, id_prefix: str):
    """(content, well-formed calls, errors of malformed calls). Content is the text without the
    well-formed calls and is not stripped: a turn without calls comes back exactly as generated, so
    the chat template re-renders it into the same tokens (what `concat` export needs). A malformed call
    stays in the content as written."""
    _, calls = parse_tool_calls(text, id_prefix=id_prefix)
    good = [c for c in calls if c.error is None]
    errors = [{"id": c.id, "error": c.error, "raw": c.raw} for c in calls if c.error is not None]
    content = text
    for c in good:
        content = content.replace(TOOL_CALL_OPEN + c.raw + TOOL_CALL_CLOSE, "", 1)
    return content, good, errors


# ---- export ---------------------------------------------------------------------------------------
def completion_rewards(completions: list[Completion], reward: "float | dict[str, float] | None",
                       turn_discount: float = 1.0) -> list[float]:
    """Each completion's reward after AReaL's backward discount (module doc), in session order."""
    if not completions:
        return []
    own: list[float | None] = [c.reward for c in completions]
    if isinstance(reward, dict):
        index = {c.id: i for i, c in enumerate(completions)}
        unknown = [k for k in reward if k not in index]
        if unknown:
            raise ValueError(f"the agent returned rewards for unknown completion ids {unknown[:5]} (known: "
                             f"{list(index)[:5]})")
        for k, v in reward.items():
            own[index[k]] = _finite(v, f"reward of completion {k}")
    elif reward is not None:
        own[-1] = _finite(reward, "the agent's reward")
    if own[-1] is None:
        log.warning("the last completion %s of a session has no reward (none returned or set): it counts 0.0",
                    completions[-1].id)
    out = [0.0] * len(own)
    nxt = 0.0
    for i in range(len(own) - 1, -1, -1):
        nxt = (own[i] or 0.0) + (turn_discount * nxt if i < len(own) - 1 else 0.0)
        out[i] = nxt
    return out


def _finite(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise ValueError(f"{what} must be a finite number, got {v!r}")
    return float(v)


def _chains(completions: list[Completion]) -> bool:
    """True when each prompt starts with the previous completion's prompt + output (token prefix)."""
    for prev, cur in zip(completions, completions[1:]):
        n = len(prev.prompt_ids) + len(prev.output_ids)
        if len(cur.prompt_ids) < n or cur.prompt_ids[:len(prev.prompt_ids)] != prev.prompt_ids \
                or cur.prompt_ids[len(prev.prompt_ids):n] != prev.output_ids:
            return False
    return True


def session_trajectories(session: Session, *, group_id: str, prompt_id: str, data_source: str = "", index: int,
                         reward: "float | dict[str, float] | None", export_style: str = "concat",
                         turn_discount: float = 1.0) -> list[Trajectory]:
    """The session's completions as Trajectories (module doc: rewards, `concat` vs `individual`).
    No completion → []. traj_id `{group_id}-{index}` (concat) or `{group_id}-{index}-c{k}`."""
    if export_style not in EXPORT_STYLES:
        raise ValueError(f"export_style {export_style!r}: use one of {', '.join(EXPORT_STYLES)} "
                         f"(rollout.multi_turn.export_style)")
    if not (math.isfinite(turn_discount) and turn_discount >= 0):
        raise ValueError(f"turn_discount must be a finite number >= 0, got {turn_discount!r}")
    comps = list(session.completions)
    if not comps:
        return []
    rewards = completion_rewards(comps, reward, turn_discount)
    if export_style == "concat" and _chains(comps):
        first = comps[0]
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        mask: list[int] = []
        done = len(first.prompt_ids)  # tokens of the conversation already in the trajectory
        for c in comps:
            glue = c.prompt_ids[done:]  # tool results, user turns, template tokens: context, not trained
            ids += glue
            lps += [0.0] * len(glue)
            vers += [-1] * len(glue)
            mask += [0] * len(glue)
            ids += c.output_ids
            lps += c.output_logprobs
            vers += c.output_versions
            mask += [1] * len(c.output_ids)
            done = len(c.prompt_ids) + len(c.output_ids)
        return [Trajectory.build(
            traj_id=f"{group_id}-{index}", group_id=group_id, prompt_id=prompt_id, prompt_ids=first.prompt_ids,
            output_ids=ids, output_logprobs=lps, output_versions=vers, output_loss_mask=mask, reward=rewards[-1],
            finish_reason=comps[-1].finish_reason, data_source=data_source)]
    return [Trajectory.build(
        traj_id=f"{group_id}-{index}-c{k}", group_id=group_id, prompt_id=prompt_id, prompt_ids=c.prompt_ids,
        output_ids=c.output_ids, output_logprobs=c.output_logprobs, output_versions=c.output_versions,
        output_loss_mask=[1] * len(c.output_ids), reward=r, finish_reason=c.finish_reason, data_source=data_source)
        for k, (c, r) in enumerate(zip(comps, rewards))]
