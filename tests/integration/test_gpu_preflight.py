"""Issue 40 items 5 and 9 through `launcher run`: what a GPU run needs of the machine, refused before the
run directory is created or any process starts.

- The local backend places the whole allocation on this machine: `sglang.d16p1m1+d8p2m1` (32 GPUs) on
  an 8-GPU machine is refused naming `--backend ray`; SGLang (or the embedded engine on cuda) on a machine
  without a GPU is refused (it used to start the servers and fail a minute later on an import error).
- The learner and the SGLang servers must run one torch release (one NCCL weight group, CUDA-IPC
  pickles): a server.python with another torch is refused naming both versions.

This machine has no GPU. Where a test needs GPUs to be listed, a stand-in `nvidia-smi` on PATH prints
the lines the real one prints for `--query-gpu=index,memory.total --format=csv,noheader,nounits`: the
launcher asks nothing else of it, and no process is started on those GPUs (the run is refused first).
"""

import os
import stat
import sys
from pathlib import Path

import pytest
from conftest import launcher_cli

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PY = os.environ.get("AREAL_LIKE_SGLANG_CONFORMANCE_PYTHON",
                           str(ROOT / ".venv-sglang-conformance" / "bin" / "python"))


def _gpus_on_path(tmp_path: Path, n: int) -> dict[str, str]:
    """An environment whose PATH has an `nvidia-smi` listing `n` 80 GB GPUs (n=0: a PATH without one)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    if n:
        smi = bindir / "nvidia-smi"
        smi.write_text("#!/bin/sh\n" + "".join(f"echo '{i}, 81559'\n" for i in range(n)))
        smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    # the venv's own bin (python, launcher) and the system's, minus any real nvidia-smi
    path = [str(bindir), os.path.dirname(sys.executable), "/usr/bin", "/bin"]
    return {"PATH": os.pathsep.join(path)}


def _run(tmp_path, demo_assets, allocation, *overrides, gpus: int):
    model, data = demo_assets
    run_dir = tmp_path / "run"
    env = _gpus_on_path(tmp_path, gpus)
    rc, out = launcher_cli("run", "--config", "configs/demo.yaml", "--allocation", allocation, "--run-dir",
                           str(run_dir), f"model.path={model}", f"data.train_files=[{data}]", *overrides, env=env,
                           timeout=300)
    return rc, out, run_dir


def _need_sglang_env():
    if not os.path.exists(SGLANG_PY):
        pytest.fail(f"no SGLang conformance environment at {SGLANG_PY}: run scripts/setup.sh")


def test_multi_node_allocation_on_the_local_backend_is_refused_naming_ray(tmp_path, demo_assets):
    _need_sglang_env()
    rc, out, run_dir = _run(tmp_path, demo_assets, "sglang.d16p1m1+d8p2m1", f"server.python={SGLANG_PY}", gpus=8)
    assert rc == 2, out[-3000:]
    assert "needs 32 GPUs" in out and "which has 8" in out and "--backend ray" in out, out[-3000:]
    assert "Traceback" not in out
    assert not run_dir.exists()  # nothing written, nothing started


def test_sglang_on_a_machine_without_gpus_is_refused(tmp_path, demo_assets):
    _need_sglang_env()
    rc, out, run_dir = _run(tmp_path, demo_assets, "sglang.d1p1t1+d1p1t1", f"server.python={SGLANG_PY}", gpus=0)
    assert rc == 2, out[-3000:]
    assert "this machine has none" in out and "embedded" in out, out[-3000:]
    assert not run_dir.exists()


def test_embedded_engine_on_cuda_without_gpus_is_refused(tmp_path, demo_assets):
    rc, out, run_dir = _run(tmp_path, demo_assets, "embedded.d1p1t1+d1p1t1", "server.device=cuda", gpus=0)
    assert rc == 2, out[-3000:]
    assert "server.device=cuda" in out and "set server.device=cpu" in out, out[-3000:]
    assert not run_dir.exists()


def test_servers_with_another_torch_release_are_refused_naming_both(tmp_path, demo_assets):
    """server.python = the SGLang conformance environment with a torch 2.14.1 distribution in front of its
    own (what sglang 0.5.23 pins), reported through the same package metadata the real one has."""
    _need_sglang_env()
    site = tmp_path / "site"
    dist = site / "torch-2.14.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.14.1\n")
    wrapper = tmp_path / "sglang-python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {SGLANG_PY} \"$@\"\n")
    wrapper.chmod(0o755)
    rc, out, run_dir = _run(tmp_path, demo_assets, "sglang.d1p1t1+d1p1t1", f"server.python={wrapper}", gpus=2)
    assert rc == 2, out[-3000:]
    from importlib.metadata import version

    assert f"torch {version('torch')}" in out and "torch 2.14.1" in out, out[-3000:]
    assert "scripts/setup.sh --sglang" in out
    assert not run_dir.exists()


def test_a_gpu_run_gets_gpu_defaults_and_is_told_of_cpu_demo_values(tmp_path, demo_assets):
    """Item 6: without a config file, `launcher run` of SGLang servers used to train in fp32 at the CPU
    demo's lr 1e-3 with 8 new tokens and a 256-token prompt limit. The keys left at those defaults get
    verl's values, printed at start; the values a user sets stay, and those that only make sense on CPU
    are named. (This run is then refused for its 32 GPUs: the lines come before anything starts.)"""
    _need_sglang_env()
    model, data = demo_assets
    env = _gpus_on_path(tmp_path, 8)
    rc, out = launcher_cli("run", "--allocation", "sglang.d16p1m1+d8p2m1", "--run-dir", str(tmp_path / "run"),
                           f"model.path={model}", f"data.train_files=[{data}]", f"server.python={SGLANG_PY}",
                           "generation.max_new_tokens=16", env=env, timeout=300)
    assert rc == 2 and "--backend ray" in out, out[-3000:]
    assert "GPU run default: model.dtype: float32 → bfloat16" in out
    assert "GPU run default: train.lr: 0.001 → 1e-06" in out
    assert "GPU run default: data.max_prompt_length: 256 → 512" in out
    assert "generation.max_new_tokens" not in out.split("GPU run default")[-1].split("\n")[0]  # set: kept
    warn = "warning, a CPU-demo value in a GPU run: "
    assert f"{warn}generation.max_new_tokens=16" in out
    assert f"{warn}train.batch_size × generation.n = 32 samples per step for 16 SGLang server(s)" in out
    assert f"{warn}rollout.workers=1 drives 16 servers" in out
    assert f"{warn}model.dtype" not in out  # bfloat16 now


def test_colocated_cuda_under_ray_is_refused_naming_the_combination(tmp_path, demo_assets):
    """Item 2: Ray reserves every role's GPU for it alone, so a co-located server and learner rank asked
    twice for one GPU (the placement group never became ready). `launcher run --backend ray` and `launcher
    sbatch` (whose script runs it) refuse the combination before Ray is started, naming both ways out."""
    _need_sglang_env()
    rc, out, run_dir = _run(tmp_path, demo_assets, "sglang:d1|fsdp:d1", f"server.python={SGLANG_PY}",
                            "launcher.backend=ray", gpus=0)
    assert rc == 2, out[-3000:]
    assert "co-locates generation and training" in out and "drop --backend ray" in out, out[-3000:]
    assert "'sglang:d1+fsdp:d1'" in out
    assert not run_dir.exists()
    rc, out = launcher_cli("sbatch", "--allocation", "sglang:d8|fsdp:d8", "--nodes", "1", "--devices-per-node", "8",
                           "--config", "configs/demo.yaml", timeout=120)
    assert rc == 2 and "co-locates generation and training" in out, out[-3000:]
