"""`RewardFn`: score completions without ever stalling rollout, and count every failure.

Where a call runs:
- Every call, built-in or a user's function, runs in a pool of `custom_reward_function.num_workers`
  worker *processes* (`_worker.py`, started with `asyncio.create_subprocess_exec`, msgpack frames over
  stdin/stdout — no pickle) under `custom_reward_function.timeout_s`; calls run concurrently up to
  the pool size. The pool's workers run the user's function (`custom_reward_function.path`) or,
  without one, the built-in dispatcher (builtin.py's `default_compute_score`, told
  `reward.format_score`). Built-ins need it as much as user code: math-verify's sympy can grind for
  minutes on an answer like `\\boxed{9^{9^{9}}}`, and the code scorer runs the model's programs.
- One exception: the demo task's built-in (`INLINE_SOURCES`, data_source "areal_like/demo") runs
  inline in the event loop, and so does the arithmetic task's ("areal_like/arithmetic": one linear regex
  over the reply's last 300 characters and a float comparison). The demo's is a comparison of two
  stripped strings that cannot hang or raise;
  inline it costs ~1 µs a call against ~0.1–0.2 ms for the process hop (measured on a 2-CPU box:
  gsm8k 125 µs sequential, 80 µs with 2 workers busy, vs 1.2 µs inline), and its runs (2-CPU boxes,
  the tests) need no extra interpreters (~0.5 s and ~60 MB each, math-verify's sympy included).
  Calls are not batched: a batch would share one timeout, so one hung sample would zero the rest,
  and ~0.1 ms is small next to generating the sample. A custom function, when set, scores the demo
  source too.

A call that exceeds `timeout_s` scores 0.0 and its worker is killed (SIGKILL, its own PID: whatever it
started itself, e.g. a code sandbox, must bound its own lifetime) and replaced: a hung Python function
cannot be interrupted inside a thread, only a process can be ended. A call that waits longer than
`timeout_s` for a free worker (every worker busy, e.g. all hung) also scores 0.0 as a timeout, so a
group's rewards are done within ~2 × timeout_s whatever the function does — a hung reward never
stalls a step.

Every failure scores 0.0 and is counted by kind (`FAILURE_KINDS`): `exception` (the function raised,
its worker died or could not start), `timeout`, `non_finite` (NaN/±inf), `not_a_number` (a string,
None, a dict without "score", …). Counts go to `failures`, Prometheus (`areal_like_reward_failures`
{kind}) and the `on_failure(kind, text, first)` hook (the rollout worker forwards them to the run's
Redis counters; `first` marks this process's first failure of that kind, whose text carries the
traceback). The first failure of each kind is logged with its traceback, later ones at most every
`_LOG_EVERY_S` per kind. Over the last `failure_window` scored samples, more than
`max_failure_fraction` failed → `on_limit(message)` is called once (the rollout worker stops the run
with the message, which names the function as path:name).

`close()` kills and reaps every worker this object started; nothing else is touched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import sys
import time
from collections import deque
from typing import Any, Callable

import msgspec

from areal_like.api.config import RewardFunctionConfig, RewardShapingConfig
from areal_like.buffer.scripts import REWARD_FAILURE_KINDS
from areal_like.metrics import REWARD_FAILURES, REWARD_TIMEOUTS
from areal_like.data.arithmetic import ARITHMETIC_DATA_SOURCE
from areal_like.data.demo_task import DEMO_DATA_SOURCE
from areal_like.reward.builtin import default_compute_score
from areal_like.reward.custom import load_custom_reward, to_score

logger = logging.getLogger(__name__)

FAILURE_KINDS = REWARD_FAILURE_KINDS
"""exception, timeout, non_finite, not_a_number (the Redis counter fields use the same names)."""

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ENC = msgspec.msgpack.Encoder(enc_hook=str)  # extra_info may hold odd types; they arrive as str
_DEC = msgspec.msgpack.Decoder()
_LOG_EVERY_S = 10.0

INLINE_SOURCES = frozenset({DEMO_DATA_SOURCE, ARITHMETIC_DATA_SOURCE})
"""Built-in data sources scored in the event loop, not in a worker (see the module doc for why)."""


class _Worker:
    """One reward process; serves one call at a time."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls, argv: list[str], label: str, start_timeout_s: float,
                    extra_env: dict[str, str] | None = None) -> "_Worker":
        """`python _worker.py *argv` with `extra_env` added to this process's environment; `label` names
        the function in errors."""
        env = dict(os.environ, **(extra_env or {}))
        env["PYTHONPATH"] = _PKG_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        # Not a new session: the worker stays in this process's group, which the launcher ends as a
        # whole when it stops or restarts this role — a hung reward worker must not outlive it.
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-u", _WORKER, *argv,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        w = cls(proc)
        try:
            hello = await asyncio.wait_for(w._recv(), start_timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            await w.kill()
            raise RuntimeError(f"reward worker for {label} did not start within {start_timeout_s}s "
                               f"({type(e).__name__}, exit code {proc.returncode})") from None
        except BaseException:  # cancelled while starting: never leave the process behind
            await asyncio.shield(w.kill())
            raise
        if not hello.get("ok"):
            await w.kill()
            raise RuntimeError(f"reward function {label} failed to load in the worker: {hello.get('error')}")
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
    """`await reward_fn.score(data_source, solution_str, ground_truth, extra_info) -> float` (never raises
    for a failure of the function: it scores 0.0 and is counted). `path=None`: the built-ins, with
    `format_score` (reward.format_score) for a well-formed wrong answer (gsm8k, QA exact match)."""

    def __init__(self, path: "str | RewardFunctionConfig | None" = None, name: str = "compute_score", *,
                 timeout_s: float = 10.0, num_workers: int = 4, start_timeout_s: float = 60.0,
                 format_score: float = 0.0,
                 max_failure_fraction: float = 1.0, failure_window: int = 256,
                 on_failure: Callable[[str, str, bool], None] | None = None,
                 on_limit: Callable[[str], None] | None = None):
        if path is not None and not isinstance(path, str):  # a RewardFunctionConfig
            path, name, timeout_s, num_workers = path.path, path.name, path.timeout_s, path.num_workers
        if num_workers < 1:
            raise ValueError(f"custom_reward_function.num_workers={num_workers} must be ≥ 1")
        if timeout_s <= 0:
            raise ValueError(f"custom_reward_function.timeout_s={timeout_s} must be > 0")
        if not 0.0 <= max_failure_fraction <= 1.0:
            raise ValueError(f"reward.max_failure_fraction={max_failure_fraction} must be in [0, 1] (1 = never stop)")
        if failure_window < 1:
            raise ValueError(f"reward.failure_window={failure_window} must be ≥ 1")
        if not math.isfinite(format_score):
            raise ValueError(f"reward.format_score={format_score} must be a finite number")
        self.path, self.name = path, name
        self.format_score = float(format_score)
        """Built-ins only (a custom function scores format itself)."""
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.start_timeout_s = start_timeout_s
        self.max_failure_fraction = max_failure_fraction
        self.failure_window = failure_window
        self.on_failure = on_failure
        """Called as on_failure(kind, text, first) for every failure (see the module doc)."""
        self.on_limit = on_limit
        """Called once with the message when the failure fraction is exceeded."""
        self.failures: dict[str, int] = dict.fromkeys(FAILURE_KINDS, 0)
        self.scored = 0
        self.limit_message: str | None = None
        self._window: deque[bool] = deque(maxlen=failure_window)
        self._window_failed = 0
        self._first: dict[str, str] = {}
        self._first_line: str | None = None  # the run's first failure, one line (for the limit message)
        self._last_log: dict[str, float] = {}
        self._unlogged: dict[str, int] = dict.fromkeys(FAILURE_KINDS, 0)
        self._idle: asyncio.Queue[_Worker] | None = None
        self._slots: asyncio.Semaphore | None = None
        self._workers: set[_Worker] = set()
        self._closed = False
        self.judge: Any = None
        """A `Judge` (reward/judge.py) when the run has a judge component: `score` mixes its grades in."""
        for kind in FAILURE_KINDS:  # exported at 0 from the start
            REWARD_FAILURES.labels(kind=kind)
        if path is not None:
            # Fail at construction, naming the path and the name, not at the first rollout. This imports
            # the user's file in this process once (as verl does); calls run in the workers.
            load_custom_reward(path, name)

    @classmethod
    def from_config(cls, cfg: RewardFunctionConfig, shaping: RewardShapingConfig | None = None,
                    **kw: Any) -> "RewardFn":
        """From `custom_reward_function.*` (path, name, timeout_s, num_workers) and `reward.*`
        (format_score, max_failure_fraction, failure_window)."""
        if shaping is not None:
            kw.setdefault("format_score", shaping.format_score)
            kw.setdefault("max_failure_fraction", shaping.max_failure_fraction)
            kw.setdefault("failure_window", shaping.failure_window)
        return cls(cfg, **kw)

    def runs_inline(self, data_source: str) -> bool:
        """True when a call for `data_source` runs in the event loop (`INLINE_SOURCES`, built-ins only),
        False when it runs in a worker process."""
        return self.path is None and data_source in INLINE_SOURCES

    def _worker_argv(self) -> list[str]:
        if self.path is None:
            return ["--builtin", repr(self.format_score)]
        return [self.path, self.name]

    def _worker_env(self) -> dict[str, str]:
        """A custom function's judge client settings (judge_client.py), when the run has a judge."""
        if self.path is None or self.judge is None:
            return {}
        from areal_like.reward.judge_client import JUDGE_CLIENT_ENV

        return {JUDGE_CLIENT_ENV: json.dumps(self.judge.client_spec())}

    @property
    def label(self) -> str:
        """The function as users name it: `path:name`, or the built-in scorer."""
        return f"{self.path}:{self.name}" if self.path is not None else "built-in default_compute_score"

    # ---- scoring --------------------------------------------------------------------------------
    async def score(self, data_source: str, solution_str: str, ground_truth: str,
                    extra_info: dict[str, Any] | None = None, *, question: str = "",
                    key: str | None = None) -> float:
        """The sample's reward. With a judge (`self.judge`, judge.*): `judge.rule_weight` × the rule reward
        (not computed when that weight is 0) + `judge.weight` × the judge's grade of `solution_str` for
        `question` (not graded when that weight is 0; `key`: the group, whose gradings go to one judge
        server). Each part that fails scores 0 and is counted (the window counts rule calls and gradings
        alike). A custom function with a `judge` parameter gets a JudgeClient for `question` (judge_client.py)."""
        if self._closed:
            raise RuntimeError("RewardFn.score after close()")
        judge = self.judge
        if judge is None or judge.cfg.weight == 0.0:  # the rule alone (e.g. a custom function calling the judge)
            ruled = await self._rule(data_source, solution_str, ground_truth, extra_info, question)
            return ruled if judge is None else judge.cfg.rule_weight * ruled
        jc = judge.cfg
        grade = self._grade(judge, data_source, question, solution_str, ground_truth, key)
        if jc.rule_weight == 0.0:
            return jc.weight * await grade
        ruled, graded = await asyncio.gather(
            self._rule(data_source, solution_str, ground_truth, extra_info, question), grade)
        return jc.rule_weight * ruled + jc.weight * graded

    async def _grade(self, judge: Any, data_source: str, question: str, response: str, reference: str,
                     key: str | None) -> float:
        from areal_like.reward.judge import JudgeFailure

        try:
            return self._ok(await judge.grade(question, response, reference, key=key))
        except JudgeFailure as e:
            return self._failed(e.kind, data_source, str(e), label=judge.label)
        except Exception as e:  # noqa: BLE001 — a judge's bug must not kill a rollout either
            import traceback

            return self._failed("exception", data_source, "".join(traceback.format_exception(e)).rstrip(),
                                label=judge.label)

    async def _rule(self, data_source: str, solution_str: str, ground_truth: str,
                    extra_info: dict[str, Any] | None, question: str = "") -> float:
        if self.runs_inline(data_source):
            try:
                value = default_compute_score(data_source, solution_str, ground_truth, extra_info,
                                              format_score=self.format_score)
            except Exception as e:  # a built-in must not kill a rollout either
                import traceback

                return self._failed("exception", data_source, "".join(traceback.format_exception(e)).rstrip())
            try:
                return self._ok(to_score(value))
            except Exception as e:  # custom.ScoreError
                return self._failed(getattr(e, "kind", "not_a_number"), data_source, f"{type(e).__name__}: {e}")
        args = [data_source, solution_str, ground_truth, extra_info or {}]
        # the question only travels where a custom function's JudgeClient may need it (a run with a judge)
        return await self._score_isolated(args + [question] if self.judge is not None else args)

    async def _acquire(self) -> "_Worker | tuple[str, str]":
        """A worker, or the text of the failure (a timeout waiting for one, or a worker that cannot start)."""
        if self._idle is None:
            self._idle, self._slots = asyncio.Queue(), asyncio.Semaphore(self.num_workers)
        assert self._slots is not None
        try:
            await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
        except asyncio.TimeoutError:
            return ("timeout", f"waited {self.timeout_s:g}s (custom_reward_function.timeout_s) for a free reward "
                    f"worker: all {self.num_workers} are busy (raise custom_reward_function.num_workers if the "
                    f"function is merely slow)")
        try:
            if not self._idle.empty():
                return self._idle.get_nowait()
            w = await _Worker.start(self._worker_argv(), self.label, self.start_timeout_s, self._worker_env())
            self._workers.add(w)
            return w
        except RuntimeError as e:  # the worker did not start: a failure of this call, not of the rollout
            self._slots.release()
            return ("exception", str(e))
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
        got = await self._acquire()
        if isinstance(got, tuple):
            return self._failed(got[0], args[0], got[1])
        w = got
        try:
            reply = await asyncio.wait_for(w.call(args), self.timeout_s)
        except asyncio.TimeoutError:
            pid = w.proc.pid
            await self._discard(w)
            self._release(None)  # a fresh worker starts on the next call
            return self._failed("timeout", args[0], f"took longer than {self.timeout_s:g}s "
                                f"(custom_reward_function.timeout_s); worker pid {pid} killed and replaced")
        except (asyncio.IncompleteReadError, BrokenPipeError, ConnectionResetError) as e:
            pid = w.proc.pid
            await self._discard(w)
            self._release(None)
            return self._failed("exception", args[0], f"reward worker pid {pid} died while scoring "
                                f"({type(e).__name__}, exit code {w.proc.returncode}); replaced")
        except BaseException:
            # Cancelled mid-call: the worker may still be computing, so its reply would be read by the
            # next caller — end it rather than reuse it.
            await asyncio.shield(self._discard(w))
            self._release(None)
            raise
        self._release(w)
        if not reply.get("ok"):
            kind = reply.get("kind", "exception")
            return self._failed(kind if kind in self.failures else "exception", args[0], str(reply.get("error")))
        return self._ok(float(reply["score"]))

    # ---- accounting -----------------------------------------------------------------------------
    def _ok(self, score: float) -> float:
        self._record(False)
        return score

    def _failed(self, kind: str, data_source: str, detail: str, *, label: str | None = None) -> float:
        self.failures[kind] += 1
        REWARD_FAILURES.labels(kind=kind).inc()
        if kind == "timeout":
            REWARD_TIMEOUTS.inc()
        first = kind not in self._first
        what = {"exception": "raised", "timeout": "timed out", "non_finite": "returned a non-finite score",
                "not_a_number": "returned something that is not a number"}[kind]
        text = f"reward {label or self.label} {what} on data_source {data_source!r}: {detail}"
        now = time.monotonic()
        if first:
            self._first[kind] = text
            if self._first_line is None:
                last = detail.strip().splitlines()[-1] if detail.strip() else ""
                self._first_line = f"{label or self.label} {what} on data_source {data_source!r}: {last[:300]}"
            self._last_log[kind] = now
            logger.error("first reward failure of kind %s (scored 0.0; counted in reward_failures/%s):\n%s",
                         kind, kind, text)
        else:
            self._unlogged[kind] += 1
            if now - self._last_log[kind] >= _LOG_EVERY_S:
                logger.warning("%d more reward failure(s) of kind %s (total %d), e.g. %s", self._unlogged[kind],
                               kind, self.failures[kind], text.splitlines()[-1][:300])
                self._unlogged[kind] = 0
                self._last_log[kind] = now
        if self.on_failure is not None:
            try:
                self.on_failure(kind, text, first)
            except Exception:
                logger.exception("reward on_failure hook failed")
        self._record(True)
        return 0.0

    def _record(self, failed: bool) -> None:
        self.scored += 1
        if len(self._window) == self._window.maxlen and self._window[0]:
            self._window_failed -= 1
        self._window.append(failed)
        self._window_failed += failed
        # More than max_failure_fraction × window failures among the last `window` samples: past the
        # limit already, even before the window is full (the fraction cannot come back under it).
        if failed and self.limit_message is None and self._window_failed > self.max_failure_fraction * self.failure_window:
            n = len(self._window)
            counts = ", ".join(f"{k} {v}" for k, v in self.failures.items() if v)
            self.limit_message = (
                f"reward function {self.label}{f' and {self.judge.label}' if self.judge is not None else ''} "
                f"failed on {self._window_failed} of the last {n} scored samples "
                f"(reward.max_failure_fraction={self.max_failure_fraction:g} of reward.failure_window="
                f"{self.failure_window}; failures so far: {counts}); first failure: {self._first_line}. "
                f"Fix the function (or raise reward.max_failure_fraction; 1 = never stop)")
            if self.on_limit is not None:
                self.on_limit(self.limit_message)
            else:
                logger.error("%s", self.limit_message)

    @property
    def num_timeouts(self) -> int:
        return self.failures["timeout"]

    @property
    def num_errors(self) -> int:
        """Failures other than timeouts."""
        return sum(v for k, v in self.failures.items() if k != "timeout")

    def first_failures(self) -> dict[str, str]:
        """{kind: text of this object's first failure of that kind} (with the traceback)."""
        return dict(self._first)

    async def close(self) -> None:
        """Kill and reap every worker process this RewardFn started."""
        self._closed = True
        workers, self._workers = list(self._workers), set()
        await asyncio.gather(*(w.kill() for w in workers), return_exceptions=True)
        if self.judge is not None:
            await self.judge.close()

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]
