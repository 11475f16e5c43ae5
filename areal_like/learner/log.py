"""The learner's log line: one prefix for every part of the loop (rank 0's collaborators and main.py)."""


def log(msg: str) -> None:
    print(f"[learner] {msg}", flush=True)
