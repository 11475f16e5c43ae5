"""Issue 24 item 2 through `launcher run --allocation sglang.…`: the real SGLang (server.python = the
conformance environment, 0.5.23) is started by the launcher with its keys only in a 0600 `--config`
file in the run directory; its command line, which `ps` shows every local user, holds neither key.

This machine has no GPU (and the conformance environment no torchvision), so the server exits after
SGLang's parser has read its arguments and the run fails; what is checked is what any local user
could read while it ran. tests/conformance checks that SGLang's parser takes the keys from the file.
The launcher refuses SGLang on a machine whose nvidia-smi lists no GPU (issue 40): a stand-in
`nvidia-smi` on PATH lists two (the launcher reads only its `--query-gpu=index,memory.total` lines).
"""

import json
import os
import stat
import threading
from pathlib import Path

import pytest
import yaml
from conftest import launcher_cli

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PY = os.environ.get("AREAL_LIKE_SGLANG_CONFORMANCE_PYTHON", str(ROOT / ".venv-sglang-conformance" / "bin" / "python"))


def _sglang_cmdlines(seen: dict[int, str], stop: threading.Event, learners: dict[int, dict] | None = None,
                     server_envs: dict[int, dict] | None = None) -> None:
    """What `ps` shows: every sglang.launch_server command line, read from /proc while the run lasts (and
    into `learners` each learner process's environment, into `server_envs` each server's)."""
    learners = {} if learners is None else learners
    server_envs = {} if server_envs is None else server_envs
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) not in seen:
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if "sglang.launch_server" in cmd:
                    seen[int(pid)] = cmd.replace("\0", " ")
                    try:  # its PYTHONPATH (the delta loader's package root), read once and never from an empty read
                        env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
                    except OSError:
                        env = []
                    env_vars = dict(kv.split("=", 1) for kv in env if "=" in kv)
                    if env_vars:
                        server_envs[int(pid)] = env_vars
                elif "areal_like.learner.main" in cmd and int(pid) not in learners:
                    # learner rank 0 (this run has one rank): its environment, read once. A process that exits
                    # between the two reads shows an empty environ (its memory is gone, no error): not recorded
                    # then, it would read as a learner without RANK (failed one CI run).
                    try:
                        env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
                    except OSError:
                        continue
                    env_vars = dict(kv.split("=", 1) for kv in env if "=" in kv)
                    if env_vars:
                        learners[int(pid)] = {"cmd": cmd.replace("\0", " "), **env_vars}
        stop.wait(0.02)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sglang_servers_get_their_keys_from_a_0600_file_not_argv(tmp_path, demo_assets, lora):
    """With `model.lora_rank` (issue 28) the same run also starts SGLang with runtime LoRA flags, which
    SGLang's parser takes (its LoRA checks, which run after the model config loads, run in
    tests/conformance: this server stops at its torchvision import first).

    The full-weights run also has a judge and a teacher pool served by SGLang (issue 43 items 3 and 4,
    `sglang[judge]:d1`, `sglang[teacher]:d1`): real SGLang servers of their own model_path (here the demo model
    under another directory name), on their plan devices, with the keys in a 0600 --config file of their own
    and nothing of a policy server's: no weight-update flags, no LoRA, no delta loader (`_check_aux_servers`)."""
    if not os.path.exists(PY):
        pytest.fail(f"no SGLang conformance environment at {PY}: run scripts/setup.sh")
    model, data = demo_assets
    run_dir = tmp_path / "run"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text("#!/bin/sh\n" + "".join(f"echo '{i}, 81559'\n" for i in range(4)))
    (bindir / "nvidia-smi").chmod(0o755)
    env = {"PATH": os.pathsep.join([str(bindir), os.environ.get("PATH", "")])}
    aux_model = tmp_path / "aux_model"  # its own path, so its command lines are told apart from the policy's
    aux_model.symlink_to(model, target_is_directory=True)
    allocation = "sglang.d1p1t1+d1p1t1" if lora else "sglang[rollout]:d1+fsdp[actor]:d1+sglang[judge]:d1+sglang[teacher]:d1"
    aux = [] if lora else [f"judge.model_path={aux_model}", f"teacher.model_path={aux_model}", "judge.max_context_len=96"]
    seen: dict[int, str] = {}
    stop = threading.Event()
    learners: dict[int, dict] = {}
    server_envs: dict[int, dict] = {}
    watcher = threading.Thread(target=_sglang_cmdlines, args=(seen, stop, learners, server_envs), daemon=True)
    watcher.start()
    try:
        rc, out = launcher_cli("run", "--config", "configs/demo.yaml", "--allocation", allocation, *aux,
                               "--run-dir", str(run_dir), f"model.path={model}", f"data.train_files=[{data}]",
                               f"server.python={PY}", "server.api_key=user-key-0123456789", "train.total_steps=1",
                               "metrics.prometheus=false",
                               # the learner's environment is read from /proc: a process of its own (a role
                               # forked by launcher.forkserver shows the fork server's /proc/<pid>/environ)
                               "launcher.forkserver=false",
                               # full weights: delta sync (issue 42), SGLang's --custom-weight-loader
                               *(["model.lora_rank=8", "model.target_modules=[q_proj,v_proj,lm_head]"] if lora
                                 else ["weights.sync=delta"]),
                               env=env, timeout=600)
    finally:
        stop.set()
        watcher.join()
    admin = json.loads((run_dir / "config.json").read_text())["server"]["admin_api_key"]
    assert admin and admin != "***"
    mine = {pid: cmd for pid, cmd in seen.items() if f"--model-path {model} " in cmd}
    assert mine, f"no sglang.launch_server process of this run was seen (rc {rc}): {out[-2000:]}"
    secrets = run_dir / "sglang-secrets.yaml"
    for cmd in mine.values():
        assert f"--config {secrets}" in cmd, cmd
        assert admin not in cmd and "user-key-0123456789" not in cmd and "api-key" not in cmd, cmd
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    # issue 40 item 1: rank 0 sends the weights over NCCL with TORCH_NCCL_ASYNC_ERROR_HANDLING=2, so a failed
    # broadcast raises (and the group is re-formed) instead of the watchdog tearing the learner down
    mine_learners = [e for e in learners.values() if f"--run-dir {run_dir} " in e["cmd"] and e.get("RANK") == "0"]
    assert mine_learners, "learner rank 0 was not seen"
    assert all(e.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "2" for e in mine_learners), mine_learners
    assert yaml.safe_load(secrets.read_text()) == {"api-key": "user-key-0123456789", "admin-api-key": admin}
    # SGLang's own parser took the argv (a refused flag exits 2 with "unrecognized arguments")
    log = (run_dir / "logs" / "server0.log").read_text(errors="replace")
    assert "unrecognized arguments" not in log and "error: argument" not in log, log[-2000:]
    assert admin not in out and "user-key-0123456789" not in out
    for cmd in mine.values():
        lora_argv = ("--enable-lora --max-lora-rank 8 --lora-target-modules q_proj v_proj lm_head "
                     "--max-loras-per-batch 2 --max-loaded-loras 2")
        assert (lora_argv in cmd) == lora, cmd
        # weights.sync=delta: SGLang applies deltas with the project's loader, imported from the package root
        assert ("--custom-weight-loader areal_like.weights.sglang_delta.load_delta" in cmd) == (not lora), cmd
    if not lora:
        envs = [server_envs[pid] for pid in mine if pid in server_envs]
        loader_dir = run_dir / "sglang_pythonpath"  # the package alone, linked: SGLang imports the loader from it
        assert sorted(p.name for p in loader_dir.iterdir()) == ["areal_like"]
        assert (loader_dir / "areal_like").resolve() == ROOT / "areal_like"
        assert envs and all(e.get("PYTHONPATH", "").split(os.pathsep)[0] == str(loader_dir) for e in envs), envs
        _check_aux_servers(run_dir, seen, aux_model, out)


def _check_aux_servers(run_dir, seen: dict[int, str], aux_model, out: str) -> None:
    """The judge's and the teacher's SGLang servers of the run (`sglang[judge]:d1`, `sglang[teacher]:d1`)."""
    mine = [cmd for cmd in seen.values() if f"--model-path {aux_model} " in cmd]
    assert len(mine) == 2, (seen, out[-2000:])
    by_role = {("judge" if "sglang-secrets-judge.yaml" in cmd else "teacher"): cmd for cmd in mine}
    assert set(by_role) == {"judge", "teacher"}, mine
    for role, cmd in by_role.items():
        secrets = run_dir / f"sglang-secrets-{role}.yaml"
        assert f"--config {secrets}" in cmd and "user-key-0123456789" not in cmd, cmd
        assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
        assert yaml.safe_load(secrets.read_text()) == {"api-key": "user-key-0123456789"}  # no admin key: never updated
        for flag in ("--custom-weight-loader", "--enable-lora", "--enable-memory-saver", "--dtype"):
            assert flag not in cmd, (role, cmd)
        log = (run_dir / "logs" / f"{role}0.log").read_text(errors="replace")
        assert "unrecognized arguments" not in log and "error: argument" not in log, log[-2000:]
    # the plan's devices (rollout 0, actor 1, judge 2, teacher 3) and each one's context length
    assert "--base-gpu-id 2" in by_role["judge"] and "--context-length 96 " in by_role["judge"] + " "
    assert "--base-gpu-id 3" in by_role["teacher"] and "--context-length 96 " not in by_role["teacher"] + " "


