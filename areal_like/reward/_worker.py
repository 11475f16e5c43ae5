"""Reward worker process; scores requests read from stdin.

    python _worker.py PATH NAME               a user's function: NAME in the file PATH
    python _worker.py --builtin FORMAT_SCORE  the built-ins: areal_like.reward.builtin.default_compute_score
                                              with format_score=FORMAT_SCORE (reward.format_score)

Frames both ways: 4-byte little-endian length + msgpack (no pickle crosses the process boundary).
Request  [data_source, solution_str, ground_truth, extra_info(, question: in a run with a judge)]
         (a user's function with a `judge` parameter gets `judge=JudgeClient(question)` as well:
          judge_client.py, the run's judge servers from $AREAL_LIKE_JUDGE_CLIENT)
Reply    {"ok": true, "score": float}
       | {"ok": false, "kind": "exception" | "non_finite" | "not_a_number", "error": "<message or traceback>"}
         (exception: the function raised — "error" is its traceback, this file's frame left out;
          the other kinds: what it returned could not be used as a score — see custom.to_score)
First frame sent is a hello: {"ok": true, "ready": true} or {"ok": false, "error": ...} if loading failed.

A user's function: this file imports nothing of areal_like so it starts fast and from any directory
(custom.py is loaded by file location). The built-ins import `areal_like.reward.builtin` (the parent
puts the package root on PYTHONPATH; areal_like.reward's __init__ is lazy, so fn.py's imports are not
paid here) and math-verify, before the hello. Timeouts are the parent's job: it kills this process.
"""

import os
import sys
import traceback

# `python _worker.py` puts this folder first on sys.path, where code.py, qa.py, … would shadow the
# stdlib's and third-party modules of the same name (stdlib `code`, for one) for every import below
# and for the user's function.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:
    del sys.path[0]


def _by_location(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_areal_like_reward_{name}", os.path.join(_HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _judge_factory(fn, label: str):
    """None, or `question → JudgeClient | None` for a function with a `judge` parameter (judge_client.py)."""
    import inspect

    try:
        param = inspect.signature(fn).parameters.get("judge")
    except (TypeError, ValueError):
        return None
    if param is None:
        return None
    jc = _by_location("judge_client")
    if not os.environ.get(jc.JUDGE_CLIENT_ENV) and param.default is inspect.Parameter.empty:
        raise TypeError(f"{label} takes a `judge` argument but the run has no judge: add a judge component to the "
                        f"allocation (e.g. +embedded[judge]:d1) with judge.model_path, or give the parameter a "
                        f"default (judge=None)")
    return jc.JudgeClient.from_env


def _load(argv: list[str]):
    """The scoring function, to_score and the judge factory (`_judge_factory`); raises what the parent
    reports as a load failure."""
    custom = _by_location("custom")
    if argv[0] == "--builtin":
        import functools

        from areal_like.reward.builtin import default_compute_score
        from areal_like.reward.math_score import load_math_verify

        load_math_verify()  # sympy's ~0.6 s import here, not inside the first math call's timeout
        return functools.partial(default_compute_score, format_score=float(argv[1])), custom.to_score, None
    fn = custom.load_custom_reward(argv[0], argv[1])
    return fn, custom.to_score, _judge_factory(fn, f"custom_reward_function {argv[0]}:{argv[1]}")


def main() -> None:
    # The launcher stops a rollout worker by SIGTERM to its process group, which holds these workers: they
    # leave their ending to the rollout worker (RewardFn.close kills them as it exits; a call it cancels
    # kills its worker), so a call under way at a stop is dropped with its group instead of counted as a
    # worker that died while scoring. The launcher's SIGKILL of the group still ends a stuck one.
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # the user's print() goes to stderr, never into the reply stream
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer

    import msgspec

    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()

    def send(obj) -> None:
        data = enc.encode(obj)
        out.write(len(data).to_bytes(4, "little") + data)

    try:
        fn, to_score, judge_for = _load(sys.argv[1:3])
    except Exception as e:  # reported to the parent, which raises it with the path and name
        send({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return
    send({"ok": True, "ready": True})
    while True:
        head = inp.read(4)
        if len(head) < 4:
            return  # parent closed stdin: exit quietly
        req = dec.decode(inp.read(int.from_bytes(head, "little")))
        try:
            if judge_for is None:
                value = fn(req[0], req[1], req[2], req[3])
            else:
                judge = judge_for(req[4] if len(req) > 4 else "")
                value = fn(req[0], req[1], req[2], req[3], **({"judge": judge} if judge is not None else {}))
        except Exception as e:
            send({"ok": False, "kind": "exception", "error": _traceback(e)})
            continue
        try:
            score = to_score(value)
        except Exception as e:  # custom.ScoreError: .kind names it
            send({"ok": False, "kind": getattr(e, "kind", "not_a_number"), "error": f"{type(e).__name__}: {e}"})
            continue
        send({"ok": True, "score": score})


def _traceback(e: BaseException, max_chars: int = 6000) -> str:
    """The function's traceback, without this file's frame (the call into it)."""
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
    text = "".join(traceback.format_exception(type(e), e, tb)).rstrip()
    return text if len(text) <= max_chars else "…" + text[-max_chars:]


if __name__ == "__main__":
    main()
