"""Reward worker process: `python _worker.py PATH NAME`; scores requests read from stdin.

Frames both ways: 4-byte little-endian length + msgpack (no pickle crosses the process boundary).
Request  [data_source, solution_str, ground_truth, extra_info]
Reply    {"ok": true, "score": float}
       | {"ok": false, "kind": "exception" | "non_finite" | "not_a_number", "error": "<message or traceback>"}
         (exception: the user's function raised — "error" is its traceback, this file's frame left out;
          the other kinds: what it returned could not be used as a score — see custom.to_score)
First frame sent is a hello: {"ok": true, "ready": true} or {"ok": false, "error": ...} if loading failed.

This file imports nothing of areal_like at module level so it starts fast and from any directory.
"""

import os
import sys
import traceback


def main() -> None:
    path, name = sys.argv[1], sys.argv[2]
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # the user's print() goes to stderr, never into the reply stream
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer

    import msgspec

    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()

    def send(obj) -> None:
        data = enc.encode(obj)
        out.write(len(data).to_bytes(4, "little") + data)

    # custom.py by file location: importing the areal_like package here would pull in torch-free but
    # heavier modules (metrics, builtins) and slow every worker start.
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_areal_like_reward_custom", os.path.join(os.path.dirname(os.path.abspath(__file__)), "custom.py"))
    custom = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(custom)
    load_custom_reward, to_score = custom.load_custom_reward, custom.to_score

    try:
        fn = load_custom_reward(path, name)
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
            value = fn(req[0], req[1], req[2], req[3])
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
    """The user's traceback, without this file's frame (the call into the user's function)."""
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
    text = "".join(traceback.format_exception(type(e), e, tb)).rstrip()
    return text if len(text) <= max_chars else "…" + text[-max_chars:]


if __name__ == "__main__":
    main()
