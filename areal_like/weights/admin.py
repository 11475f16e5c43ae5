"""The server-admin HTTP side every transport shares (`WeightPusher`, `DiskWeightPusher`,
`SharedMemoryWeightPusher`, `CudaIpcWeightPusher`): the verbs of `weights.control.GenerationControl` that do
not depend on how the bytes travel.

One aiohttp session to every generation server's admin routes: POST with the admin bearer token,
a timeout, and every failure (HTTP status, timeout, connection, `success: false`) raised as a
`WeightPushError` naming the server and path; fan-out to all servers; the optional
/begin_weight_update and /end_weight_update around an update (probed once per server, a 404 —
or a 401 on the probe, see `_begin_or_end` — means the server does not speak them); `wait_servers`, the bounded wait for restarted servers
that both pushers' `reform()` starts with.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, Self

import aiohttp


class WeightPushError(RuntimeError):
    pass


class ServerAdmin:
    """Base of the transports: the admin HTTP session to `server_urls`.

    Subclasses extend `init()` / `close()` (calling these) and use `_post`, `_all`, `_begin_or_end`."""

    def __init__(self, servers: list[str], *, timeout_s: float, admin_api_key: str | None, api_key: str | None = None):
        if not servers:
            raise ValueError(f"{type(self).__name__} needs at least one server URL")
        self.server_urls = [u.rstrip("/") for u in servers]
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}
        # Reads of a server's normal routes (/model_info's weight version): SGLang takes only the API key there
        # once one is set (its admin key is refused with 401); without one, the admin headers as before
        self._read_headers = {"Authorization": f"Bearer {api_key}"} if api_key else self._headers
        self._session: aiohttp.ClientSession | None = None
        self._begin_end: dict[str, bool] = {}  # server → speaks /begin_weight_update (SGLang ≥ 0.5.21)

    # ---------------------------------------------------------------- HTTP helpers
    async def _post(self, url: str, path: str, body: dict[str, Any], *, timeout_s: float | None = None,
                    allow_404: bool = False, absent: frozenset[int] = frozenset({404})) -> dict[str, Any] | None:
        """POST; with `allow_404`, a status in `absent` (the route does not exist) returns None."""
        assert self._session is not None, "call init() first"
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self._session.post(url + path, json=body, headers=self._headers, timeout=timeout) as resp:
                if allow_404 and resp.status in absent:
                    return None
                text = await resp.text()
                if resp.status != 200:
                    raise WeightPushError(f"{url}{path} returned HTTP {resp.status}: {text[:500]}")
                try:
                    data = await resp.json(content_type=None)
                except ValueError:
                    data = {"success": True, "message": text}
        except asyncio.TimeoutError as e:
            raise WeightPushError(f"{url}{path} timed out after {timeout.total:.0f}s") from e
        except aiohttp.ClientError as e:
            raise WeightPushError(f"{url}{path} failed: {type(e).__name__}: {e}") from e
        if isinstance(data, dict) and data.get("success") is False:
            raise WeightPushError(f"{url}{path} reported failure: {data.get('message') or data.get('error_message')}")
        return data

    async def _all(self, path: str, body: dict[str, Any], **kw) -> list:
        return await asyncio.gather(*(self._post(u, path, body, **kw) for u in self.server_urls))

    async def _begin_or_end(self, path: str) -> None:
        """/begin_weight_update or /end_weight_update on every server that speaks them (SGLang ≥ 0.5.21).

        The first /begin_weight_update per server is the probe: a 404 means the route does not exist.
        So does a 401 there, and only there: SGLang's auth middleware gives an unknown route the
        NORMAL level, which wants `--api-key`, not the admin key we send (0.5.10–0.5.19 with
        `server.api_key` set). The probe runs right after /pause_generation succeeded with the same
        header, and every existing admin route accepts what pause accepted, so a 401 there cannot be
        a wrong admin key. Once a server is known to speak them, every status but 200 is an error."""
        async def one(url: str):
            known = self._begin_end.get(url)
            if known is False:
                return
            probe = known is None and path == "/begin_weight_update"
            r = await self._post(url, path, {}, allow_404=known is None,
                                 absent=frozenset({404, 401}) if probe else frozenset({404}))
            self._begin_end[url] = r is not None
        await asyncio.gather(*(one(u) for u in self.server_urls))

    # ---------------------------------------------------------------- API
    async def init(self) -> None:
        """Open the HTTP session (once)."""
        if self._session is None:
            self._session = aiohttp.ClientSession()

    async def wait_servers(self, timeout_s: float | None = None, poll_s: float = 0.25) -> None:
        """Wait until every server answers GET /health with 200 ("paused" counts: a server restarted
        with --start-paused is up and waiting for weights). Raises WeightPushError naming the servers
        that did not answer within `timeout_s` (default: the pusher's timeout)."""
        assert self._session is not None, "call init() first"
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        waiting = list(self.server_urls)
        last: dict[str, str] = {}

        async def up(url: str) -> bool:
            left = max(0.5, min(10.0, deadline - time.monotonic()))
            try:
                async with self._session.get(url + "/health", headers=self._headers,
                                             timeout=aiohttp.ClientTimeout(total=left)) as resp:
                    if resp.status == 200:
                        return True
                    last[url] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                last[url] = f"{type(e).__name__}: {e}"
            return False

        while True:
            ok = await asyncio.gather(*(up(u) for u in waiting))
            waiting = [u for u, o in zip(waiting, ok) if not o]
            if not waiting:
                return
            if time.monotonic() >= deadline:
                raise WeightPushError("server(s) did not answer /health within "
                                      f"{self.timeout_s if timeout_s is None else timeout_s:.0f}s: "
                                      + "; ".join(f"{u} ({last.get(u, 'no answer')})" for u in waiting))
            await asyncio.sleep(poll_s)

    async def reform(self) -> str:
        """After a server restarted or a push failed: wait for every server (`wait_servers`) and set
        up what the next push needs again; returns what was done, for the log. The caller pushes the
        current weights next (which also continues a server started paused)."""
        await self.init()
        await self.wait_servers()
        return "every server answers again (no weight group in this mode)"

    async def pause(self, mode: str = "abort") -> None:
        """/pause_generation on every server (`abort`: running requests return, their clients resubmit;
        `retract`: they wait in the server's queue; `in_place`: they keep their KV cache)."""
        await self._all("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """Continue generation on every server (after a failed `WeightPusher.update` was repaired;
        `DiskWeightPusher.update` already does it)."""
        await self._all("/continue_generation", {})

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """SGLang's /release_memory_occupation on every (paused) server: free the KV cache and/or the
        weights (`tags` from control.MEMORY_TAGS; None = all)."""
        await self._all("/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        """/resume_memory_occupation on every server: allocate what `release_memory` freed (None = all)."""
        await self._all("/resume_memory_occupation", {"tags": tags})

    @contextlib.asynccontextmanager
    async def paused_unless(self, paused: bool) -> AsyncIterator[float]:
        """The pause window of one update: pause (abort) unless the caller already holds the servers paused
        (`paused`, a co-located phase); yields when the window opened (perf_counter); continues the servers
        afterwards unless the caller holds them — also after a failure, since every server then serves a
        complete set (the new one, or the old one after its rollback)."""
        if not paused:
            await self.pause("abort")
        try:
            yield time.perf_counter()
        finally:
            if not paused:
                await self.resume()

    async def swap_adapter(self, url: str, route: str, body: dict[str, Any], previous: dict[str, Any] | None,
                           version: int) -> None:
        """One server's LoRA push, inside the caller's pause: unload the run's adapter (`body["lora_name"]`;
        a fresh or restarted server has none), POST `route` `body` (SGLang's /load_lora_adapter, or
        /load_lora_adapter_from_tensors: load it under that name), take `version` as the weight version.
        A failed load gets `previous` (the last body that loaded) back, best effort, before the error is
        raised, so the name is never left empty. Paused with `abort`, nothing holds the old adapter:
        SGLang's unload, which waits for the requests using it, returns at once."""
        name = body["lora_name"]
        try:
            await self._post(url, "/unload_lora_adapter", {"lora_name": name})
        except WeightPushError as e:
            if "does not exist" not in str(e):
                raise
        try:
            await self._post(url, route, body)
        except WeightPushError:
            if previous is not None:
                with contextlib.suppress(WeightPushError):
                    await self._post(url, route, previous)
            raise
        await self._post(url, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})

    async def swap_adapters(self, route: str, bodies: list[dict[str, Any]], previous: list[dict[str, Any] | None],
                            version: int, *, flush: bool) -> None:
        """`swap_adapter` on every server (`bodies[k]`, `previous[k]` for server k), then with `flush` one
        /flush_cache (the prefix cache holds KV computed with the old adapter; a co-located phase's KV
        release already dropped it)."""
        await asyncio.gather(*(self.swap_adapter(u, route, b, p, version)
                               for u, b, p in zip(self.server_urls, bodies, previous, strict=True)))
        if flush:
            await self._all("/flush_cache", {})

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Self:
        await self.init()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
