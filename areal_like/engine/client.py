"""Rollout-side generation client for SGLang servers and the embedded server alike.

One aiohttp session (one connection pool) for all servers. Routing: least in-flight requests, with
a sticky `key` so all samples of a group land on the same server (prefix-cache friendly, and one
server's weight version for the group when possible).

The interruptible loop — a weight-update pause aborts requests with their partial output:
```
 POST /generate(prompt + tokens so far, max_new_tokens - generated) ──► reply
    finish_reason abort → keep tokens with reply's weight_version, resubmit to the SAME server
                          (it holds the request until /continue_generation)
    stop | length       → done
```
Each token records the version of the reply that carried it, so tokens before a weight update keep
the old version and later ones the new. Connection errors are retried with backoff; HTTP errors
and timeouts are not (they name the server). This module knows nothing of rewards or trajectories.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import msgspec

log = logging.getLogger(__name__)


class GenerationError(RuntimeError):
    """A generation call failed; the message names the server."""


@dataclass
class GenerationResult:
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]  # policy version that produced each output token
    finish_reason: str  # "stop" | "length"
    server: str
    num_interruptions: int = 0
    prompt_tokens: int = 0
    latency_s: float = 0.0
    matched_stop: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def parse_reply(reply: dict[str, Any]) -> tuple[list[int], list[float], dict[str, Any]]:
    """(output_ids, output_logprobs, meta_info) of one /generate reply, across SGLang releases."""
    meta = reply.get("meta_info") or {}
    lps = meta.get("output_token_logprobs") or []
    ids = reply.get("output_ids")
    if ids is None:  # SGLang 0.4.x: ids only inside the logprob triples
        ids = [int(t[1]) for t in lps]
    ids = [int(i) for i in ids]
    logprobs = [float(t[0]) if t[0] is not None else 0.0 for t in lps]
    if len(logprobs) != len(ids):
        raise GenerationError(f"reply has {len(ids)} output ids but {len(logprobs)} logprobs")
    return ids, logprobs, meta


class GenerationClient:
    def __init__(self, server_urls: list[str], *, request_timeout_s: float = 120, connect_timeout_s: float = 10,
                 api_key: str | None = None, max_connection_retries: int = 4, retry_backoff_s: float = 0.5,
                 max_interruptions: int = 1000, sticky_keys: int = 100_000):
        if not server_urls:
            raise ValueError("GenerationClient needs at least one server URL")
        self.server_urls = [u.rstrip("/") for u in server_urls]
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connection_retries = max_connection_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_interruptions = max_interruptions
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self.inflight: dict[str, int] = {u: 0 for u in self.server_urls}
        self._sticky: OrderedDict[str, str] = OrderedDict()  # key → server, LRU-bounded
        self._sticky_max = sticky_keys
        self._rr = itertools.count()
        # Version to record for servers that report none (SGLang 0.4.x; servers launched without
        # --weight-version say "default"): whoever knows the pushed version sets it per server.
        self.fallback_version: dict[str, int] = {}

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> "GenerationClient":
        self._session_or_start()
        return self

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "GenerationClient":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _timeout(self, total: float | None = None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total or self.request_timeout_s, connect=self.connect_timeout_s)

    # ---------------------------------------------------------------- routing
    def pick_server(self, key: str | None = None) -> str:
        if key is not None and key in self._sticky:
            self._sticky.move_to_end(key)
            return self._sticky[key]
        low = min(self.inflight.values())
        cands = [u for u in self.server_urls if self.inflight[u] == low]
        url = cands[next(self._rr) % len(cands)]
        if key is not None:
            self._sticky[key] = url
            if len(self._sticky) > self._sticky_max:
                self._sticky.popitem(last=False)
        return url

    # ---------------------------------------------------------------- HTTP
    async def _request(self, method: str, url: str, path: str, body: dict | None = None,
                       timeout_s: float | None = None) -> Any:
        """One HTTP call; connection errors are retried with exponential backoff, nothing else is."""
        self._session_or_start()
        attempt = 0
        while True:
            try:
                async with self._session.request(method, url + path, json=body, timeout=self._timeout(timeout_s)) as r:
                    if r.status != 200:
                        text = await r.text()
                        raise GenerationError(f"{url}{path} returned HTTP {r.status}: {text[:500]}")
                    ctype = r.headers.get("Content-Type", "")
                    # msgspec: ~10-20 µs less per call than aiohttp's json() on the rollout hot path
                    return msgspec.json.decode(await r.read()) if "json" in ctype else await r.text()
            except aiohttp.ClientConnectionError as e:
                attempt += 1
                if attempt > self.max_connection_retries:
                    raise GenerationError(f"{url}{path}: connection failed {attempt} times: "
                                          f"{type(e).__name__}: {e}") from e
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            except asyncio.TimeoutError as e:
                raise GenerationError(f"{url}{path} timed out after {timeout_s or self.request_timeout_s:.0f}s") from e

    async def model_info(self, url: str) -> dict[str, Any]:
        return await self._request("GET", url.rstrip("/"), "/model_info")

    async def health(self, url: str) -> bool:
        try:
            await self._request("GET", url.rstrip("/"), "/health", timeout_s=min(30.0, self.request_timeout_s))
            return True
        except GenerationError:
            return False

    async def wait_healthy(self, timeout_s: float) -> None:
        """Wait until every server answers /health; raises naming the ones that did not."""
        deadline = time.monotonic() + timeout_s
        pending = set(self.server_urls)
        while pending:
            for url in list(pending):
                try:
                    async with self._session_or_start().get(url + "/health", timeout=self._timeout(5)) as r:
                        if r.status == 200:
                            pending.discard(url)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
            if pending:
                if time.monotonic() > deadline:
                    raise GenerationError(f"servers not healthy after {timeout_s:.0f}s: {sorted(pending)}")
                await asyncio.sleep(0.2)

    def _session_or_start(self) -> aiohttp.ClientSession:
        if self._session is None:
            # limit=0: no pool cap — the rollout worker's concurrency bound is the staleness gate.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=self._headers)
        return self._session

    # ---------------------------------------------------------------- generate
    async def generate(self, input_ids: list[int], *, max_new_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = -1, stop_token_ids: list[int] | None = None,
                       sampling_seed: int | None = None, ignore_eos: bool = False, rid: str | None = None,
                       key: str | None = None, server: str | None = None) -> GenerationResult:
        """Generate until stop/length, resubmitting across weight-update aborts (see module doc)."""
        if not input_ids:
            raise ValueError("input_ids is empty")
        url = server.rstrip("/") if server else self.pick_server(key)
        rid = rid or uuid.uuid4().hex
        out_ids: list[int] = []
        out_lps: list[float] = []
        out_vers: list[int] = []
        interruptions = 0
        t0 = time.perf_counter()
        self.inflight[url] = self.inflight.get(url, 0) + 1
        try:
            while True:
                remaining = max_new_tokens - len(out_ids)
                sp: dict[str, Any] = {"max_new_tokens": remaining, "temperature": temperature, "top_p": top_p,
                                      "top_k": top_k}
                if stop_token_ids:
                    sp["stop_token_ids"] = list(stop_token_ids)
                if sampling_seed is not None:
                    sp["sampling_seed"] = sampling_seed
                if ignore_eos:
                    sp["ignore_eos"] = True
                body = {"input_ids": list(input_ids) + out_ids, "sampling_params": sp, "return_logprob": True,
                        "rid": rid}
                reply = await self._request("POST", url, "/generate", body)
                if isinstance(reply, list):
                    reply = reply[0]
                ids, lps, meta = parse_reply(reply)
                version = _version(meta.get("weight_version"), url, self.fallback_version.get(url, 0))
                out_ids += ids
                out_lps += lps
                out_vers += [version] * len(ids)
                fr = meta.get("finish_reason") or {}
                ftype = fr.get("type") if isinstance(fr, dict) else str(fr)
                if ftype == "abort":
                    if fr.get("status_code") not in (None, 200):  # an engine error, not a pause
                        raise GenerationError(f"{url}/generate aborted: {fr.get('message')}")
                    if len(out_ids) >= max_new_tokens:
                        ftype = "length"
                    else:
                        interruptions += 1
                        if interruptions > self.max_interruptions:
                            raise GenerationError(f"{url}/generate: request {rid} aborted {interruptions} times")
                        continue
                if ftype not in ("stop", "length"):
                    raise GenerationError(f"{url}/generate: unexpected finish_reason {fr!r}")
                return GenerationResult(output_ids=out_ids, output_logprobs=out_lps, output_versions=out_vers,
                                        finish_reason=ftype, server=url, num_interruptions=interruptions,
                                        prompt_tokens=len(input_ids), latency_s=time.perf_counter() - t0,
                                        matched_stop=fr.get("matched") if isinstance(fr, dict) else None)
        finally:
            self.inflight[url] -= 1


def _version(v: Any, url: str, fallback: int) -> int:
    if v is None or v == "default":  # the server does not track versions: use the caller's
        return fallback
    try:
        return int(v)
    except (TypeError, ValueError):
        raise GenerationError(f"{url} reports weight_version {v!r}, which is not an integer policy version") from None
