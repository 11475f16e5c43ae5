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
from typing import Any

import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import areal_like
from areal_like import metrics
from areal_like.engine.admin_routes import AdminRoutes
from areal_like.engine.errors import BadRequest, PayloadTooLarge, RequestError, TooManyQueued, error
from areal_like.engine.errors import short as _short
from areal_like.engine.jobs import GenOpts, Job
from areal_like.engine.lora import LoraRegistry, RequestLoras
from areal_like.engine.lora_routes import LoraRoutes
from areal_like.engine.openai_api import OPENAI_PATHS, OpenAIRoutes
from areal_like.engine.runner import ModelRunner, Seq
from areal_like.engine.sampling import derive_seed
from areal_like.engine.scheduler import Request, Scheduler
from areal_like.learner.logprobs import token_logprobs_from_logits

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
                   "top_logprobs_num", "return_text_in_logprobs", "stream", "lora_path",
                   "return_routed_experts", "routed_experts_start_len"}
GENERATE_NOOP = {"input_embeds": (None,), "image_data": (None, []), "video_data": (None, []),
                 "audio_data": (None, []), "modalities": (None, []), "session_params": (None,),
                 "lora_id": (None,), "custom_logit_processor": (None,),
                 "token_ids_logprob": (None,), "return_hidden_states": (None, False),
                 "return_entropy": (None, False),
                 "return_bytes": (None, False), "return_prompt_token_ids": (None, False),
                 "background": (None, False), "bootstrap_host": (None,), "bootstrap_port": (None,),
                 "bootstrap_room": (None,), "bootstrap_pair_key": (None,), "data_parallel_rank": (None, 0),
                 "routed_dp_rank": (None, 0)}
GENERATE_META = {"log_metrics", "no_logs", "custom_labels", "conversation_id", "session_id", "routing_key",
                 "extra_key", "priority"}
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 64, 1024, 1024
# SGLang's ADMIN_OPTIONAL level (sglang/srt/utils/auth.py): the admin key when one is set, else the api
# key, else open. /abort_request is on it in SGLang (≥ 0.5.2x), per-rid aborts included: a rid is no
# secret (rids are guessable and prefix-matched), so an api-key holder must not abort others' requests.
ADMIN_PATHS = {"/pause_generation", "/continue_generation", "/flush_cache", "/init_weights_update_group",
               "/release_memory_occupation", "/resume_memory_occupation",
               "/update_weights_from_distributed", "/destroy_weights_update_group", "/update_weights_from_disk",
               "/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update", "/get_weights_by_name", "/abort_request",
               "/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter_from_distributed",
               "/update_weight_version", "/weights_checker"}
OPEN_PATHS = {"/health", "/health_generate", "/metrics"}


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
        self.rng = random.Random(args.random_seed)
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
        # --enable-lora: lora_name → adapter slot
        self.loras = LoraRegistry() if args.enable_lora else None
        self.request_loras = RequestLoras(self.loras, self.scheduler, self.runner)  # which adapter each request runs
        # the admin surface apart (admin_routes.py, lora_routes.py): what changes the weights and memory
        self.admin = AdminRoutes(self)
        self.lora_routes = LoraRoutes(self, self.admin)

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
        self.admin.add_to(app)
        self.lora_routes.add_to(app)
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
        await asyncio.to_thread(self.admin.receiver.close)

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
        lsl = body.get("logprob_start_len")
        per_prompt_lsl = isinstance(lsl, list)  # SGLang's per-prompt form: one start per prompt of a batch
        if per_prompt_lsl and not all(type(v) is int for v in lsl):
            raise BadRequest(f"'logprob_start_len' must be an integer or a list of integers, got {_short(lsl)}")
        opts = GenOpts(return_logprob=self._opt(body, "return_logprob", bool, False),
                       logprob_start_len=list(lsl) if per_prompt_lsl else self._opt(body, "logprob_start_len", int, -1),
                       top_logprobs_num=self._opt(body, "top_logprobs_num", int, 0),
                       text_in_logprobs=self._opt(body, "return_text_in_logprobs", bool, False),
                       stream=self._opt(body, "stream", bool, False),
                       return_routed_experts=self._opt(body, "return_routed_experts", bool, False),
                       routed_experts_start_len=self._opt(body, "routed_experts_start_len", int, 0))
        if opts.return_routed_experts:
            if not self.args.enable_return_routed_experts:
                raise BadRequest("return_routed_experts needs a server started with --enable-return-routed-experts")
            if not self.runner.routers:
                raise BadRequest(f"return_routed_experts: {self.args.model_path} is not a mixture-of-experts model")
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
        if per_prompt_lsl and len(opts.logprob_start_len) != len(prompts):
            raise BadRequest(f"'logprob_start_len' list has {len(opts.logprob_start_len)} entries for {len(prompts)} prompts")
        params = [self._sampling(sp, len(p)) for sp, p in zip(sps, prompts)]
        if isinstance(rid, list):
            if len(rid) != len(prompts):
                raise BadRequest("'rid' list must match the number of prompts")
            rids_per_prompt = list(rid)
        elif rid is None:
            rids_per_prompt = [uuid.uuid4().hex for _ in prompts]
        else:
            rids_per_prompt = [rid] if not batch else [f"{rid}_{i}" for i in range(len(prompts))]
        lora_names = self.request_loras.names(body.get("lora_path"), len(prompts))
        if opts.return_routed_experts:
            for p in prompts:  # SGLang's rule: a start in [0, prompt tokens]
                if not 0 <= opts.routed_experts_start_len <= len(p):
                    raise BadRequest(f"routed_experts_start_len={opts.routed_experts_start_len} must be in [0, {len(p)}] "
                                     "(the prompt's tokens)")
        jobs = self.make_jobs(prompts, params, rids_per_prompt, opts.top_logprobs_num)
        for j in jobs:
            j.seq.lora_name = lora_names[j.prompt_index]
            j.seq.return_routes = opts.return_routed_experts
        return jobs, batch or len(jobs) > 1, opts, prompts

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        jobs, as_list, opts, prompts = await self._parse_generate(body)
        try:  # a client that disconnects cancels this handler: its requests abort (submit_request)
            self.request_loras.resolve(jobs)
            if opts.return_logprob:
                for pi, prompt in enumerate(prompts):
                    start = (opts.logprob_start_len[pi] if isinstance(opts.logprob_start_len, list)
                             else opts.logprob_start_len)
                    if start < 0:
                        continue
                    slot = next((j.seq.lora for j in jobs if j.prompt_index == pi), None)
                    opts.input_logprobs[pi] = await self.input_logprobs(prompt, start, opts.top_logprobs_num,
                                                                        opts.text_in_logprobs, slot)
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
            self.request_loras.release(jobs)

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
            if not self.request_loras.acquire(seq):
                req.finish_reason = {"type": "abort", "message": self.request_loras.unknown(seq.lora_name),
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
        if opts.return_routed_experts and final:
            meta["routed_experts"] = self._routes_b64(seq, opts.routed_experts_start_len)
        return {"text": self.output_text(seq, job.sp, fr), "output_ids": out_ids, "meta_info": meta}

    @staticmethod
    def _routes_b64(seq: Seq, start: int) -> str:
        """SGLang's `meta_info.routed_experts`: base64 of int32 (positions, layers, top-k) for positions
        [start, prompt + output − 1) — every position the engine ran (the last token is sampled, never fed)."""
        import base64

        import numpy as np

        end = len(seq.prompt_ids) + len(seq.output_ids) - 1
        rows = np.concatenate(seq.routes) if seq.routes else np.zeros((0, 0), np.int32)
        return base64.b64encode(np.ascontiguousarray(rows[start:max(end, start)], dtype=np.int32).tobytes()).decode()

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
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="MoE: answer return_routed_experts (each position's routed experts; SGLang's flag)")
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
    from areal_like.api.process import exit_now

    main()
    exit_now(0)  # the site is cleaned up: skip the interpreter's finalization (api/process.py)
