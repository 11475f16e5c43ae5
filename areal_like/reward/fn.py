"""`RewardFn`: score completions without ever stalling rollout.

Two paths, decided by where the function comes from:
- Built-ins (no `custom_reward_function.path`): pure functions on clipped strings, called inline in
  the rollout worker's event loop (microseconds; a process hop would cost ~100× more than the score).
- A user's function: runs in a small pool of worker *processes* (`_worker.py`, started with
  `asyncio.create_subprocess_exec`, msgpack frames over stdin/stdout — no pickle). A call that
  exceeds `timeout_s` scores 0.0, counts in REWARD_TIMEOUTS, and its worker is killed (by its own
  PID) and replaced: a hung Python function cannot be interrupted inside a thread, only a process
  can be ended. An exception in the user's function scores 0.0 and is logged with its traceback tail.

The timeout covers the call itself, not the wait for a free worker. `close()` kills and reaps every
worker this object started; nothing else is touched.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

import msgspec

from areal_like.api.config import RewardFunctionConfig
from areal_like.metrics import REWARD_TIMEOUTS
from areal_like.reward.builtin import default_compute_score
from areal_like.reward.custom import load_custom_reward

logger = logging.getLogger(__name__)

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ENC = msgspec.msgpack.Encoder(enc_hook=str)  # extra_info may hold odd types; they arrive as str
_DEC = msgspec.msgpack.Decoder()


class _Worker:
    """One reward process; serves one call at a time."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls, path: str, name: str, start_timeout_s: float) -> "_Worker":
        env = dict(os.environ)
        env["PYTHONPATH"] = _PKG_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-u", _WORKER, path, name,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        w = cls(proc)
        try:
            hello = await asyncio.wait_for(w._recv(), start_timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            await w.kill()
            raise RuntimeError(f"reward worker for {path}:{name} did not start within {start_timeout_s}s "
                               f"({type(e).__name__})") from None
        if not hello.get("ok"):
            await w.kill()
            raise RuntimeError(f"custom_reward_function {path}:{name} failed to load in the worker: {hello.get('error')}")
        return w

    async def _recv(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        head = await self.proc.stdout.readexactly(4)
        return _DEC.decode(await self.proc.stdout.readexactly(int.from_bytes(head, "little")))

    async def call(self, args: list[Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        data = _ENC.encode(args)
        self.proc.stdin.write(len(data).to_bytes(4, "little") + data)
        await self.proc.stdin.drain()
        return await self._recv()

    async def kill(self) -> None:
        if self.proc.returncode is None:
            try:
                self.proc.kill()  # this worker's own PID only
            except ProcessLookupError:
                pass
        await self.proc.wait()


class RewardFn:
    """`await reward_fn.score(data_source, solution_str, ground_truth, extra_info) -> float`."""

    def __init__(self, path: "str | RewardFunctionConfig | None" = None, name: str = "compute_score", *,
                 timeout_s: float = 10.0, num_workers: int = 2, start_timeout_s: float = 60.0):
        if path is not None and not isinstance(path, str):  # a RewardFunctionConfig
            path, name, timeout_s = path.path, path.name, path.timeout_s
        self.path, self.name = path, name
        self.timeout_s = timeout_s
        self.num_workers = max(1, num_workers)
        self.start_timeout_s = start_timeout_s
        self.num_timeouts = 0
        self.num_errors = 0
        self._idle: asyncio.Queue[_Worker] | None = None
        self._slots: asyncio.Semaphore | None = None
        self._workers: set[_Worker] = set()
        self._closed = False
        if path is not None:
            # Fail at construction, naming the path and the name, not at the first rollout. This imports
            # the user's file in this process once (as verl does); calls run in the workers.
            load_custom_reward(path, name)

    @classmethod
    def from_config(cls, cfg, *, num_workers: int = 2) -> "RewardFn":
        """From `RewardFunctionConfig` (custom_reward_function.path/name/timeout_s)."""
        return cls(cfg, num_workers=num_workers)

    @property
    def isolated(self) -> bool:
        """True when calls run in worker processes (a custom function), False for inline built-ins."""
        return self.path is not None

    async def score(self, data_source: str, solution_str: str, ground_truth: str,
                    extra_info: dict[str, Any] | None = None) -> float:
        if self._closed:
            raise RuntimeError("RewardFn.score after close()")
        if self.path is None:
            try:
                return default_compute_score(data_source, solution_str, ground_truth, extra_info)
            except Exception as e:  # a built-in must not kill a rollout either
                self.num_errors += 1
                logger.warning("built-in reward for %r raised %s: %s; scoring 0.0", data_source, type(e).__name__, e)
                return 0.0
        return await self._score_isolated([data_source, solution_str, ground_truth, extra_info or {}])

    async def _acquire(self) -> _Worker:
        if self._idle is None:
            self._idle, self._slots = asyncio.Queue(), asyncio.Semaphore(self.num_workers)
        assert self._slots is not None
        await self._slots.acquire()
        try:
            if not self._idle.empty():
                return self._idle.get_nowait()
            w = await _Worker.start(self.path, self.name, self.start_timeout_s)  # type: ignore[arg-type]
            self._workers.add(w)
            return w
        except BaseException:
            self._slots.release()
            raise

    def _release(self, w: _Worker | None) -> None:
        assert self._idle is not None and self._slots is not None
        if w is not None:
            self._idle.put_nowait(w)
        self._slots.release()

    async def _discard(self, w: _Worker) -> None:
        self._workers.discard(w)
        await w.kill()

    async def _score_isolated(self, args: list[Any]) -> float:
        w = await self._acquire()
        try:
            reply = await asyncio.wait_for(w.call(args), self.timeout_s)
        except asyncio.TimeoutError:
            self.num_timeouts += 1
            REWARD_TIMEOUTS.inc()
            logger.warning("reward %s:%s took longer than %.1fs (custom_reward_function.timeout_s) on data_source "
                           "%r: scoring 0.0 and replacing worker pid %s", self.path, self.name, self.timeout_s,
                           args[0], w.proc.pid)
            await self._discard(w)
            self._release(None)  # a fresh worker starts lazily on the next call
            return 0.0
        except (asyncio.IncompleteReadError, BrokenPipeError, ConnectionResetError) as e:
            self.num_errors += 1
            logger.warning("reward worker pid %s died (%s, exit %s): scoring 0.0 and replacing it",
                           w.proc.pid, type(e).__name__, w.proc.returncode)
            await self._discard(w)
            self._release(None)
            return 0.0
        except BaseException:
            # Cancelled mid-call: the worker may still be computing, so its reply would be read by the
            # next caller — end it rather than reuse it.
            await asyncio.shield(self._discard(w))
            self._release(None)
            raise
        self._release(w)
        if not reply.get("ok"):
            self.num_errors += 1
            logger.warning("reward %s:%s raised on data_source %r: %s; scoring 0.0",
                           self.path, self.name, args[0], reply.get("error"))
            return 0.0
        return float(reply["score"])

    async def close(self) -> None:
        """Kill and reap every worker process this RewardFn started."""
        self._closed = True
        workers, self._workers = list(self._workers), set()
        await asyncio.gather(*(w.kill() for w in workers), return_exceptions=True)

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]
