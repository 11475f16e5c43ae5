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
are not (they name the server). A /generate attempt that outlives `request_timeout_s` is dropped
(the server aborts a request whose client went away) and the request is sent again — to the least
loaded other UP server when there is one — with the prompt + the tokens already held, up to
`max_timeout_retries` times; then `GenerationTimeout` names every server it timed out on. Only the
request is retried, never its group. (The dropped attempt's own tokens are lost: a non-streaming
reply carries none until it ends.) This module knows nothing of rewards or trajectories.

Health — every server is UP or DOWN; routing (least loaded, sticky keys) only picks UP servers:
```
 UP ──connection fails after the retries, or /health fails──► DOWN   (in-flight attempts there are
  ▲   (probe: refused at once; timeout/5xx twice in a row)      │     cancelled and failed over)
  └── background probe: GET /health answers 200 and /model_info's ◄┘
      weight_version is not behind the UP servers' latest replies
```
A server that comes back is taken again only once it holds the run's weights (issue 40 item 10): a
restarted server answers /health with the base model loaded, as version 0, until the learner re-syncs
it — SGLang has no start-paused flag, so without this check its first answers would be base-model
tokens. A server whose weight_version is behind what the UP servers' latest replies carried stays DOWN
(its last_error says why) until its version catches up.
Failover continues a request like the interruptible loop, on another UP server: prompt + tokens so
far, max_new_tokens reduced, the tokens already held keep their versions (`num_failovers` counts it;
the rid gets a `.f<k>` suffix so a server that comes back holding the old attempt never sees a
duplicate rid). With no UP server, generate waits up to `down_wait_s` for the probe to bring one
back, then fails naming every server and its last error. Requests pinned with `server=` never fail
over. The probe skips servers that answered a request within the last interval (proof of life, and
SGLang's /health costs a generated token).
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
import numpy as np

log = logging.getLogger(__name__)


class GenerationError(RuntimeError):
    """A generation call failed; the message names the server."""


class GenerationTimeout(GenerationError):
    """A request outlived its timeout; the message names the server (for a retried one, every server)."""

    def __init__(self, url: str, message: str):
        super().__init__(message)
        self.url = url


class ServerDownError(GenerationError):
    """A server could not be reached (after the retries) or was marked DOWN while a call was on it."""

    def __init__(self, url: str, message: str):
        super().__init__(message)
        self.url = url


@dataclass
class _ServerState:
    up: bool = True  # servers start UP: the launcher waits for /health before rollouts start
    last_error: str | None = None
    since: float = field(default_factory=time.time)  # wall clock of the last UP/DOWN transition
    probe_failures: int = 0  # consecutive /health failures that were not a refused connection
    last_ok: float = 0.0  # monotonic time of the last successful reply (the probe skips fresh ones)
    # generate attempts on this server, cancelled when it goes DOWN so they fail over at once
    attempts: set = field(default_factory=set)


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
    num_failovers: int = 0  # times the request moved to another server because its server went DOWN
    num_timeouts: int = 0  # attempts that timed out and were sent again (see `max_timeout_retries`)


def decode_routes(value: Any) -> "np.ndarray | None":
    """SGLang's `meta_info.routed_experts` — base64 of int32 (positions, layers, top-k) — as flat int32 ids;
    None when the reply has none."""
    if value is None:
        return None
    import base64

    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype=np.int32)
    return np.asarray(value, dtype=np.int32).reshape(-1)


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
                 max_interruptions: int = 1000, sticky_keys: int = 100_000, health_interval_s: float | None = 2.0,
                 health_timeout_s: float = 5.0, health_failures_to_down: int = 2, down_wait_s: float | None = None,
                 max_failovers: int = 100, max_timeout_retries: int = 2, lora_name: str | None = None):
        """`health_interval_s` None/0 disables the probe (then DOWN servers never come back and generate
        fails at once when none is UP). `down_wait_s`: how long generate waits for an UP server when
        none is left (default `request_timeout_s`). `max_timeout_retries`: how many times one generate
        call sends a timed-out request again before it raises `GenerationTimeout`. `lora_name`: the
        adapter every request names (`lora_path`, SGLang's field) — a LoRA run's (`model.lora_rank` > 0),
        which each push replaces on the servers; None = the base model."""
        if not server_urls:
            raise ValueError("GenerationClient needs at least one server URL")
        self.server_urls = [u.rstrip("/") for u in server_urls]
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connection_retries = max_connection_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_interruptions = max_interruptions
        self.health_interval_s = health_interval_s or 0.0
        self.health_timeout_s = health_timeout_s
        self.health_failures_to_down = max(1, health_failures_to_down)
        self.down_wait_s = request_timeout_s if down_wait_s is None else down_wait_s
        self.max_failovers = max_failovers
        self.max_timeout_retries = max(0, max_timeout_retries)
        self.lora_name = lora_name
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._probe_task: asyncio.Task | None = None
        self.inflight: dict[str, int] = {u: 0 for u in self.server_urls}
        self._state: dict[str, _ServerState] = {u: _ServerState() for u in self.server_urls}
        self._any_up = asyncio.Event()  # set by every DOWN → UP transition; waiters re-check the states
        self._dropped: set[asyncio.Future] = set()  # attempts cancelled because their server went DOWN
        self._sticky: OrderedDict[str, str] = OrderedDict()  # key → server, LRU-bounded
        self._sticky_max = sticky_keys
        self._rr = itertools.count()
        # Version to record for servers that report none (SGLang 0.4.x; servers launched without
        # --weight-version say "default"): whoever knows the pushed version sets it per server.
        self.fallback_version: dict[str, int] = {}
        # the weight_version of each server's latest reply: a returning server must not be behind the ones UP
        self.served_version: dict[str, int] = {}

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> "GenerationClient":
        self._session_or_start()
        return self

    async def close(self) -> None:
        task, self._probe_task = self._probe_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "GenerationClient":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _timeout(self, total: float | None = None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total or self.request_timeout_s, connect=self.connect_timeout_s)

    # ---------------------------------------------------------------- health state
    def server_states(self) -> dict[str, dict[str, Any]]:
        """url → {"up", "inflight", "last_error", "since" (wall-clock time of the last transition)}."""
        return {u: {"up": st.up, "inflight": self.inflight.get(u, 0), "last_error": st.last_error,
                    "since": st.since} for u, st in self._state.items()}

    def mark_down(self, url: str, error: str) -> None:
        """Routing skips `url` from now on; generate attempts running there fail over. Idempotent."""
        st = self._state.get(url)
        if st is None:  # a server outside the routing set (generate(server=…)): nothing to track
            return
        st.last_error = error
        st.probe_failures = 0
        if not st.up:
            return
        st.up, st.since = False, time.time()
        log.warning("generation server %s is DOWN: %s", url, error)  # once per transition
        try:
            me = asyncio.current_task()
        except RuntimeError:  # no running loop (routing unit tests): nothing can be in flight
            me = None
        for fut in list(st.attempts):
            if not fut.done() and fut is not me:  # `me` is raising ServerDownError itself
                self._dropped.add(fut)
                fut.cancel()

    def mark_up(self, url: str) -> None:
        st = self._state.get(url)
        if st is None:
            return
        st.probe_failures = 0
        if st.up:
            return
        st.up, st.since = True, time.time()
        log.warning("generation server %s is UP again (was down: %s)", url, st.last_error)
        self._any_up.set()

    def _down_report(self) -> str:
        return "; ".join(f"{u}: {'up' if st.up else 'DOWN'} (last error: {st.last_error or 'none'})"
                         for u, st in self._state.items())

    # ---------------------------------------------------------------- routing
    def pick_server(self, key: str | None = None) -> str:
        """Least in-flight UP server; a key sticks to its server while that server stays UP, and is
        re-routed (and re-stuck) when it goes DOWN. Raises ServerDownError when no server is UP."""
        state = self._state
        if key is not None:
            url = self._sticky.get(key)
            if url is not None and state[url].up:
                self._sticky.move_to_end(key)
                return url
        up = [u for u in self.server_urls if state[u].up]
        if not up:
            raise ServerDownError(",".join(self.server_urls), f"no generation server is up: {self._down_report()}")
        inflight = self.inflight
        low = min(inflight[u] for u in up)
        cands = [u for u in up if inflight[u] == low]
        url = cands[next(self._rr) % len(cands)]
        if key is not None:
            self._sticky[key] = url
            self._sticky.move_to_end(key)
            if len(self._sticky) > self._sticky_max:
                self._sticky.popitem(last=False)
        return url

    def _pick_other(self, url: str) -> str:
        """The least in-flight UP server other than `url` (for a timed-out request), else `url`. The
        group's sticky server is left as it is: its other samples are not slow."""
        others = [u for u in self.server_urls if u != url and self._state[u].up]
        if not others:
            return url
        low = min(self.inflight[u] for u in others)
        cands = [u for u in others if self.inflight[u] == low]
        return cands[next(self._rr) % len(cands)]

    async def _route(self, key: str | None, doing: str) -> str:
        """pick_server, waiting up to down_wait_s for the probe to bring a server back when none is UP."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.down_wait_s
        while True:
            if any(st.up for st in self._state.values()):
                return self.pick_server(key)
            left = deadline - loop.time()
            if left <= 0 or self._probe_task is None or self._probe_task.done():
                waited = f"after waiting {self.down_wait_s:.0f}s " if self._probe_task is not None else ""
                raise ServerDownError(",".join(self.server_urls),
                                      f"{doing}: no generation server came back {waited}— {self._down_report()}")
            self._any_up.clear()
            try:
                await asyncio.wait_for(self._any_up.wait(), left)
            except asyncio.TimeoutError:
                pass

    # ---------------------------------------------------------------- HTTP
    async def _request(self, method: str, url: str, path: str, body: dict | None = None,
                       timeout_s: float | None = None) -> Any:
        """One HTTP call; connection errors are retried with exponential backoff, nothing else is.
        Retries stop early when the server is marked DOWN meanwhile; exhausting them marks it DOWN."""
        self._session_or_start()
        st = self._state.get(url)
        attempt = 0
        while True:
            try:
                async with self._session.request(method, url + path, json=body, timeout=self._timeout(timeout_s)) as r:
                    if r.status != 200:
                        text = await r.text()
                        raise GenerationError(f"{url}{path} returned HTTP {r.status}: {text[:500]}")
                    ctype = r.headers.get("Content-Type", "")
                    # msgspec: ~10-20 µs less per call than aiohttp's json() on the rollout hot path
                    out = msgspec.json.decode(await r.read()) if "json" in ctype else await r.text()
                    if st is not None:
                        st.last_ok = time.monotonic()
                    return out
            except aiohttp.ClientConnectionError as e:
                attempt += 1
                err = f"{method} {url}{path}: connection failed {attempt} times: {type(e).__name__}: {e}"
                if attempt > self.max_connection_retries:
                    self.mark_down(url, err)
                    raise ServerDownError(url, err) from e
                if st is not None and not st.up:  # someone else already found it down: stop hammering
                    raise ServerDownError(url, f"{err} (server marked down: {st.last_error})") from e
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            except asyncio.TimeoutError as e:
                raise GenerationTimeout(url, f"{method} {url}{path} timed out after "
                                             f"{timeout_s or self.request_timeout_s:g}s") from e

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
                            self.mark_up(url)
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
        if self._probe_task is None and self.health_interval_s > 0:
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop(), name="generation-health")
        return self._session

    # ---------------------------------------------------------------- health probe
    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            now = time.monotonic()
            # An UP server that answered a request within the last interval is alive: skip it.
            due = [u for u, st in self._state.items() if not st.up or now - st.last_ok > self.health_interval_s]
            if due:
                try:
                    await asyncio.gather(*(self._probe(u) for u in due))
                except Exception:  # a probe bug must not silently end health tracking
                    log.exception("generation health probe failed; probing again in %gs", self.health_interval_s)

    async def _probe(self, url: str) -> None:
        st = self._state[url]
        try:
            async with self._session.get(url + "/health", timeout=aiohttp.ClientTimeout(
                    total=self.health_timeout_s, connect=min(self.connect_timeout_s, self.health_timeout_s))) as r:
                await r.read()
                if r.status == 200:
                    if not st.up and not await self._holds_current_weights(url):
                        return
                    self.mark_up(url)
                    return
                err, decisive = f"GET {url}/health returned HTTP {r.status}", False
        except aiohttp.ClientConnectorError as e:  # nobody listens: no need to ask twice
            err, decisive = f"GET {url}/health: cannot connect: {type(e).__name__}: {e}", True
        except aiohttp.ClientError as e:
            err, decisive = f"GET {url}/health failed: {type(e).__name__}: {e}", False
        except asyncio.TimeoutError:
            err, decisive = f"GET {url}/health timed out after {self.health_timeout_s:g}s", False
        if not st.up:
            st.last_error = err
            return
        st.probe_failures += 1
        if decisive or st.probe_failures >= self.health_failures_to_down:
            self.mark_down(url, err)

    async def _holds_current_weights(self, url: str) -> bool:
        """Whether a DOWN server that answers /health again serves the run's weights: its /model_info
        weight_version is not behind what the UP servers' latest replies carried (a restarted one holds the
        base model as version 0 until the learner re-syncs it). Compared with the servers UP now, not with
        the newest version ever seen: after a learner resumed an older checkpoint every server serves an
        older version, and the UP ones' next replies say so. With no other server UP it is taken back (the
        launcher pauses a restarted one until the re-sync). Otherwise its last_error says what it waits for."""
        current = [v for u, v in self.served_version.items() if u != url and self._state[u].up]
        if not current or max(current) <= 0:
            return True
        want = max(current)
        try:
            async with self._session.get(url + "/model_info", timeout=aiohttp.ClientTimeout(
                    total=self.health_timeout_s, connect=min(self.connect_timeout_s, self.health_timeout_s))) as r:
                info = await r.json(content_type=None) if r.status == 200 else {}
            held = _version(info.get("weight_version"), url, self.fallback_version.get(url, 0))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, GenerationError, AttributeError) as e:
            self._state[url].last_error = f"GET {url}/model_info after /health: {type(e).__name__}: {e}"
            return False
        if held < want:
            self._state[url].last_error = (f"{url} answers /health but serves weight_version {held}, behind v{want} "
                                           "of the servers up: held DOWN until the learner re-syncs it")
            return False
        return True

    async def _attempt(self, url: str, body: dict) -> Any:
        """One /generate call that a DOWN transition of its server cancels (→ ServerDownError)."""
        st = self._state.get(url)
        if st is None:
            return await self._request("POST", url, "/generate", body)
        fut = asyncio.ensure_future(self._request("POST", url, "/generate", body))
        st.attempts.add(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            # ours only if mark_down cancelled it and nobody is cancelling the caller
            if fut in self._dropped and not asyncio.current_task().cancelling():
                raise ServerDownError(url, f"POST {url}/generate: server marked down while generating: "
                                           f"{st.last_error}") from None
            raise
        finally:
            st.attempts.discard(fut)
            self._dropped.discard(fut)

    # ---------------------------------------------------------------- generate
    async def generate(self, input_ids: list[int], *, max_new_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = -1, stop_token_ids: list[int] | None = None,
                       sampling_seed: int | None = None, ignore_eos: bool = False, rid: str | None = None,
                       key: str | None = None, server: str | None = None,
                       top_logprobs_num: int = 0, routed_experts_start_len: int | None = None) -> GenerationResult:
        """Generate until stop/length, resubmitting across weight-update aborts and failing over to
        another server when this one goes down (see module doc). `top_logprobs_num` > 0: each output
        token's most likely tokens, SGLang's `output_top_logprobs` ([[logprob, id, text], …] per token),
        are in `extra["output_top_logprobs"]`.

        `routed_experts_start_len` (MoE; the servers run with --enable-return-routed-experts): SGLang's
        `return_routed_experts` from that position of `input_ids` — `extra["routed_experts"]` is a (positions,
        layers × top-k) int32 array of the experts each position was routed to, positions [start, prompt +
        output − 1). A resubmission asks only for the positions it lacks, so each position keeps the route
        of the forward that first ran it; positions a reply did not cover leave `extra["routed_experts"]`
        None (the learner then routes those samples itself)."""
        if not input_ids:
            raise ValueError("input_ids is empty")
        rid = rid or uuid.uuid4().hex
        pinned = server is not None
        url = server.rstrip("/") if pinned else await self._route(key, f"generate rid={rid}")
        out_ids: list[int] = []
        out_lps: list[float] = []
        out_vers: list[int] = []
        out_tops: list[Any] = []
        routes: list[np.ndarray] = []
        routes_n = routed_experts_start_len or 0  # positions whose routes are known (from the caller's start)
        routes_ok = routed_experts_start_len is not None
        width = 0
        interruptions = failovers = timeouts = 0
        timed_out_on: list[str] = []
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
                # A fresh rid per failover / timeout retry: a server that still holds an old attempt
                # never sees a duplicate rid.
                suffix = (f".f{failovers}" if failovers else "") + (f".t{timeouts}" if timeouts else "")
                body = {"input_ids": list(input_ids) + out_ids, "sampling_params": sp, "return_logprob": True,
                        "rid": rid + suffix}
                if self.lora_name is not None:  # resolved by the server when it admits the request
                    body["lora_path"] = self.lora_name
                if top_logprobs_num > 0:
                    body["top_logprobs_num"] = top_logprobs_num
                if routes_ok:
                    body["return_routed_experts"] = True
                    body["routed_experts_start_len"] = routes_n
                try:
                    reply = await self._attempt(url, body)
                except GenerationTimeout as e:
                    timeouts += 1
                    timed_out_on.append(url)
                    if timeouts > self.max_timeout_retries:
                        raise GenerationTimeout(url, f"generate rid={rid}: timed out {timeouts} times "
                                                     f"(request_timeout_s={self.request_timeout_s:g}) on "
                                                     f"{', '.join(timed_out_on)}; last: {e}") from e
                    new_url = url if pinned else self._pick_other(url)
                    log.warning("rid=%s: %s; sending it again (%d/%d) to %s with the %d/%d tokens held", rid, e,
                                timeouts, self.max_timeout_retries, new_url, len(out_ids), max_new_tokens)
                    self.inflight[url] -= 1
                    self.inflight[new_url] = self.inflight.get(new_url, 0) + 1
                    url = new_url
                    continue
                except ServerDownError as e:
                    if pinned or failovers >= self.max_failovers:
                        raise
                    doing = (f"generate rid={rid} failing over from {url} with {len(out_ids)}/{max_new_tokens} "
                             f"tokens ({e})")
                    new_url = await self._route(key, doing)
                    failovers += 1
                    log.info("rid=%s: %s went down after %d/%d tokens; continuing on %s", rid, url, len(out_ids),
                             max_new_tokens, new_url)
                    self.inflight[url] -= 1
                    self.inflight[new_url] = self.inflight.get(new_url, 0) + 1
                    url = new_url
                    continue
                if isinstance(reply, list):
                    reply = reply[0]
                ids, lps, meta = parse_reply(reply)
                version = _version(meta.get("weight_version"), url, self.fallback_version.get(url, 0))
                self.served_version[url] = version
                out_ids += ids
                out_lps += lps
                out_vers += [version] * len(ids)
                if top_logprobs_num > 0:
                    out_tops += list(meta.get("output_top_logprobs") or [])[:len(ids)]
                if routes_ok:
                    flat = decode_routes(meta.get("routed_experts"))
                    want = len(body["input_ids"]) + len(ids) - 1 - routes_n  # positions this reply adds
                    if flat is not None and flat.size == 0 and not ids:
                        pass  # aborted before it ran anything: nothing new
                    elif flat is None or want <= 0 or flat.size % want or (width and flat.size // want != width):
                        log.warning("rid=%s: %s returned %s route ids for %d new positions: this sample is trained "
                                    "without routing replay", rid, url, "no" if flat is None else flat.size, want)
                        routes_ok = False
                    else:
                        width = flat.size // want
                        routes.append(flat.reshape(want, width))
                        routes_n += want
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
                                        matched_stop=fr.get("matched") if isinstance(fr, dict) else None,
                                        num_failovers=failovers, num_timeouts=timeouts,
                                        extra={**({"output_top_logprobs": out_tops} if top_logprobs_num > 0 else {}),
                                               **({"routed_experts": np.concatenate(routes) if routes_ok and routes
                                                   else None} if routed_experts_start_len is not None else {})})
        finally:
            self.inflight[url] -= 1


    async def score(self, seqs: list[list[int]], starts: list[int], *, key: str | None = None) -> list[list[float]]:
        """The served model's logprob of each token of `seqs[i][starts[i]:]` given the tokens before it (a
        teacher's scoring of samples' own tokens; every start ≥ 1), in one batched request: SGLang's
        `/generate` with the sequences as `input_ids`, `max_new_tokens` 0, `return_logprob` and one
        `logprob_start_len` per sequence → each reply's `meta_info.input_token_logprobs` (not
        temperature-scaled). Timeouts are sent again (to another server when there is one) up to
        `max_timeout_retries` times; a server that goes down fails over as `generate` does."""
        if len(seqs) != len(starts) or not seqs:
            raise ValueError(f"score: {len(seqs)} sequences and {len(starts)} starts: give one start per sequence")
        for ids, st in zip(seqs, starts):
            if not 1 <= st < len(ids):
                raise ValueError(f"score: start={st} must be in [1, {len(ids)}) (the first token has no logprob)")
        url = await self._route(key, "score")
        timeouts = failovers = 0
        tried: list[str] = []
        body = {"input_ids": [list(x) for x in seqs], "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                "return_logprob": True, "logprob_start_len": list(starts)}
        while True:
            body["rid"] = [uuid.uuid4().hex for _ in seqs]
            try:
                reply = await self._attempt(url, body)
            except GenerationTimeout as e:
                timeouts += 1
                tried.append(url)
                if timeouts > self.max_timeout_retries:
                    raise GenerationTimeout(url, f"score: timed out {timeouts} times (request_timeout_s="
                                                 f"{self.request_timeout_s:g}) on {', '.join(tried)}; last: {e}") from e
                url = self._pick_other(url)
                continue
            except ServerDownError as e:
                if failovers >= self.max_failovers:
                    raise
                failovers += 1
                url = await self._route(key, f"score failing over from {url} ({e})")
                continue
            replies = reply if isinstance(reply, list) else [reply]
            if len(replies) != len(seqs):
                raise GenerationError(f"{url}/generate: {len(replies)} replies to a batch of {len(seqs)} scorings")
            out = []
            for ids, st, r in zip(seqs, starts, replies):
                lps = (r.get("meta_info") or {}).get("input_token_logprobs")
                want = len(ids) - st
                if not isinstance(lps, list) or len(lps) != want or any(e is None or e[0] is None for e in lps):
                    raise GenerationError(f"{url}/generate: input_token_logprobs of {want} tokens from position {st} "
                                          f"expected, got {str(lps)[:200]}")
                out.append([float(e[0]) for e in lps])
            return out


def _version(v: Any, url: str, fallback: int) -> int:
    if v is None or v == "default":  # the server does not track versions: use the caller's
        return fallback
    try:
        return int(v)
    except (TypeError, ValueError):
        raise GenerationError(f"{url} reports weight_version {v!r}, which is not an integer policy version") from None
