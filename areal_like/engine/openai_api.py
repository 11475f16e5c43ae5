"""OpenAI-compatible `/v1/completions`, `/v1/chat/completions` and `/v1/models` on the embedded server.

The handlers translate OpenAI fields into the native sampling params, then run the same Jobs
through the same scheduler as `/generate` (so batching, prefix reuse of `n`, seeds, stop strings,
pause/abort and weight versions behave identically). Chat prompts come from the tokenizer's chat
template. Logprobs keep the server's one definition (log_softmax(logits / temperature), full vocab).

Extensions (as in SGLang/vLLM), all optional:
- request: `top_k`, `min_p`, `min_tokens`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
  `skip_special_tokens`, `no_stop_trim`, `return_token_ids` (adds `prompt_token_ids` and per-choice
  `token_ids`), `return_tokens_as_token_ids` (logprob tokens rendered as "token_id:<id>"),
  `chat_template_kwargs`.
- reply: per choice `matched_stop` and `weight_version`.
Not supported (400, never silently ignored): `echo`, `suffix`, `best_of` ≠ n, `logit_bias`, tools,
non-text `response_format`, audio, predicted outputs, web search. Unknown fields are a 400 naming
them (as OpenAI's own API; SGLang and vLLM ignore them): every field OpenAI documents for the
endpoint is known — request metadata (`model`, `user`, `metadata`, `store`, `service_tier`, …) is
accepted and ignored. Flags must be booleans and numbers finite (the native validator's rules).

This module knows nothing of the model or KV; it only shapes requests and replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

from aiohttp import web

from areal_like.engine.errors import BadRequest
from areal_like.engine.jobs import Job

OPENAI_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/models"}
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs

# Known top-level fields. OpenAI's documented ones plus the SGLang/vLLM extensions in the module doc;
# *_NOOP fields are accepted only at their no-op value, *_META ones with any value (they change nothing here).
_EXTENSIONS = {"top_k", "min_p", "min_tokens", "repetition_penalty", "ignore_eos", "stop_token_ids",
               "skip_special_tokens", "no_stop_trim", "return_token_ids", "return_tokens_as_token_ids"}
_COMMON = {"frequency_penalty", "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop", "stream",
           "stream_options", "temperature", "top_p"} | _EXTENSIONS
COMPLETION_FIELDS = _COMMON | {"prompt", "best_of"}
COMPLETION_NOOP = {"echo": (None, False), "suffix": (None, ""), "logit_bias": (None, {})}
COMPLETION_META = {"model", "user"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format",
                         "chat_template_kwargs"}
CHAT_NOOP = {"logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
             "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"),
             "audio": (None,), "prediction": (None,), "web_search_options": (None,), "modalities": (None, ["text"])}
CHAT_META = {"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort",
             "verbosity", "prompt_cache_key", "safety_identifier"}


class OpenAIRoutes:
    def __init__(self, server: Any):
        self.srv = server  # the GenerationServer (server.py) whose parsing, scheduling and replies these routes use

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)

    # ---------------------------------------------------------------- requests
    async def models(self, request: web.Request) -> web.Response:
        s = self.srv
        return web.json_response({"object": "list", "data": [{
            "id": s.model_name, "object": "model", "created": int(s.started), "owned_by": "areal_like",
            "root": s.runner.model_path, "max_model_len": s.args.max_context_len}]})

    def _sampling(self, body: dict[str, Any], prompt_len: int, default_max: int | None) -> dict[str, Any]:
        """OpenAI fields → the native sampling params, validated by the native validator (its
        errors name the OpenAI field)."""
        rf = body.get("response_format")
        if rf not in (None, {}) and not (isinstance(rf, dict) and rf.get("type") == "text"):
            raise BadRequest("response_format other than text is not supported by the embedded server")
        if body.get("best_of") not in (None, body.get("n") or 1):
            raise BadRequest("best_of must equal n")
        mt_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(mt_key)
        if max_tokens is None:
            max_tokens = default_max
        sp = {"max_new_tokens": max_tokens, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
              "n": body.get("n"), "stop": body.get("stop"), "sampling_seed": body.get("seed"),
              "frequency_penalty": body.get("frequency_penalty"), "presence_penalty": body.get("presence_penalty"),
              "repetition_penalty": body.get("repetition_penalty"), "top_k": body.get("top_k"),
              "min_p": body.get("min_p"), "min_new_tokens": body.get("min_tokens"),
              "ignore_eos": body.get("ignore_eos"), "stop_token_ids": body.get("stop_token_ids"),
              "skip_special_tokens": body.get("skip_special_tokens"), "no_stop_trim": body.get("no_stop_trim")}
        sp = {k: v for k, v in sp.items() if v is not None or k == "max_new_tokens"}
        names = {"max_new_tokens": mt_key, "sampling_seed": "seed", "min_new_tokens": "min_tokens"}
        return self.srv._sampling(sp, prompt_len, where="", names=names)

    async def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        srv = self.srv
        if isinstance(prompt, str):
            return await srv.text_prompts([prompt], "prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            srv.check_prompt_count(len(prompt), "'prompt'")
            return await srv.text_prompts(prompt, "prompt")
        if isinstance(prompt, list) and prompt:
            return srv.token_prompts(prompt, "prompt")[0]
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of lists")

    async def _chat_prompt(self, body: dict[str, Any]) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list")
        flat = []
        for m in msgs:
            if not isinstance(m, dict) or "role" not in m:
                raise BadRequest("each message must be an object with a 'role'")
            content = m.get("content")
            if isinstance(content, list):  # content parts: only text parts are understood
                if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                    raise BadRequest("only text content parts are supported")
                content = "".join(c.get("text", "") for c in content)
            flat.append({**m, "content": content if content is not None else ""})
        tok = self.srv.tokenizer
        if not getattr(tok, "chat_template", None):
            raise BadRequest("the tokenizer has no chat template")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("'chat_template_kwargs' must be an object")

        def render() -> str:
            return tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=True, **kwargs)

        try:  # on the tokenizer thread: a long conversation does not stall the event loop
            text = await self.srv.run_tokenizer(render)
        except Exception as e:  # template errors (bad roles, …) are the caller's
            raise BadRequest(f"chat template failed: {type(e).__name__}: {e}")
        if not isinstance(text, str):
            raise BadRequest("chat template failed: it did not render a string")
        try:
            (ids,) = await self.srv.text_prompts([text], "messages")
        except BadRequest as e:
            if "is empty" in str(e):
                raise BadRequest("the chat template produced an empty prompt") from None
            raise
        return ids

    def _top_n(self, value: Any, name: str) -> int:
        if value is None:
            return 0
        if type(value) is not int:
            raise BadRequest(f"{name} must be an integer, got {value!r}"[:200])
        n = value
        if not 0 <= n <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"{name} must be in [0, {MAX_TOP_LOGPROBS}]")
        return n

    def _flags(self, body: dict[str, Any], *keys: str) -> None:
        for k in keys:
            if body.get(k) is not None and not isinstance(body[k], bool):
                raise BadRequest(f"{k} must be true or false, got {body[k]!r}"[:200])
        so = body.get("stream_options")
        if so is not None and not (isinstance(so, dict) and isinstance(so.get("include_usage", False), bool)):
            raise BadRequest("stream_options must be an object like {\"include_usage\": true}")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.srv._json(request)
        self.srv.check_fields(body, COMPLETION_FIELDS, COMPLETION_NOOP, COMPLETION_META, "/v1/completions")
        self._flags(body, "stream", "return_token_ids", "return_tokens_as_token_ids")
        prompts = await self._completion_prompts(body.get("prompt"))
        want_lp = body.get("logprobs") is not None
        top_n = self._top_n(body.get("logprobs"), "logprobs") if want_lp else 0
        params = [self._sampling(body, len(p), default_max=16) for p in prompts]  # OpenAI's default: 16
        return await self._run(request, body, "text_completion", prompts, params, want_lp, top_n)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.srv._json(request)
        self.srv.check_fields(body, CHAT_FIELDS, CHAT_NOOP, CHAT_META, "/v1/chat/completions")
        self._flags(body, "stream", "logprobs", "return_token_ids", "return_tokens_as_token_ids")
        prompt = await self._chat_prompt(body)
        want_lp = bool(body.get("logprobs"))
        top_n = self._top_n(body.get("top_logprobs"), "top_logprobs")
        if top_n and not want_lp:
            raise BadRequest("top_logprobs requires logprobs: true")
        params = [self._sampling(body, len(prompt), default_max=None)]  # chat default: up to the context limit
        return await self._run(request, body, "chat.completion", [prompt], params, want_lp, top_n)

    async def _run(self, request, body, kind, prompts, params, want_lp, top_n) -> web.StreamResponse:
        base = uuid.uuid4().hex
        rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + base
        jobs = self.srv.make_jobs(prompts, params, [f"{base}_{i}" if len(prompts) > 1 else base
                                                    for i in range(len(prompts))], top_n)
        try:  # a client that disconnects cancels this handler: its requests abort
            fmt = _Format(self.srv, kind, rid, body, want_lp, top_n)
            if body.get("stream"):
                return await self._stream(request, jobs, fmt, prompts)
            reqs = await _gather(self.srv, jobs)
            choices = [fmt.choice(j, r) for j, r in zip(jobs, reqs)]
            reply = fmt.envelope(choices)
            reply["usage"] = _usage(prompts, jobs)
            if fmt.return_token_ids:
                reply["prompt_token_ids"] = prompts[0] if len(prompts) == 1 else prompts
            return web.json_response(reply)
        finally:
            self.srv.release(jobs)

    async def _stream(self, request, jobs, fmt: "_Format", prompts) -> web.StreamResponse:
        """OpenAI SSE chunks: incremental text (or delta.content) and logprobs, finish_reason on
        each choice's last chunk, optional usage chunk (stream_options.include_usage), then [DONE]."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent_chars = [0] * len(jobs)
        sent_toks = [0] * len(jobs)

        async def write(obj: dict) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        try:
            async with contextlib.aclosing(self.srv.stream_progress(jobs)) as progress:
                async for job, req, final in progress:
                    fr = req.finish_reason if final else None
                    if fr and fr.get("type") == "abort" and fr.get("status_code") not in (None, 200):
                        msg = fr.get("message", "engine error")
                        await write({"error": {"message": msg, "code": fr["status_code"]}})
                        continue
                    i = job.index
                    seq = job.seq
                    text = self.srv.output_text(seq, job.sp, fr)
                    if not final:  # hold back what a stop string or a split character may still change
                        keep = len(text) - (max(map(len, seq.stop_strs)) - 1 if seq.stop_strs else 0)
                        text = text[:max(keep, sent_chars[i])].rstrip("\ufffd")
                    n = len(seq.output_ids)
                    delta = text[sent_chars[i]:]
                    first = sent_toks[i] == 0 and sent_chars[i] == 0
                    chunk = fmt.chunk(job, req, delta, sent_toks[i], n, final, first=first)
                    sent_chars[i] = max(sent_chars[i], len(text))
                    sent_toks[i] = n
                    await write(chunk)
            so = fmt.body.get("stream_options") or {}
            if so.get("include_usage"):
                await write({**fmt.envelope([], chunk=True), "usage": _usage(prompts, jobs)})
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:
            await write({"error": {"message": f"{type(e).__name__}: {e}", "code": 500}})
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _gather(srv, jobs):
    return await asyncio.gather(*(srv.run_request(srv.scheduler.new_request(j.seq)) for j in jobs))


def _usage(prompts: list[list[int]], jobs: list[Job]) -> dict[str, int]:
    p = sum(len(x) for x in prompts)
    c = sum(len(j.seq.output_ids) for j in jobs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _finish(fr: dict[str, Any] | None) -> str | None:
    return None if fr is None else fr.get("type")


class _Format:
    """Shapes one request's choices and chunks (completion or chat)."""

    def __init__(self, srv, kind: str, rid: str, body: dict, want_lp: bool, top_n: int):
        self.srv, self.kind, self.rid, self.body = srv, kind, rid, body
        self.chat = kind == "chat.completion"
        self.want_lp, self.top_n = want_lp, top_n
        self.created = int(time.time())
        self.return_token_ids = bool(body.get("return_token_ids"))
        self.as_ids = bool(body.get("return_tokens_as_token_ids"))

    def envelope(self, choices: list[dict], chunk: bool = False) -> dict[str, Any]:
        obj = self.kind + (".chunk" if chunk and self.chat else "")
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.srv.model_name,
                "choices": choices}

    def _tok(self, tid: int) -> str:
        return f"token_id:{tid}" if self.as_ids else self.srv._tok_text(tid)

    def _logprobs(self, seq, start: int, end: int, text_offset0: int = 0) -> dict[str, Any] | None:
        if not self.want_lp:
            return None
        ids, lps = seq.output_ids[start:end], seq.output_logprobs[start:end]
        tops = seq.output_top[start:end] if self.top_n else [None] * len(ids)
        if self.chat:
            content = []
            for tid, lp, top in zip(ids, lps, tops):
                t = self._tok(tid)
                entry = {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                if top is not None:
                    entry["top_logprobs"] = [{"token": self._tok(i), "logprob": v, "bytes": list(self._tok(i).encode())}
                                             for v, i in zip(*top)]
                content.append(entry)
            return {"content": content}
        tokens = [self._tok(t) for t in ids]
        offsets, off = [], text_offset0
        for t in tokens:
            offsets.append(off)
            off += len(t)
        top_lp = None
        if self.top_n:
            top_lp = [{self._tok(i): v for v, i in zip(*top)} if top is not None else None for top in tops]
        return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top_lp, "text_offset": offsets}

    def choice(self, job: Job, req) -> dict[str, Any]:
        seq, fr = job.seq, req.finish_reason
        text = self.srv.output_text(seq, job.sp, fr)
        c: dict[str, Any] = {"index": job.index}
        if self.chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        c["logprobs"] = self._logprobs(seq, 0, len(seq.output_ids))
        c["finish_reason"] = _finish(fr)
        c["matched_stop"] = fr.get("matched") if fr else None
        c["weight_version"] = req.weight_version
        if self.return_token_ids:
            c["token_ids"] = list(seq.output_ids)
        return c

    def chunk(self, job: Job, req, delta: str, start: int, end: int, final: bool, first: bool) -> dict[str, Any]:
        seq = job.seq
        fr = req.finish_reason if final else None
        c: dict[str, Any] = {"index": job.index}
        if self.chat:
            c["delta"] = ({"role": "assistant"} if first else {}) | {"content": delta}
        else:
            c["text"] = delta
        c["logprobs"] = self._logprobs(seq, start, end)
        c["finish_reason"] = _finish(fr)
        if final:
            c["matched_stop"] = fr.get("matched") if fr else None
            c["weight_version"] = req.weight_version
        if self.return_token_ids:
            c["token_ids"] = list(seq.output_ids[start:end])
        return self.envelope([c], chunk=True)
