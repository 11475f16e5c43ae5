"""The embedded generation server: SGLang's native HTTP subset (shared/PROTOCOL.md) over our engine.

    python -m areal_like.engine.server --model-path DIR --host 127.0.0.1 --port P [--device cpu|cuda]
        [--dtype float32|bfloat16] [--max-batch-size 64] [--max-context-len 512] [--weight-version 0]
        [--random-seed S] [--api-key K] [--admin-api-key K] [--torch-threads N] [--max-prefill-tokens N]
        [--served-model-name NAME] [--disable-metrics] [--max-n 128] [--max-new-tokens-limit N]
        [--max-prompt-len N] [--max-request-bytes 8388608] [--max-queued-tokens N] [--start-paused]
    (the keys may come from AREAL_LIKE_API_KEY / AREAL_LIKE_ADMIN_API_KEY instead: argv is world-readable)

aiohttp on uvloop. This module parses and validates requests, tokenizes text, and shapes replies
(SGLang native protocol here, OpenAI-compatible /v1/* in `openai_api`); the scheduler (continuous
batching) and runner (model + slot KV cache) do the work on one engine thread. Weight receives
(blocking collectives) and tokenization of text prompts run on other threads, so the HTTP loop never
blocks. Not implemented (400 with a message, never silently ignored): constrained decoding
(json_schema, regex, ebnf, structural_tag), logit_bias, custom logit processors.

Hardening (one request must not take the server down):
- limits: body bytes (413, checked before reading), samples per request (`n` × prompts), prompt
  tokens, max_new_tokens (400), and the tokens all admitted requests may hold (prompt +
  max_new_tokens per sample; 400 if one request alone exceeds it, 429 while the queue is full);
  a text longer than any allowed prompt could be is refused before it is tokenized;
- strict validation: unknown top-level fields and sampling params are 400s naming the field;
  numbers must be finite, integers and token ids real integers (not booleans), flags booleans;
- a client that disconnects cancels its handler (aiohttp `handler_cancellation`), which aborts its
  requests and frees their KV rows; admin handlers are shielded so a weight update runs to its end;
- `/health` answers as soon as the engine completes a step (SGLang's rule), so a full batch never
  makes a live server look dead.

Authentication (SGLang's three levels, `sglang/srt/utils/auth.py`): `/health*` and `/metrics` are open;
admin endpoints (`ADMIN_PATHS`: weight updates, pause/continue, flush, `/get_weights_by_name` and
`/abort_request`, per-rid and `abort_all` alike) take the admin key when one is set, else the api key,
else nothing; every other endpoint takes the api key (or the admin key) when an api key is set. So with
`--admin-api-key` set, an unauthenticated `POST /abort_request {"abort_all": true}` is a 401 and
running requests finish. Our own code never calls /abort_request: clients cancel by disconnecting.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import random
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import areal_like
from areal_like import metrics
from areal_like.engine.errors import BadRequest, PayloadTooLarge, RequestError, TooManyQueued
from areal_like.engine.lora import NOT_ENABLED, LoraRegistry
from areal_like.engine.openai_api import OPENAI_PATHS, OpenAIRoutes
from areal_like.engine.runner import ModelRunner, Seq
from areal_like.engine.sampling import derive_seed
from areal_like.engine.scheduler import Request, Scheduler
from areal_like.learner.logprobs import token_logprobs_from_logits
from areal_like.weights.receive import WeightReceiver
from areal_like.weights.shm import LOAD_FORMAT as SHM_LOAD_FORMAT
from areal_like.weights.shm import ShmReader

log = logging.getLogger("areal_like.engine.server")

# sampling_params keys SGLang accepts. Unknown keys are a 400 (as SGLang ≥ 0.5.22).
SUPPORTED_PARAMS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "min_new_tokens", "stop",
                    "stop_token_ids", "ignore_eos", "skip_special_tokens", "no_stop_trim", "n", "sampling_seed",
                    "frequency_penalty", "presence_penalty", "repetition_penalty",
                    "spaces_between_special_tokens", "stream_interval"}
# Accepted only at their no-op value: anything else is a 400 saying the embedded server lacks it.
NOOP_PARAMS = {"json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,),
               "logit_bias": (None, {}), "custom_params": (None,)}
# Top-level /generate fields. SGLang's GenerateReqInput has more; those listed in GENERATE_NOOP are
# accepted at their no-op value only, GENERATE_META (request bookkeeping) with any value, anything
# else is a 400 naming the field.
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
                   "top_logprobs_num", "return_text_in_logprobs", "stream", "lora_path"}
GENERATE_NOOP = {"input_embeds": (None,), "image_data": (None, []), "video_data": (None, []),
                 "audio_data": (None, []), "modalities": (None, []), "session_params": (None,),
                 "lora_id": (None,), "custom_logit_processor": (None,),
                 "token_ids_logprob": (None,), "return_hidden_states": (None, False),
                 "return_routed_experts": (None, False), "return_entropy": (None, False),
                 "return_bytes": (None, False), "return_prompt_token_ids": (None, False),
                 "background": (None, False), "bootstrap_host": (None,), "bootstrap_port": (None,),
                 "bootstrap_room": (None,), "bootstrap_pair_key": (None,), "data_parallel_rank": (None, 0),
                 "routed_dp_rank": (None, 0)}
GENERATE_META = {"log_metrics", "no_logs", "custom_labels", "conversation_id", "session_id", "routing_key",
                 "extra_key", "priority"}
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 64, 1024, 1024
RECV_SLOTS = 2  # receive buffers per weight group: bucket k+1 arrives while bucket k loads
# SGLang's ADMIN_OPTIONAL level (sglang/srt/utils/auth.py): the admin key when one is set, else the api
# key, else open. /abort_request is on it in SGLang (≥ 0.5.2x), per-rid aborts included: a rid is no
# secret (rids are guessable and prefix-matched), so an api-key holder must not abort others' requests.
ADMIN_PATHS = {"/pause_generation", "/continue_generation", "/flush_cache", "/init_weights_update_group",
               "/release_memory_occupation", "/resume_memory_occupation",
               "/update_weights_from_distributed", "/destroy_weights_update_group", "/update_weights_from_disk",
               "/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update", "/get_weights_by_name", "/abort_request",
               "/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter_from_distributed",
               "/update_weight_version"}
OPEN_PATHS = {"/health", "/health_generate", "/metrics"}


def error(message: str, status: int = 400, openai: bool = False) -> web.Response:
    body: dict[str, Any] = {"message": message}
    if openai:  # OpenAI's error object is a superset of the native one
        kind = {400: "BadRequestError", 401: "Unauthorized", 413: "RequestTooLargeError",
                429: "RateLimitError"}.get(status, "InternalServerError")
        body.update(type=kind, param=None, code=status)
    return web.json_response({"error": body}, status=status)


def _short(v: Any, n: int = 60) -> str:
    """repr of a client's value, cut to `n` characters for error messages."""
    r = repr(v)
    return r if len(r) <= n else r[:n] + "…"


def _finite(v: int | float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond float range
        return False


def _max_token_chars(tokenizer) -> int:
    """The most characters one token can stand for (its vocabulary string is at least as long:
    byte-level BPE spells each byte as one character)."""
    try:
        return max(1, max(len(t) for t in tokenizer.get_vocab()))
    except Exception:  # a tokenizer without a readable vocabulary: a generous guess
        return 64


async def _shielded(coro):
    """Await `coro` as a task that a cancellation of the caller does not stop."""
    task = asyncio.ensure_future(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its outcome is nobody's now
        raise


def sse_error(message: str, status: int) -> bytes:
    return b"data: " + json.dumps({"error": {"message": message, "code": status}}).encode() + b"\n\n"


@dataclass
class Job:
    """One sample of a request: its Seq, its validated sampling params, where it goes in the reply."""

    seq: Seq
    sp: dict[str, Any]
    prompt_index: int
    index: int
    cost: int = 0  # tokens this sample holds in the queue budget: prompt + max_new_tokens


@dataclass
class GenOpts:
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    text_in_logprobs: bool = False
    stream: bool = False
    input_logprobs: dict[int, tuple[list, list]] = field(default_factory=dict)  # prompt index → (token, top)


class GenerationServer:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.runner = ModelRunner(args.model_path, device=args.device, dtype=args.dtype,
                                  max_context_len=args.max_context_len, max_batch_size=args.max_batch_size,
                                  max_prefill_tokens=args.max_prefill_tokens, fp32_lm_head=args.enable_fp32_lm_head,
                                  max_lora_rank=args.max_lora_rank if args.enable_lora else 0,
                                  lora_target_modules=args.lora_target_modules,
                                  max_loras_per_batch=args.max_loras_per_batch)
        self.tokenizer = self.runner.tokenizer
        self.scheduler = Scheduler(self.runner, max_batch_size=args.max_batch_size,
                                   weight_version=str(args.weight_version), text_stop=self._text_stop)
        self.model_name = args.served_model_name or args.model_path.rstrip("/").split("/")[-1]
        self.receiver = WeightReceiver(args.device)
        self.shm = ShmReader()  # /update_weights_from_tensor's shared-memory segments (co-located learner)
        self.rng = random.Random(args.random_seed)
        self.update_lock = asyncio.Lock()
        # update_weights_from_distributed overlaps bucket k's load (engine thread) with bucket k+1's receive:
        # per group, the loads of the update in flight (checked by the bucket that sets the version) and
        # the receive count (bucket k receives into buffer k % RECV_SLOTS, free once its last load ended)
        self._group_loads: dict[str, list[asyncio.Future]] = {}
        self._group_received: dict[str, int] = {}
        # /release_memory_occupation: what is released now, and whether the weights came back without
        # content (resumed, no update since) — generation cannot continue in either state
        self.released: set[str] = set()
        self.weights_undefined = False
        self.started = time.time()
        self.queued_tokens = 0  # Σ Job.cost of the requests being served (admission budget)
        # Text prompts are tokenized here, off the event loop (a fast tokenizer releases the GIL).
        self.tok_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.max_token_chars = _max_token_chars(self.tokenizer)
        self._set_version(str(args.weight_version))
        # --enable-lora: lora_name → adapter slot, and the buckets of /load_lora_adapter_from_distributed
        # received so far per lora_name (the bucket that sets weight_version is the last)
        self.loras = LoraRegistry() if args.enable_lora else None
        self.lora_lock = asyncio.Lock()
        self._lora_staged: dict[str, dict[str, torch.Tensor]] = {}
        self._lora_staged_cfg: dict[str, dict] = {}

    # ---------------------------------------------------------------- app
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors_and_auth], client_max_size=self.args.max_request_bytes)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/v1/loads", self.loads)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.continue_)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_get("/flush_cache", self.flush_cache)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_disk", self.update_disk)
        r.add_post("/update_weights_from_tensor", self.update_tensor)
        r.add_post("/get_weights_by_name", self.weights_by_name)
        r.add_post("/release_memory_occupation", self.release_memory)
        r.add_post("/resume_memory_occupation", self.resume_memory)
        r.add_post("/begin_weight_update", self.begin_end)
        r.add_post("/end_weight_update", self.begin_end)
        r.add_post("/load_lora_adapter", self.load_lora)
        r.add_post("/unload_lora_adapter", self.unload_lora)
        r.add_post("/load_lora_adapter_from_distributed", self.load_lora_distributed)
        r.add_post("/update_weight_version", self.update_weight_version)
        if not self.args.disable_metrics:  # metrics.prometheus=false: no /metrics (404)
            r.add_get("/metrics", self.metrics)
        OpenAIRoutes(self).add_to(app)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app) -> None:
        self.scheduler.start()
        if self.args.start_paused:  # a restarted server: hold requests until the learner pushed weights
            await self.scheduler.pause("abort")  # nothing is queued yet: exactly /pause_generation's state

    async def _on_cleanup(self, app) -> None:
        await self.scheduler.close()
        self.tok_executor.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.receiver.close)

    @web.middleware
    async def _errors_and_auth(self, request: web.Request, handler):
        path = request.path
        if path not in OPEN_PATHS:
            a = self.args
            if path in ADMIN_PATHS:
                keys = {a.admin_api_key} if a.admin_api_key else ({a.api_key} if a.api_key else set())
            else:
                keys = {k for k in (a.api_key, a.admin_api_key) if k} if a.api_key else set()
            if keys and request.headers.get("Authorization", "").removeprefix("Bearer ").strip() not in keys:
                return error("Unauthorized", 401, openai=path in OPENAI_PATHS)
        oa = path in OPENAI_PATHS
        try:
            if path in ADMIN_PATHS:  # a caller that disconnects must not cut a weight update in half
                return await _shielded(handler(request))
            return await handler(request)  # cancelled if the client disconnects: its requests abort
        except RequestError as e:
            return error(str(e), e.status, oa)
        except web.HTTPException as e:
            if e.status >= 400:
                return error(e.reason or str(e), e.status, oa)
            raise
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("%s failed", path)
            return error(f"{type(e).__name__}: {e}", 500, oa)

    async def _json(self, request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        limit = self.args.max_request_bytes
        too_big = (f"request body of {{}} bytes is over the server's limit of {limit} bytes "
                   f"(--max-request-bytes / server.max_request_mb)")
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLarge(too_big.format(request.content_length))  # refused before reading it
        try:
            raw = await request.read()  # aiohttp stops a chunked body at client_max_size
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLarge(too_big.format(f"more than {limit}")) from None
        try:
            body = json.loads(raw)  # (json, not msgspec: NaN must parse so the 400 can name its field)
        except (ValueError, RecursionError) as e:
            raise BadRequest(f"request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def _set_version(self, version: str) -> None:
        self.scheduler.weight_version = version
        try:
            metrics.SERVER_WEIGHT_VERSION.set(float(version))
        except ValueError:
            pass

    # ---------------------------------------------------------------- /generate
    def check_fields(self, body: dict[str, Any], allowed: set[str], noop: dict[str, tuple], meta: set[str],
                     what: str) -> None:
        """400 naming every unknown top-level field, or a known one set to what we do not support."""
        unknown = [k for k in body if k not in allowed and k not in noop and k not in meta]
        if unknown:
            names = ", ".join(repr(k) for k in unknown)
            raise BadRequest(f"unknown field{'s' if len(unknown) > 1 else ''} {names} in the {what} body "
                             f"(supported: {', '.join(sorted(allowed))})")
        for k, ok in noop.items():
            if k in body and body[k] not in ok:
                raise BadRequest(f"{k}={_short(body[k])} is not supported by the embedded server")

    def check_prompt_len(self, n: int, where: str) -> None:
        ctx, lim = self.args.max_context_len, self.args.max_prompt_len
        if n >= ctx:
            raise BadRequest(f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens).")
        if n > lim:
            raise BadRequest(f"{where}: the input ({n} tokens) is longer than the server's prompt limit of {lim} "
                             f"tokens (--max-prompt-len)")

    def check_prompt_count(self, n: int, where: str) -> None:
        if n > self.args.max_n:
            raise BadRequest(f"{where} holds {n} prompts; one request may ask for at most {self.args.max_n} "
                             f"samples (--max-n)")

    def token_prompts(self, ids: Any, name: str) -> tuple[list[list[int]], bool]:
        """`ids` (a list of token ids, or a list of such lists) validated: (prompts, is_batch).
        Lengths and counts are checked before any per-token work; token ids must be real integers."""
        if not isinstance(ids, list) or not ids:
            raise BadRequest(f"'{name}' is empty" if ids == [] else
                             f"'{name}' must be a list of token ids or a list of lists of token ids")
        batch = isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        if batch:
            self.check_prompt_count(len(prompts), f"'{name}'")
        V = self.runner.vocab_size
        for k, p in enumerate(prompts):
            where = f"'{name}'" + (f"[{k}]" if batch else "")
            if not isinstance(p, list):
                raise BadRequest(f"'{name}' must be a list of token ids or a list of lists of token ids")
            if not p:
                raise BadRequest(f"{where} is empty")
            self.check_prompt_len(len(p), where)
            if not (all(type(t) is int for t in p) and 0 <= min(p) and max(p) < V):
                pos, bad = next((i, t) for i, t in enumerate(p) if type(t) is not int or not 0 <= t < V)
                raise BadRequest(f"{where} must be token ids (integers in [0, {V})): got {_short(bad)} at "
                                 f"position {pos}")
        return prompts, batch

    async def text_prompts(self, texts: list[str], name: str) -> list[list[int]]:
        """Tokenize `texts` on the tokenizer thread; a text too long for any allowed prompt is refused
        before it is tokenized (a token spans at most `max_token_chars` characters; ×4 for safety)."""
        limit = 4 * self.args.max_prompt_len * self.max_token_chars
        for k, t in enumerate(texts):
            if len(t) > limit:
                where = f"'{name}'" + (f"[{k}]" if len(texts) > 1 else "")
                raise BadRequest(f"{where} is {len(t)} characters long: longer than any prompt of at most "
                                 f"{self.args.max_prompt_len} tokens (--max-prompt-len) can be")
        prompts = await asyncio.get_running_loop().run_in_executor(self.tok_executor, self._encode, texts)
        for k, p in enumerate(prompts):
            where = f"'{name}'" + (f"[{k}]" if len(texts) > 1 else "")
            if not p:
                raise BadRequest(f"{where} is empty")
            self.check_prompt_len(len(p), where)
        return prompts

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Tokenizer thread: token ids of each text (no special tokens added)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the Rust batch encode releases the GIL: the event loop keeps running
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    async def run_tokenizer(self, fn, *args):
        """Run `fn` (template rendering, tokenization) on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tok_executor, fn, *args)

    async def _prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("give exactly one of 'text' or 'input_ids'")
        if text is not None:
            if isinstance(text, str):
                return await self.text_prompts([text], "text"), False
            if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                self.check_prompt_count(len(text), "'text'")
                return await self.text_prompts(text, "text"), True
            raise BadRequest("'text' must be a string or a non-empty list of strings")
        return self.token_prompts(ids, "input_ids")

    def _sampling(self, sp: Any, prompt_len: int, where: str = "sampling_params.",
                  names: dict[str, str] | None = None) -> dict[str, Any]:
        """Validated sampling params with defaults. Errors name the field as the caller wrote it:
        `where` + (`names[key]` or key) — OpenAI's handlers pass their own field names."""
        names = names or {}

        def fld(key: str) -> str:
            return f"{where}{names.get(key, key)}"

        if sp is None:
            sp = {}
        if not isinstance(sp, dict):
            raise BadRequest("'sampling_params' must be an object")
        unknown = set(sp) - SUPPORTED_PARAMS - set(NOOP_PARAMS)
        if unknown:
            raise BadRequest(f"unknown sampling_params: {sorted(unknown)}")
        for k, noop in NOOP_PARAMS.items():
            if k in sp and sp[k] not in noop:
                raise BadRequest(f"{fld(k)}={_short(sp[k])} is not supported by the embedded server")

        def num(key: str, default: float) -> float:
            v = sp.get(key)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
                raise BadRequest(f"{fld(key)} must be a finite number, got {_short(v)}")
            return float(v)

        def integer(key: str, default: int | None) -> int | None:
            v = sp.get(key)
            if v is None:
                return default
            if type(v) is not int:
                raise BadRequest(f"{fld(key)} must be an integer, got {_short(v)}")
            return v

        def flag(key: str, default: bool) -> bool:
            v = sp.get(key)
            if v is None:
                return default
            if not isinstance(v, bool):
                raise BadRequest(f"{fld(key)} must be true or false, got {_short(v)}")
            return v

        ctx, a = self.args.max_context_len, self.args
        if prompt_len >= ctx:
            raise BadRequest(f"The input ({prompt_len} tokens) is longer than the model's context length ({ctx} tokens).")
        if "max_new_tokens" in sp and sp["max_new_tokens"] is None:  # null: up to the context (and server) limit
            mnt = min(ctx - prompt_len, a.max_new_tokens_limit)
        else:
            mnt = integer("max_new_tokens", min(128, a.max_new_tokens_limit))
        stop = sp.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise BadRequest(f"{fld('stop')} must be a string or a list of strings")
        if len(stop) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_CHARS for x in stop):
            raise BadRequest(f"{fld('stop')}: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                             f"characters each")
        stop_ids = sp.get("stop_token_ids") or []
        V = self.runner.vocab_size
        if not isinstance(stop_ids, list) or not all(type(t) is int and 0 <= t < V for t in stop_ids):
            raise BadRequest(f"{fld('stop_token_ids')} must be token ids (integers in [0, {V}))")
        stop_ids = sorted(set(stop_ids))
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise BadRequest(f"{fld('stop_token_ids')}: at most {MAX_STOP_TOKEN_IDS} ids")
        flag("spaces_between_special_tokens", True)  # accepted (type-checked); our detokenizer has one mode
        out = {
            "max_new_tokens": mnt,
            "temperature": num("temperature", 1.0),
            "top_p": num("top_p", 1.0),
            "top_k": integer("top_k", -1),
            "min_p": num("min_p", 0.0),
            "min_new_tokens": integer("min_new_tokens", 0),
            "stop": [x for x in stop if x],
            "stop_token_ids": stop_ids,
            "ignore_eos": flag("ignore_eos", False),
            "skip_special_tokens": flag("skip_special_tokens", True),
            "no_stop_trim": flag("no_stop_trim", False),
            "n": integer("n", 1),
            "sampling_seed": integer("sampling_seed", None),
            "frequency_penalty": num("frequency_penalty", 0.0),
            "presence_penalty": num("presence_penalty", 0.0),
            "repetition_penalty": num("repetition_penalty", 1.0),
            "stream_interval": integer("stream_interval", 1),
        }
        if out["max_new_tokens"] < 0:
            raise BadRequest(f"{fld('max_new_tokens')} must be ≥ 0")
        if prompt_len + out["max_new_tokens"] > ctx:
            raise BadRequest(f"Requested token count exceeds the model's maximum context length of {ctx} tokens: "
                             f"{prompt_len} input tokens + {out['max_new_tokens']} max_new_tokens.")
        if out["max_new_tokens"] > a.max_new_tokens_limit:
            raise BadRequest(f"{fld('max_new_tokens')}={out['max_new_tokens']} is over the server's limit of "
                             f"{a.max_new_tokens_limit} (--max-new-tokens-limit)")
        if out["temperature"] < 0:
            raise BadRequest(f"{fld('temperature')} must be ≥ 0")
        if not 0.0 < out["top_p"] <= 1.0:
            raise BadRequest(f"{fld('top_p')} must be in (0, 1]")
        if out["top_k"] == 0 or out["top_k"] < -1:
            raise BadRequest(f"{fld('top_k')} must be -1 (disabled) or ≥ 1")
        out["top_k"] = min(out["top_k"], V)  # ≥ the vocabulary = no top-k (and fits the int64 row state)
        if not 0.0 <= out["min_p"] <= 1.0:
            raise BadRequest(f"{fld('min_p')} must be in [0, 1]")
        if not 1 <= out["n"] <= a.max_n:
            raise BadRequest(f"{fld('n')}={out['n']}: must be in [1, {a.max_n}] (the server's limit of samples "
                             f"per request, --max-n)")
        if not 0 <= out["min_new_tokens"] <= max(out["max_new_tokens"], 0):
            raise BadRequest(f"{fld('min_new_tokens')} must be in [0, {fld('max_new_tokens')}]")
        for k in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= out[k] <= 2.0:
                raise BadRequest(f"{fld(k)} must be in [-2, 2]")
        if not 0.0 < out["repetition_penalty"] <= 2.0:
            raise BadRequest(f"{fld('repetition_penalty')} must be in (0, 2]")
        if out["stream_interval"] < 1:
            raise BadRequest(f"{fld('stream_interval')} must be ≥ 1")
        return out

    def make_jobs(self, prompts: list[list[int]], params: list[dict], rids_per_prompt: list[str],
                  top_logprobs_num: int = 0) -> list[Job]:
        """One Job per sample (n per prompt); rids `rid` or `rid_j` for n>1 (SGLang's naming). Raises
        BadRequest on a duplicate rid (in flight or within the request) or a request over the limits,
        TooManyQueued while the queue budget is spent. The jobs' tokens are reserved in the budget:
        the caller must `release(jobs)` when the request ends."""
        a = self.args
        samples = sum(sp["n"] for sp in params)
        if samples > a.max_n:
            raise BadRequest(f"the request asks for {samples} samples (n × prompts); the server's limit is "
                             f"{a.max_n} per request (--max-n)")
        cost = sum((len(p) + sp["max_new_tokens"]) * sp["n"] for p, sp in zip(prompts, params))
        if cost > a.max_queued_tokens:
            raise BadRequest(f"the request needs {cost} tokens (prompt + max_new_tokens per sample), more than "
                             f"the server holds for all requests together (--max-queued-tokens {a.max_queued_tokens})")
        if self.queued_tokens + cost > a.max_queued_tokens:
            raise TooManyQueued(f"server busy: {self.queued_tokens} tokens already queued, this request needs "
                                f"{cost} more, the limit is {a.max_queued_tokens} (--max-queued-tokens); retry later")
        jobs: list[Job] = []
        for pi, (prompt, sp, prid) in enumerate(zip(prompts, params, rids_per_prompt)):
            eos = set() if sp["ignore_eos"] else set(self.runner.eos_token_ids)
            stop = tuple(sorted(set(sp["stop_token_ids"]) | eos))
            for j in range(sp["n"]):
                # n samples must draw different streams: a seeded request derives one seed per sample
                seed = derive_seed(sp["sampling_seed"], j) if sp["sampling_seed"] is not None \
                    else self.rng.getrandbits(63)
                seq = Seq(rid=prid if sp["n"] == 1 else f"{prid}_{j}", prompt_ids=list(prompt),
                          max_new_tokens=sp["max_new_tokens"], temperature=sp["temperature"], top_p=sp["top_p"],
                          top_k=sp["top_k"], min_p=sp["min_p"], min_new_tokens=sp["min_new_tokens"],
                          stop_ids=stop, seed=seed, frequency_penalty=sp["frequency_penalty"],
                          presence_penalty=sp["presence_penalty"], repetition_penalty=sp["repetition_penalty"],
                          top_logprobs_num=top_logprobs_num, stop_strs=tuple(sp["stop"]))
                jobs.append(Job(seq=seq, sp=sp, prompt_index=pi, index=len(jobs),
                                cost=len(prompt) + sp["max_new_tokens"]))
        rids = [j.seq.rid for j in jobs]
        seen: set[str] = set()
        for r in rids:
            if r in seen or self.scheduler.has_rid(r):
                raise BadRequest(f"Duplicate request ID: {r}")
            seen.add(r)
        self.queued_tokens += cost
        return jobs

    def release(self, jobs: list[Job]) -> None:
        """Give back the queue budget `make_jobs` reserved for `jobs` (the request ended)."""
        self.queued_tokens -= sum(j.cost for j in jobs)

    def _opt(self, body: dict[str, Any], key: str, kind: type, default: Any) -> Any:
        v = body.get(key)
        if v is None:
            return default
        if (kind is bool and not isinstance(v, bool)) or (kind is int and type(v) is not int):
            what = "true or false" if kind is bool else "an integer"
            raise BadRequest(f"'{key}' must be {what}, got {_short(v)} (per-prompt lists are not supported)"
                             if isinstance(v, list) else f"'{key}' must be {what}, got {_short(v)}")
        return v

    async def _parse_generate(self, body: dict[str, Any]) -> tuple[list[Job], bool, GenOpts, list[list[int]]]:
        self.check_fields(body, GENERATE_FIELDS, GENERATE_NOOP, GENERATE_META, "/generate")
        opts = GenOpts(return_logprob=self._opt(body, "return_logprob", bool, False),
                       logprob_start_len=self._opt(body, "logprob_start_len", int, -1),
                       top_logprobs_num=self._opt(body, "top_logprobs_num", int, 0),
                       text_in_logprobs=self._opt(body, "return_text_in_logprobs", bool, False),
                       stream=self._opt(body, "stream", bool, False))
        if opts.top_logprobs_num < 0:
            raise BadRequest("top_logprobs_num must be ≥ 0")
        opts.top_logprobs_num = min(opts.top_logprobs_num, self.runner.vocab_size)
        if not opts.return_logprob:
            opts.top_logprobs_num = 0
        rid = body.get("rid")
        if not (rid is None or isinstance(rid, str) or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))):
            raise BadRequest("'rid' must be a string or a list of strings")
        sps = body.get("sampling_params")
        prompts, batch = await self._prompts(body)
        sps = sps if isinstance(sps, list) else [sps] * len(prompts)
        if len(sps) != len(prompts):
            raise BadRequest("'sampling_params' list must match the number of prompts")
        params = [self._sampling(sp, len(p)) for sp, p in zip(sps, prompts)]
        if isinstance(rid, list):
            if len(rid) != len(prompts):
                raise BadRequest("'rid' list must match the number of prompts")
            rids_per_prompt = list(rid)
        elif rid is None:
            rids_per_prompt = [uuid.uuid4().hex for _ in prompts]
        else:
            rids_per_prompt = [rid] if not batch else [f"{rid}_{i}" for i in range(len(prompts))]
        lora_names = self._lora_names(body.get("lora_path"), len(prompts))
        jobs = self.make_jobs(prompts, params, rids_per_prompt, opts.top_logprobs_num)
        for j in jobs:
            j.seq.lora_name = lora_names[j.prompt_index]
        return jobs, batch or len(jobs) > 1, opts, prompts

    # ---------------------------------------------------------------- LoRA of requests
    def _lora_names(self, lp: Any, n_prompts: int) -> list[str | None]:
        """`lora_path` of /generate: null, an adapter name, or a list of names (one, or one per prompt)."""
        if lp is None:
            return [None] * n_prompts
        names = lp if isinstance(lp, list) else [lp]
        if not names or not all(x is None or isinstance(x, str) for x in names) or len(names) not in (1, n_prompts):
            raise BadRequest(f"'lora_path' must be a loaded adapter's name, a list of one name (or one per prompt) or "
                             f"null, got {_short(lp)}")
        if self.loras is None and any(x is not None for x in names):
            raise BadRequest(f"LoRA adapter '{next(x for x in names if x is not None)}' was requested, but LoRA is "
                             "not enabled. Please launch the server with --enable-lora flag and preload adapters "
                             "using --lora-paths or /load_lora_adapter endpoint.")
        return names * n_prompts if len(names) == 1 else list(names)

    @staticmethod
    def _lora_unknown(name: str) -> str:
        return f"Got LoRA adapter that has never been loaded: {name}"

    def _lora_acquire(self, seq: Seq) -> bool:
        """Resolve `seq.lora_name` to the adapter slot it names now (holding that slot until the request
        ends); False when no adapter has that name."""
        slot = self.loras.acquire(seq.lora_name)
        if slot is None:
            return False
        self._lora_drop(seq)
        seq.lora = slot
        return True

    def _lora_drop(self, seq: Seq) -> None:
        """Let go of `seq`'s adapter slot; a slot no name points to and no request holds is freed (on the
        engine thread, once no running row uses it)."""
        slot, seq.lora = seq.lora, None
        if slot is None or self.loras is None:
            return
        self.loras.release(slot)
        self._lora_free_if_dead(slot)

    def _lora_free_if_dead(self, slot: str | None) -> None:
        if slot is not None and self.loras.dead(slot):
            fut = asyncio.ensure_future(self.scheduler.run_on_engine(self.runner.free_lora, slot))
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _lora_resolve(self, jobs: list[Job]) -> None:
        """At submission: each job's adapter name → its slot. While paused the names are resolved when
        generation continues (`_lora_resolve_held`): a request held by a pause runs on the adapter the
        name points to after it. An unknown name is a 400 (nothing submitted)."""
        if self.loras is None or self.scheduler.paused:
            return
        for j in jobs:
            if j.seq.lora_name is not None and not self._lora_acquire(j.seq):
                name = j.seq.lora_name
                self._lora_release(jobs)
                raise BadRequest(self._lora_unknown(name))

    def _lora_release(self, jobs: list[Job]) -> None:
        if self.loras is not None:
            for j in jobs:
                self._lora_drop(j.seq)

    def _lora_resolve_held(self) -> None:
        """/continue_generation: the requests the pause held resolve their adapter names now (the
        adapters may have been replaced meanwhile); an unknown name fails that request with a 400."""
        if self.loras is None:
            return
        for req in list(self.scheduler.held):
            seq = req.seq
            if seq.lora_name is None or req.done:
                continue
            if not self._lora_acquire(seq):
                self._lora_drop(seq)
                self.scheduler._finish(req, {"type": "abort", "message": self._lora_unknown(seq.lora_name),
                                             "status_code": 400, "err_type": "BadRequest"})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        jobs, as_list, opts, prompts = await self._parse_generate(body)
        try:  # a client that disconnects cancels this handler: its requests abort (submit_request)
            self._lora_resolve(jobs)
            if opts.return_logprob and opts.logprob_start_len >= 0:
                for pi, prompt in enumerate(prompts):
                    slot = next((j.seq.lora for j in jobs if j.prompt_index == pi), None)
                    opts.input_logprobs[pi] = await self.input_logprobs(prompt, opts.logprob_start_len,
                                                                        opts.top_logprobs_num, opts.text_in_logprobs,
                                                                        slot)
            t0 = time.perf_counter()
            if opts.stream:
                return await self._stream_generate(request, jobs, as_list, opts, t0)
            reqs = await asyncio.gather(*(self.run_request(self.scheduler.new_request(j.seq)) for j in jobs))
            for r in reqs:  # an adapter name unknown once a pause ended
                fr = r.finish_reason or {}
                if fr.get("status_code") == 400 and fr.get("err_type") == "BadRequest":
                    raise BadRequest(fr.get("message", "bad request"))
            replies = [self._native_reply(j, r, opts, t0) for j, r in zip(jobs, reqs)]
            return web.json_response(replies if as_list else replies[0])
        finally:
            self.release(jobs)
            self._lora_release(jobs)

    async def _stream_generate(self, request: web.Request, jobs: list[Job], as_list: bool, opts: GenOpts,
                               t0: float) -> web.StreamResponse:
        """SSE: cumulative text/output_ids/logprobs per event, finish_reason null until the last one
        of each sample, `index` per sample when there are several, then `data: [DONE]`."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def emit(job: Job, req: Request, final: bool) -> None:
            obj = self._native_reply(job, req, opts, t0, final=final)
            if as_list:
                obj["index"] = job.index
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        try:
            async with contextlib.aclosing(self.stream_progress(jobs)) as progress:
                async for job, req, final in progress:
                    fr = req.finish_reason or {}
                    if final and fr.get("type") == "abort" and fr.get("status_code") not in (None, 200):
                        await resp.write(sse_error(fr.get("message", "engine error"), fr["status_code"]))
                        continue
                    await emit(job, req, final)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the client went away: stream_progress's cleanup aborted its requests
        except Exception as e:  # mid-stream error: an error event, then DONE
            log.exception("stream failed")
            await resp.write(sse_error(f"{type(e).__name__}: {e}", 500))
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def stream_progress(self, jobs: list[Job]):
        """Run `jobs`, yielding (job, request, final) whenever a sample has `stream_interval` new
        tokens and once when it finished. Aborts what is still running if the consumer stops."""
        ev = asyncio.Event()
        reqs = [self.scheduler.new_request(j.seq, ev) for j in jobs]
        tasks = [asyncio.ensure_future(self.run_request(r)) for r in reqs]
        sent = [0] * len(jobs)
        finished = [False] * len(jobs)
        try:
            while not all(finished):
                await ev.wait()
                ev.clear()
                for i, (job, req) in enumerate(zip(jobs, reqs)):
                    if finished[i]:
                        continue
                    n = len(job.seq.output_ids)
                    if req.done:
                        finished[i] = True
                        yield job, req, True
                    elif n - sent[i] >= job.sp["stream_interval"]:
                        sent[i] = n
                        yield job, req, False
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()  # submit_request aborts the request on cancellation
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run_request(self, req: Request) -> Request:
        seq = req.seq
        if seq.lora_name is not None and seq.lora is None and self.loras is not None and not self.scheduler.paused:
            # parsed while paused, submitted after the pause ended: resolve the name now
            if not self._lora_acquire(seq):
                req.finish_reason = {"type": "abort", "message": self._lora_unknown(seq.lora_name),
                                     "status_code": 400, "err_type": "BadRequest"}
                req.weight_version = self.scheduler.weight_version
                req.done = True
                if req.progress is not None:
                    req.progress.set()
                return req
        if seq.max_new_tokens == 0:  # nothing to generate: answer without touching the engine
            req.finish_reason = {"type": "length", "length": 0}
            req.weight_version = self.scheduler.weight_version
            req.done = True
            if req.progress is not None:
                req.progress.set()
            return req
        return await self.scheduler.submit_request(req)

    async def _run_one(self, seq: Seq) -> Request:
        return await self.run_request(self.scheduler.new_request(seq))

    def _native_reply(self, job: Job, req: Request, opts: GenOpts, t0: float, final: bool = True) -> dict[str, Any]:
        seq = job.seq
        out_ids = list(seq.output_ids)
        fr = req.finish_reason if final else None
        meta: dict[str, Any] = {
            "id": seq.rid,
            "finish_reason": fr,
            "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": len(out_ids),
            "cached_tokens": seq.cached_tokens,
            "weight_version": req.weight_version if final else self.scheduler.weight_version,
            "e2e_latency": time.perf_counter() - t0,
        }
        if opts.return_logprob:
            n = len(out_ids)
            meta["output_token_logprobs"] = [[lp, tid, self._tok_text(tid) if opts.text_in_logprobs else None]
                                             for lp, tid in zip(seq.output_logprobs[:n], out_ids)]
            if opts.top_logprobs_num:
                meta["output_top_logprobs"] = [self._top_list(v, i, opts.text_in_logprobs)
                                               for v, i in seq.output_top[:n]]
            if job.prompt_index in opts.input_logprobs:
                lps, tops = opts.input_logprobs[job.prompt_index]
                meta["input_token_logprobs"] = lps
                if opts.top_logprobs_num:
                    meta["input_top_logprobs"] = tops
        return {"text": self.output_text(seq, job.sp, fr), "output_ids": out_ids, "meta_info": meta}

    def output_text(self, seq: Seq, sp: dict[str, Any], finish_reason: dict[str, Any] | None) -> str:
        """Detokenized output; a matched stop (token or string) is trimmed unless no_stop_trim."""
        ids = seq.output_ids
        skip = sp["skip_special_tokens"]
        matched = finish_reason.get("matched") if finish_reason and finish_reason.get("type") == "stop" else None
        if matched is None or sp["no_stop_trim"]:
            return self.tokenizer.decode(ids, skip_special_tokens=skip)
        if isinstance(matched, int):
            return self.tokenizer.decode(ids[:-1] if ids and ids[-1] == matched else ids, skip_special_tokens=skip)
        text = self.tokenizer.decode(ids, skip_special_tokens=skip)
        # the match ends inside the last token's text (earlier steps found none), so search from there
        last = self.tokenizer.decode(ids[-1:], skip_special_tokens=skip)
        cut = text.find(matched, max(0, len(text) - len(last) - len(matched) + 1))
        return text[:cut] if cut >= 0 else text[:text.rfind(matched)] if matched in text else text

    def _text_stop(self, seq: Seq) -> str | None:
        """Scheduler hook: the stop string the output now contains, decoding only the tail."""
        longest = max(len(s) for s in seq.stop_strs)
        tail = self.tokenizer.decode(seq.output_ids[-(longest + 4):], skip_special_tokens=True)
        for s in seq.stop_strs:
            if s in tail:
                return s
        return None

    def _tok_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def _top_list(self, vals: list[float], ids: list[int], with_text: bool) -> list[list]:
        return [[v, i, self._tok_text(i) if with_text else None] for v, i in zip(vals, ids)]

    async def input_logprobs(self, prompt: list[int], start: int, top_n: int, with_text: bool,
                             lora: str | None = None):
        """(input_token_logprobs, input_top_logprobs) from `start`: the first prompt token has none."""
        lps, tops = await self.scheduler.run_on_engine(self._prompt_logprobs, prompt, top_n, lora)
        token = [[lp, tid, self._tok_text(tid) if with_text else None] for lp, tid in zip(lps, prompt)][start:]
        top = [None if t is None else self._top_list(t[0], t[1], with_text) for t in tops][start:]
        return token, top

    @torch.inference_mode()
    def _prompt_logprobs(self, prompt: list[int], top_n: int = 0, lora: str | None = None):
        """Prompt-token logprobs (NOT temperature-scaled); the first token has none."""
        ids = torch.tensor([prompt], dtype=torch.long, device=self.runner.device)
        with self.runner.adapters([lora]):
            logits = self.runner.model(input_ids=ids).logits
        lp = token_logprobs_from_logits(logits[:, :-1], ids[:, 1:], 1.0)[0].tolist()
        tops: list = [None]
        if top_n:
            v, i = torch.log_softmax(logits[0, :-1].float(), dim=-1).topk(top_n, dim=-1)
            tops += list(zip(v.tolist(), i.tolist()))
        else:
            tops += [None] * (len(prompt) - 1)
        return [None] + lp, tops

    # ---------------------------------------------------------------- status
    async def health(self, request: web.Request) -> web.Response:
        """200 once the engine shows progress: the check's own token (it goes to the front of the
        queue), or any engine step completing meanwhile (SGLang's rule: a full batch is alive)."""
        if self.scheduler.paused:  # deliberately paused for a weight update: alive, not generating
            return web.Response(text="paused")
        eos = self.runner.eos_token_ids[0] if self.runner.eos_token_ids else 0
        seq = Seq(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", prompt_ids=[eos], max_new_tokens=1, seed=0)
        req = self.scheduler.new_request(seq)
        gen = asyncio.ensure_future(self.scheduler.submit_request(req, front=True))
        step = asyncio.ensure_future(self.scheduler.next_step())
        try:
            done, _ = await asyncio.wait({gen, step}, timeout=self.args.health_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (gen, step):
                t.cancel()  # an unfinished check request is aborted (submit_request)
            await asyncio.gather(gen, step, return_exceptions=True)
        if not done:
            return error(f"health check: no engine progress within {self.args.health_timeout_s}s", 503)
        fr = req.finish_reason or {}
        if step not in done and fr.get("status_code") not in (None, 200):  # the engine failed the step
            return error(f"health check: {fr.get('message')}", 503)
        return web.Response(text="")

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.runner.config
        return web.json_response({
            "model_path": self.runner.model_path, "tokenizer_path": self.args.model_path, "is_generation": True,
            "weight_version": self.scheduler.weight_version, "preferred_sampling_params": None,
            "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None),
            "vocab_size": self.runner.vocab_size, "eos_token_ids": list(self.runner.eos_token_ids)})

    async def server_info(self, request: web.Request) -> web.Response:
        info = {k: v for k, v in vars(self.args).items() if k not in ("api_key", "admin_api_key")}
        info.update({
            "version": areal_like.__version__, "engine": "areal_like-embedded", "tp_size": 1, "dp_size": 1,
            "context_length": self.args.max_context_len,
            "max_total_num_tokens": self.args.max_context_len * self.args.max_batch_size,
            "max_running_requests": self.args.max_batch_size, "weight_version": self.scheduler.weight_version,
            "paused": self.scheduler.paused, "uptime_s": time.time() - self.started,
            # /release_memory_occupation's state (co-located mode)
            "memory_released": sorted(self.released), "weights_undefined": self.weights_undefined,
            "weights_bytes": self.runner.weights_nbytes, "kv_cache_bytes": self.runner.kv.nbytes,
            "lora_paths": self.loras.loaded() if self.loras is not None else {},
            "loaded_lora_adapters": self.loras.loaded() if self.loras is not None else {},
            "internal_states": [{"max_running_requests_seen": self.scheduler.max_running_seen,
                                 **self.scheduler.loads()}]})
        return web.json_response(info)

    async def loads(self, request: web.Request) -> web.Response:
        loads = self.scheduler.loads()
        return web.json_response({"timestamp": time.time(), **loads, "paused": self.scheduler.paused,
                                  "max_running_requests_seen": self.scheduler.max_running_seen,
                                  "loads": [{"dp_rank": 0, **loads}]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---------------------------------------------------------------- control
    async def pause(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        mode = body.get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"unknown pause mode {mode!r}: use abort, retract or in_place")
        await self.scheduler.pause(mode)
        return web.json_response({"success": True, "message": f"paused ({mode})"})

    async def continue_(self, request: web.Request) -> web.Response:
        blocked = self._memory_blocker()
        if blocked:
            raise BadRequest(f"cannot continue generation: {blocked}")
        self._lora_resolve_held()
        self.scheduler.resume()
        return web.json_response({"success": True, "message": "continued"})

    def _memory_blocker(self, *, for_update: bool = False) -> str:
        """Why generation (or, `for_update`, a weight update) cannot run now; '' when it can."""
        if "weights" in self.released:
            return ("the weights' memory is released: POST /resume_memory_occupation "
                    '{"tags": ["weights"]} first')
        if for_update:
            return ""
        if self.released:
            return f"memory is released ({', '.join(sorted(self.released))}): POST /resume_memory_occupation first"
        if self.weights_undefined:
            return ("the weights were released and resumed without content: update them first "
                    "(/update_weights_from_disk, or /update_weights_from_distributed or "
                    "/update_weights_from_tensor ending with a bucket that sets weight_version)")
        return ""

    def _update_refused(self, **reply) -> web.Response | None:
        """A weight update while the weights' memory is released: SGLang's `success: false` reply (with
        the route's other reply fields, `reply`); None when the update may run."""
        blocked = self._memory_blocker(for_update=True)
        if not blocked:
            return None
        return web.json_response({"success": False, "message": f"cannot update weights: {blocked}", **reply})

    def _memory_tags(self, body: dict) -> set[str]:
        from areal_like.weights.control import MEMORY_TAGS

        tags = body.get("tags")
        if tags is None or tags == []:
            return set(MEMORY_TAGS)
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise BadRequest("'tags' must be a list of strings or null")
        unknown = sorted(set(tags) - set(MEMORY_TAGS))
        if unknown:
            raise BadRequest(f"unknown memory tag(s) {unknown}: use {list(MEMORY_TAGS)} (or null for all)")
        return set(tags)

    async def release_memory(self, request: web.Request) -> web.Response:
        """SGLang's /release_memory_occupation (co-located mode): free the KV cache and/or the weights.
        Stricter than SGLang, which asserts an idle server: this one must be paused (/pause_generation),
        so no request can start on freed memory."""
        tags = self._memory_tags(await self._json(request))
        if not self.scheduler.paused:
            raise BadRequest("release_memory_occupation needs a paused server: POST /pause_generation first")
        async with self.update_lock:
            try:
                freed = await self.scheduler.run_on_engine(self.runner.release_memory, tags)
            except RuntimeError as e:
                raise BadRequest(str(e))
            self.released |= tags
        log.info("released %s (%s)", sorted(tags), ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in freed.items()))
        return web.json_response({"success": True, "message": f"released {sorted(tags)}", "freed_bytes": freed})

    async def resume_memory(self, request: web.Request) -> web.Response:
        """SGLang's /resume_memory_occupation: allocate what was released. Weights come back without
        content: a weight update must land before /continue_generation is accepted."""
        tags = self._memory_tags(await self._json(request))
        async with self.update_lock:
            got = await self.scheduler.run_on_engine(self.runner.resume_memory, tags & self.released)
            if "weights" in tags & self.released:
                self.weights_undefined = True
            self.released -= tags
        return web.json_response({"success": True, "message": f"resumed {sorted(tags)}", "allocated_bytes": got})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        rid, abort_all = str(body.get("rid") or ""), bool(body.get("abort_all", False))
        if not rid and not abort_all:
            raise BadRequest("give 'rid' or 'abort_all': true")
        n = self.scheduler.abort(rid, abort_all=abort_all)
        return web.json_response({"success": True, "message": f"aborted {n} request(s)", "num_aborted": n})

    async def flush_cache(self, request: web.Request) -> web.Response:
        # SGLang's rule: refused while requests run or wait in the scheduler; requests held by a pause
        # wait in SGLang's tokenizer, so they do not count (the pusher flushes while paused).
        if self.scheduler.running or self.scheduler.waiting:
            return error("Cache not flushed: there are running or waiting requests. Pause first.", 400)
        # No prefix cache to drop: the batch cache lives only as long as its rows.
        return web.json_response({"success": True, "message": "Cache flushed."})

    async def begin_end(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": ""})

    # ---------------------------------------------------------------- weights
    async def weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's `/get_weights_by_name`: the first `truncate_size` rows of one parameter as nested
        lists of floats (exact for every served dtype), read on the engine thread (never half-loaded).
        Admin-only here: weights are the learner's product."""
        b = await self._json(request)
        name, k = b.get("name"), b.get("truncate_size", 100)
        if not isinstance(name, str) or not isinstance(k, int) or k < 1:
            raise BadRequest("get_weights_by_name needs {\"name\": str, \"truncate_size\": int ≥ 1}")
        own = self.runner.named_weights()
        if name not in own:
            raise BadRequest(f"no parameter {name!r}: see the model's state_dict names")

        def read():
            return own[name].detach()[:k].to("cpu", torch.float32).tolist()
        return web.json_response(await self.scheduler.run_on_engine(read))

    async def init_group(self, request: web.Request) -> web.Response:
        b = await self._json(request)
        try:
            kw = dict(master_address=str(b["master_address"]), master_port=int(b["master_port"]),
                      rank_offset=int(b["rank_offset"]), world_size=int(b["world_size"]),
                      group_name=str(b.get("group_name") or "weight_update_group"),
                      backend=str(b.get("backend") or ("nccl" if self.runner.device.type == "cuda" else "gloo")),
                      timeout_s=float(b.get("timeout_s") or self.args.weight_sync_timeout_s))
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"bad init_weights_update_group body: {e!r}")
        try:
            # Blocks until every rank joined: on a thread, so the server keeps serving meanwhile.
            await asyncio.to_thread(self._init_group_on_thread, kw)
        except Exception as e:
            log.error("init_weights_update_group failed: %s", e)
            return web.json_response({"success": False, "message": str(e)})
        return web.json_response({"success": True, "message": f"joined group {kw['group_name']!r} as rank "
                                                              f"{kw['rank_offset']} of {kw['world_size']}"})

    def _init_group_on_thread(self, kw: dict) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)  # NCCL binds the thread's current device
        self.receiver.init_group(**kw)

    async def update_distributed(self, request: web.Request) -> web.Response:
        b = await self._json(request)
        try:
            names, dtypes, shapes = list(b["names"]), list(b["dtypes"]), [list(s) for s in b["shapes"]]
        except (KeyError, TypeError) as e:
            raise BadRequest(f"bad update_weights_from_distributed body: {e!r}")
        group_name = str(b.get("group_name") or "weight_update_group")
        refused = self._update_refused()
        if refused is not None:
            return refused
        loads = self._group_loads.setdefault(group_name, [])
        async with self.update_lock:  # receives in arrival order: the broadcasts' order
            if b.get("abort_all_requests"):
                self.scheduler.abort(abort_all=True, message="aborted for weight update")
            t0 = time.perf_counter()
            k = self._group_received.get(group_name, 0)
            if len(loads) >= RECV_SLOTS:  # the load that last read buffer k % RECV_SLOTS must be done
                await asyncio.wait([loads[-RECV_SLOTS]])
            try:
                named = await self._receive(group_name, names, dtypes, shapes, b.get("load_format"), k % RECV_SLOTS)
            except Exception as e:
                log.error("update_weights_from_distributed failed: %s", e)
                return web.json_response({"success": False, "message": str(e)})
            self._group_received[group_name] = k + 1
            t_recv = time.perf_counter()
            # Loads run on the engine thread (FIFO): between two decode steps, all or nothing per bucket.
            load = asyncio.ensure_future(self.scheduler.run_on_engine(self.runner.load_weights, named))
            loads.append(load)
        # Outside the lock: the next bucket is received while this one loads.
        try:
            await load
        except Exception as e:
            log.error("update_weights_from_distributed failed: %s", e)
            return web.json_response({"success": False, "message": str(e)})
        t_load = time.perf_counter()
        if b.get("weight_version") is not None:
            # The last bucket of an update: every bucket of it must have landed before the version moves
            # (the executor is FIFO, so they have finished; one that failed fails the update).
            done = self._end_group_update(group_name)
            failed = [f.exception() for f in done if f.exception() is not None]
            if failed:
                return web.json_response({"success": False, "message": (
                    f"an earlier bucket of this update failed to load, the version stays "
                    f"{self.scheduler.weight_version}: {failed[0]}")})
            self._set_version(str(b["weight_version"]))
            self.weights_undefined = False  # a whole update landed
        metrics.WEIGHT_LOAD_SECONDS.observe(time.perf_counter() - t0)
        refused = self._flush_refused(b)
        if refused is not None:
            return refused
        # recv_s/load_s: beyond SGLang's reply, where this server's time went (the receive includes the
        # wait for the trainer's broadcast to start; the load, the wait for earlier buckets' loads)
        return web.json_response({"success": True, "message": f"updated {len(names)} tensors",
                                  "recv_s": t_recv - t0, "load_s": t_load - t_recv})

    async def _receive(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                       load_format: str | None, slot: int) -> dict[str, torch.Tensor]:
        """One bucket from the weight group (on a thread): per-tensor broadcasts, or one flattened bucket
        received into the group's buffer `slot` (the tensors are views of it)."""
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)
        return await asyncio.to_thread(self.receiver.receive, group_name=group_name, names=names, dtypes=dtypes,
                                       shapes=shapes, load_format=load_format, slot=slot)

    def _flush_refused(self, body: dict) -> web.Response | None:
        """After a weight update's load: SGLang's rule — `flush_cache` (default true) flushes, and a flush
        refused because requests still run or wait fails the update. No prefix cache here, but the same
        answer. (Requests held by the pause are not running: SGLang's tokenizer holds those too.)"""
        if body.get("flush_cache", True) and (self.scheduler.running or self.scheduler.waiting):
            return web.json_response({"success": False, "message": (
                "Weights were updated, but the cache was not flushed because requests are still running "
                "or queued. Retract or finish them, then call /flush_cache.")})
        return None

    def _end_group_update(self, group_name: str) -> list[asyncio.Future]:
        """Forget the update in flight on `group_name`; its load futures (all done once the last one is)."""
        self._group_received.pop(group_name, None)
        return self._group_loads.pop(group_name, [])

    async def destroy_group(self, request: web.Request) -> web.Response:
        b = await self._json(request)
        name = str(b.get("group_name") or "weight_update_group")
        async with self.update_lock:
            loads = self._end_group_update(name)
            if loads:  # its receive buffers go with the group: no load may still read them
                await asyncio.wait(loads)
            try:
                await asyncio.to_thread(self.receiver.destroy, name)
            except Exception as e:
                return web.json_response({"success": False, "message": str(e)})
        return web.json_response({"success": True, "message": f"destroyed group {name!r}"})

    async def update_disk(self, request: web.Request) -> web.Response:
        b = await self._json(request)
        path = b.get("model_path")
        if not path:
            raise BadRequest("'model_path' is required")
        if b.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format {b['load_format']!r} is not supported: use null (safetensors)")
        refused = self._update_refused(num_paused_requests=0)
        if refused is not None:
            return refused
        async with self.update_lock:
            if b.get("abort_all_requests"):
                self.scheduler.abort(abort_all=True, message="aborted for weight update")
            t0 = time.perf_counter()
            try:
                await self.scheduler.run_on_engine(self.runner.load_weights_from_disk, str(path))
            except Exception as e:  # the runner validated before copying / restored: old weights still serve
                log.error("update_weights_from_disk(%s) failed, old weights kept: %s", path, e)
                return web.json_response({"success": False, "message": f"Failed to load {path}: {e}. "
                                          f"Rolled back to the previous weights.", "num_paused_requests": 0})
            if b.get("weight_version") is not None:
                self._set_version(str(b["weight_version"]))
            self.weights_undefined = False  # every tensor of a checkpoint loaded
            metrics.WEIGHT_LOAD_SECONDS.observe(time.perf_counter() - t0)
        return web.json_response({"success": True, "message": f"loaded {path}", "num_paused_requests": 0})

    async def update_tensor(self, request: web.Request) -> web.Response:
        """SGLang's /update_weights_from_tensor, for a co-located learner on this host: the tensors are in
        a shared-memory segment the learner filled (`load_format` "areal_like_shm", weights/shm.py),
        copied from there into the parameters on the engine thread (all or nothing per bucket). SGLang's
        own payload — a pickle of CUDA-IPC handles — is refused: nothing received over HTTP is unpickled.
        The bucket that sets `weight_version` ends the update (weights defined again after a release)."""
        b = await self._json(request)
        fmt = b.get("load_format")
        if fmt != SHM_LOAD_FORMAT:
            raise BadRequest(f"load_format {fmt!r} is not supported here: this server loads tensors from shared "
                             f"memory only (load_format {SHM_LOAD_FORMAT!r}, see areal_like/weights/shm.py); "
                             "SGLang's pickled CUDA-IPC payload is not unpickled")
        try:
            named = self.shm.read(b.get("serialized_named_tensors"))
        except (ValueError, OSError) as e:
            raise BadRequest(f"bad update_weights_from_tensor body: {e}")
        refused = self._update_refused()
        if refused is not None:
            return refused
        async with self.update_lock:
            if b.get("abort_all_requests"):
                self.scheduler.abort(abort_all=True, message="aborted for weight update")
            t0 = time.perf_counter()
            try:
                await self.scheduler.run_on_engine(self.runner.load_weights, dict(named))
            except Exception as e:  # names, shapes, dtypes checked before any copy: the old weights serve
                log.error("update_weights_from_tensor failed: %s", e)
                return web.json_response({"success": False, "message": str(e)})
            if b.get("weight_version") is not None:
                self._set_version(str(b["weight_version"]))
                self.weights_undefined = False  # the update's last bucket landed
            metrics.WEIGHT_LOAD_SECONDS.observe(time.perf_counter() - t0)
        refused = self._flush_refused(b)
        if refused is not None:
            return refused
        return web.json_response({"success": True, "message": f"updated {len(named)} tensors",
                                  "load_s": time.perf_counter() - t0})


    # ---------------------------------------------------------------- LoRA adapters
    def _lora_reply(self, ok: bool, error_message: str | None = None) -> web.Response:
        """SGLang's LoRAUpdateOutput: 200 on success, 400 on failure."""
        return web.json_response({"success": ok, "error_message": error_message,
                                  "loaded_adapters": self.loras.loaded() if self.loras is not None else {}},
                                 status=200 if ok else 400)

    @staticmethod
    def _lora_name_of(b: dict) -> str:
        name = b.get("lora_name")
        if not isinstance(name, str) or not name:
            raise BadRequest("'lora_name' (a non-empty string) is required")
        return name

    async def load_lora(self, request: web.Request) -> web.Response:
        """SGLang's /load_lora_adapter {lora_name, lora_path, pinned, lora_id}: a peft adapter dir as a
        new adapter slot under `lora_name`. Refused (400, nothing changed): LoRA not enabled, the name
        loaded, --max-loaded-loras reached, a rank over --max-lora-rank, target modules outside
        --lora-target-modules, missing files, tensors that do not fit the model."""
        b = await self._json(request)
        if self.loras is None:
            return self._lora_reply(False, NOT_ENABLED)
        name = self._lora_name_of(b)
        path = b.get("lora_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("'lora_path' (the adapter directory) is required")
        if not isinstance(b.get("pinned", False), bool):
            raise BadRequest("'pinned' must be true or false")
        from areal_like.weights.adapter import read_adapter_config, read_adapter_tensors

        async with self.lora_lock:
            refused = self._lora_load_refused(name)
            if refused:
                return self._lora_reply(False, refused)
            try:
                cfg = await asyncio.to_thread(read_adapter_config, path, "lora_path")
                tensors = await asyncio.to_thread(read_adapter_tensors, path, "lora_path")
                slot = await self.scheduler.run_on_engine(self.runner.load_lora, cfg, tensors, name)
            except (OSError, ValueError, RuntimeError) as e:
                log.error("load_lora_adapter %s (%s) failed: %s", name, path, e)
                return self._lora_reply(False, f"Failed to load LoRA adapter {name} from {path}: {e}")
            self.loras.bind(name, slot, path)
        log.info("loaded LoRA adapter %s from %s (slot %s)", name, path, slot)
        return self._lora_reply(True)

    def _lora_load_refused(self, name: str, replacing: bool = False) -> str:
        if name in self.loras.names and not replacing:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        n = len(self.loras.names) + (0 if name in self.loras.names else 1)
        if n > self.args.max_loaded_loras:
            return (f"Failed to load LoRA adapter {name}: the maximum number of loaded LoRA adapters "
                    f"(--max-loaded-loras {self.args.max_loaded_loras}) is reached; unload one first")
        return ""

    async def unload_lora(self, request: web.Request) -> web.Response:
        """SGLang's /unload_lora_adapter {lora_name}: the name goes at once; its slot is freed once no
        request uses it."""
        b = await self._json(request)
        if self.loras is None:
            return self._lora_reply(False, NOT_ENABLED)
        name = self._lora_name_of(b)
        async with self.lora_lock:
            if name not in self.loras.names:
                return self._lora_reply(False, f"LoRA with name {name} does not exist")
            slot = self.loras.unbind(name)
            self._lora_free_if_dead(slot)
        log.info("unloaded LoRA adapter %s (slot %s)", name, slot)
        return self._lora_reply(True)

    async def load_lora_distributed(self, request: web.Request) -> web.Response:
        """Our extension: an adapter pushed over the weight group. The body is an
        /update_weights_from_distributed bucket (names: adapter tensor names without peft's prefix,
        `model.layers.0.self_attn.q_proj.lora_A.weight`) plus `lora_name` and `config_dict` (the
        adapter_config.json dict). Buckets are staged per lora_name; the one with a non-null
        `weight_version` is the last: the staged tensors become a new slot that `lora_name` names
        (replacing an adapter of that name; rows already on the old one finish on it) and the server's
        weight version moves to it. Failures: 400, nothing changed."""
        b = await self._json(request)
        if self.loras is None:
            return self._lora_reply(False, NOT_ENABLED)
        name = self._lora_name_of(b)
        try:
            names, dtypes, shapes = list(b["names"]), list(b["dtypes"]), [list(s) for s in b["shapes"]]
        except (KeyError, TypeError) as e:
            raise BadRequest(f"bad load_lora_adapter_from_distributed body: {e!r}")
        cfg = b.get("config_dict")
        if cfg is not None and not isinstance(cfg, dict):
            raise BadRequest("'config_dict' must be the adapter_config.json object")
        group_name = str(b.get("group_name") or "weight_update_group")
        refused = self._update_refused()
        if refused is not None:
            body = json.loads(refused.body)
            return self._lora_reply(False, body["message"])
        async with self.update_lock:  # receives in arrival order: the broadcasts' order
            loads = self._group_loads.get(group_name, [])
            if loads:  # a full update's load may still read the group's receive buffers
                await asyncio.wait(loads)
            try:
                named = await self._receive(group_name, names, dtypes, shapes, b.get("load_format"),
                                            self._group_received.get(group_name, 0) % RECV_SLOTS)
                named = {k: v.detach().to("cpu", copy=True) for k, v in named.items()}  # the buffer is reused
            except Exception as e:
                self._lora_staged.pop(name, None)
                self._lora_staged_cfg.pop(name, None)
                log.error("load_lora_adapter_from_distributed %s failed: %s", name, e)
                return self._lora_reply(False, f"Failed to receive LoRA adapter {name}: {e}")
            self._lora_staged.setdefault(name, {}).update(named)
            if cfg is not None:
                self._lora_staged_cfg[name] = cfg
            if b.get("weight_version") is None:
                return web.json_response({"success": True, "error_message": None,
                                          "loaded_adapters": self.loras.loaded(),
                                          "message": f"staged {len(names)} tensors of LoRA adapter {name}"})
            tensors = self._lora_staged.pop(name)
            cfg = self._lora_staged_cfg.pop(name, None)
            if cfg is None:
                return self._lora_reply(False, f"Failed to load LoRA adapter {name}: no config_dict was sent")
            if b.get("abort_all_requests"):
                self.scheduler.abort(abort_all=True, message="aborted for weight update")
            async with self.lora_lock:
                refused = self._lora_load_refused(name, replacing=True)
                if refused:
                    return self._lora_reply(False, refused)
                try:
                    slot = await self.scheduler.run_on_engine(self.runner.load_lora, cfg, tensors, name)
                except (ValueError, RuntimeError) as e:
                    log.error("load_lora_adapter_from_distributed %s failed: %s", name, e)
                    return self._lora_reply(False, f"Failed to load LoRA adapter {name}: {e}")
                old = self.loras.bind(name, slot, f"distributed:{group_name}@{b['weight_version']}")
                self._lora_free_if_dead(old)
                self._set_version(str(b["weight_version"]))
        log.info("loaded LoRA adapter %s from group %s (slot %s, weight_version %s)", name, group_name, slot,
                 b["weight_version"])
        return self._lora_reply(True)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """SGLang's /update_weight_version {new_version, abort_all_requests = true}."""
        b = await self._json(request)
        version = b.get("new_version")
        if not isinstance(version, str) or not version:
            raise BadRequest("'new_version' (a non-empty string) is required")
        abort = b.get("abort_all_requests", True)
        if not isinstance(abort, bool):
            raise BadRequest("'abort_all_requests' must be true or false")
        if abort:
            self.scheduler.abort(abort_all=True, message="aborted for weight version update")
        self._set_version(version)
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": version})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m areal_like.engine.server", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="HF model dir (safetensors + tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--enable-fp32-lm-head", action="store_true",
                   help="compute the LM head's logits in fp32 (SGLang's flag; model.fp32_lm_head)")
    p.add_argument("--max-batch-size", type=int, default=64, help="max running requests per decode step")
    p.add_argument("--max-context-len", type=int, default=512, help="prompt + generated tokens per request")
    p.add_argument("--max-prefill-tokens", type=int, default=4096,
                   help="padded tokens per prefill forward (admitted prompts are prefilled together)")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--random-seed", type=int, default=None, help="seeds requests without sampling_seed")
    p.add_argument("--served-model-name", default=None, help="model id on /v1/* (default: the model dir's name)")
    p.add_argument("--api-key", default=None, help="bearer key of /generate and /v1/* (default: $AREAL_LIKE_API_KEY)")
    p.add_argument("--admin-api-key", default=None,
                   help="bearer key of weight updates, pause/continue, flush (default: $AREAL_LIKE_ADMIN_API_KEY)")
    p.add_argument("--max-n", type=int, default=128, help="most samples (n × prompts) one request may ask for")
    p.add_argument("--max-new-tokens-limit", type=int, default=None,
                   help="most max_new_tokens one request may ask for (default: the context length)")
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help="most prompt tokens per request (default: --max-context-len − 1)")
    p.add_argument("--max-request-bytes", type=int, default=8 << 20, help="largest request body (413 above)")
    p.add_argument("--max-queued-tokens", type=int, default=None,
                   help="prompt + max_new_tokens of all admitted samples together (429 above; "
                        "default: 16 × --max-batch-size × --max-context-len)")
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    p.add_argument("--health-timeout-s", type=float, default=20.0)
    p.add_argument("--weight-sync-timeout-s", type=float, default=300.0, help="collective timeout of weight groups")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--disable-metrics", action="store_true", help="do not serve Prometheus /metrics")
    p.add_argument("--start-paused", action="store_true",
                   help="start as after /pause_generation: requests are held (/health answers 'paused') until "
                        "/continue_generation — a restarted server must not serve --model-path's weights to "
                        "rollouts before the learner pushed the current ones")
    # LoRA (SGLang's flag names)
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (/load_lora_adapter, lora_path)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank served (with --enable-lora)")
    p.add_argument("--lora-target-modules", nargs="*", default=None,
                   help="modules adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all")
    p.add_argument("--max-loras-per-batch", type=int, default=8, help="distinct adapters in one running batch")
    p.add_argument("--max-loaded-loras", type=int, default=None,
                   help="adapters loaded at a time (default: --max-loras-per-batch)")
    args = p.parse_args(argv)
    if args.enable_lora:
        from areal_like.engine.lora import resolve_targets

        if args.max_lora_rank is None:
            p.error("--max-lora-rank is required with --enable-lora (the largest adapter rank to serve)")
        if not args.lora_target_modules:
            p.error("--lora-target-modules is required with --enable-lora (e.g. q_proj v_proj, or all)")
        if args.max_lora_rank < 1:
            p.error("--max-lora-rank must be ≥ 1")
        try:
            args.lora_target_modules = resolve_targets(args.lora_target_modules, "--lora-target-modules")
        except ValueError as e:
            p.error(str(e))
    if args.max_loras_per_batch < 1:
        p.error("--max-loras-per-batch must be ≥ 1")
    if args.max_loaded_loras is None:
        args.max_loaded_loras = args.max_loras_per_batch
    elif args.max_loaded_loras < args.max_loras_per_batch:
        p.error("--max-loaded-loras must be ≥ --max-loras-per-batch")
    if args.max_batch_size < 1 or args.max_context_len < 2:
        p.error("--max-batch-size must be ≥ 1 and --max-context-len ≥ 2")
    # Keys from the environment keep them out of argv (which every local user can read in /proc).
    args.api_key = args.api_key or os.environ.get("AREAL_LIKE_API_KEY") or None
    args.admin_api_key = args.admin_api_key or os.environ.get("AREAL_LIKE_ADMIN_API_KEY") or None
    ctx = args.max_context_len
    args.max_prompt_len = ctx - 1 if args.max_prompt_len is None else min(args.max_prompt_len, ctx - 1)
    args.max_new_tokens_limit = ctx if args.max_new_tokens_limit is None else args.max_new_tokens_limit
    if args.max_queued_tokens is None:
        args.max_queued_tokens = 16 * args.max_batch_size * ctx
    for name in ("max_n", "max_new_tokens_limit", "max_prompt_len", "max_request_bytes", "max_queued_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be ≥ 1")
    return args


async def serve(args: argparse.Namespace) -> None:
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    server = GenerationServer(args)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its requests
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    log.info("serving %s on http://%s:%d (weight_version %s, dtype %s%s, context %d tokens)", args.model_path,
             args.host, args.port, server.scheduler.weight_version, args.dtype,
             ", LM head fp32" if args.enable_fp32_lm_head else "", args.max_context_len)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from areal_like.api.net import apply_gloo_interface

    apply_gloo_interface()  # its weight group's gloo side: the interface of this node's address (issue 40)
    import uvloop

    uvloop.run(serve(args))


if __name__ == "__main__":
    main()
