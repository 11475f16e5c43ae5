"""SGLang launch commands built from multi-node plans: argument construction only, nothing starts."""

import asyncio
import re
import sys

import pytest

from allocation import place
from areal_like.engine.sglang_args import (
    SUPPORTED_SGLANG,
    TRAINER_WEIGHT_GROUP_ENV,
    SGLangArgsError,
    SGLangNotInstalled,
    build_sglang_servers,
    processes_on_node,
    redact_argv,
    require_sglang,
    sglang_server_flags,
    sglang_version_supported,
    weight_update_group_layout,
)

HOSTS = [f"node{i}" for i in range(8)]


def flag(argv, name):
    """Value of `name` in argv (None when absent); asserts it appears at most once."""
    idx = [i for i, a in enumerate(argv) if a == name]
    assert len(idx) <= 1, f"{name} repeated in {argv}"
    return argv[idx[0] + 1] if idx else None


def build(alloc, nodes, g=8, **kw):
    plan = place(alloc, nodes, g)
    n = len(plan.servers)
    kw.setdefault("ports", [30000 + k for k in range(n)])
    kw.setdefault("seeds", 7)
    kw.setdefault("model_path", "/models/qwen")
    if plan.nodes > 1:
        kw.setdefault("node_hosts", HOSTS[: plan.nodes])
    return build_sglang_servers(plan, **kw)


def test_single_node_command_matches_protocol():
    (s,) = build("sglang:d1+fsdp:d1", None, python="py")
    (p,) = s.processes
    assert p.argv[:3] == ("py", "-m", "sglang.launch_server")
    assert list(p.argv[3:]) == [
        "--model-path", "/models/qwen", "--host", "127.0.0.1", "--port", "30000", "--tp-size", "1",
        "--pp-size", "1", "--dp-size", "1", "--random-seed", "7", "--weight-version", "0",
        "--skip-server-warmup", "--enable-metrics", "--base-gpu-id", "0",
    ]
    assert s.url == "http://127.0.0.1:30000" and s.node == 0 and s.devices == 1
    # /health must answer while paused for a weight update (SGLang's generates a token otherwise)
    assert p.env == {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0",
                     "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
    assert "CUDA_VISIBLE_DEVICES" not in p.env  # devices are chosen by --base-gpu-id
    assert TRAINER_WEIGHT_GROUP_ENV["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def test_legacy_d16_on_four_nodes_of_eight():
    servers = build("sglang.d16p1m1+d8p2m1", 4)
    assert len(servers) == 16
    assert [s.node for s in servers] == [0] * 8 + [1] * 8
    assert [int(flag(s.processes[0].argv, "--base-gpu-id")) for s in servers] == list(range(8)) * 2
    assert all(s.nnodes == 1 and flag(s.processes[0].argv, "--nnodes") is None for s in servers)
    assert all(flag(s.processes[0].argv, "--tp-size") == "1" for s in servers)
    assert [s.url for s in servers[7:9]] == ["http://node0:30007", "http://node1:30008"]
    assert [flag(s.processes[0].argv, "--host") for s in servers[7:9]] == ["node0", "node1"]
    seeds = [int(flag(s.processes[0].argv, "--random-seed")) for s in servers]
    assert seeds == list(range(7, 23))  # distinct per server


def test_tp8_servers_fill_one_node_each():
    servers = build("sglang:d2t8+fsdp:d8", 3)
    assert [(s.node, s.devices) for s in servers] == [(0, 8), (1, 8)]
    for s in servers:
        argv = s.processes[0].argv
        assert flag(argv, "--tp-size") == "8" and flag(argv, "--base-gpu-id") == "0"
        assert flag(argv, "--dp-size") == "1" and flag(argv, "--dist-init-addr") is None
    assert weight_update_group_layout(servers) == [("http://node0:30000", 1, 17), ("http://node1:30001", 9, 17)]


def test_server_spanning_two_nodes():
    (s,) = build("sglang:d1t16+fsdp:d8", 3, dist_init_ports=[29600])
    assert s.nnodes == 2 and s.url == "http://node0:30000"
    head, tail = s.processes
    assert (head.node, head.node_rank, tail.node, tail.node_rank) == (0, 0, 1, 1)
    for p, rank in ((head, "0"), (tail, "1")):
        assert flag(p.argv, "--tp-size") == "16"
        assert flag(p.argv, "--nnodes") == "2" and flag(p.argv, "--node-rank") == rank
        assert flag(p.argv, "--dist-init-addr") == "node0:29600"  # rank 0's node, on both
        assert flag(p.argv, "--base-gpu-id") == "0"
    assert (flag(head.argv, "--host"), flag(tail.argv, "--host")) == ("node0", "node1")  # each binds its own node
    assert weight_update_group_layout([s]) == [("http://node0:30000", 1, 17)]


def test_processes_per_node_for_one_launcher_per_node():
    servers = build("sglang:d2t16+fsdp:d8", 5, dist_init_ports=[29600, 29700])
    assert [[(s.index, p.node_rank) for s, p in processes_on_node(servers, n)] for n in range(5)] == [
        [(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)], []]
    assert flag(processes_on_node(servers, 3)[0][1].argv, "--dist-init-addr") == "node2:29700"


def test_spanning_server_needs_dist_init_port_and_even_split():
    with pytest.raises(SGLangArgsError, match="dist_init_ports"):
        build("sglang:d1t16+fsdp:d8", 3)
    with pytest.raises(SGLangArgsError, match=r"unevenly \(8\+4\).*multiple of 8"):
        build("sglang:d1t12+fsdp:d8", 3, dist_init_ports=[29600])


def test_rank_offsets_with_mixed_nodes():
    servers = build("sglang:d4t4+fsdp:d8", 3)
    assert [(s.node, flag(s.processes[0].argv, "--base-gpu-id")) for s in servers] == [
        (0, "0"), (0, "4"), (1, "0"), (1, "4")]
    assert [(off, world) for _, off, world in weight_update_group_layout(servers)] == [
        (1, 17), (5, 17), (9, 17), (13, 17)]


def test_layout_agrees_with_weight_pusher(monkeypatch):
    """WeightPusher computes the offsets itself: both must send the same numbers."""
    from areal_like.weights import push

    servers = build("sglang:d3t2+fsdp:d2", None)
    sent = {}

    async def fake_post(self, url, path, body, **kw):
        sent[url] = (body["rank_offset"], body["world_size"])
        return {"success": True}

    monkeypatch.setattr(push.WeightPusher, "_post", fake_post)
    monkeypatch.setattr(push, "init_weight_group", lambda **kw: object())
    pusher = push.WeightPusher([s.url for s in servers], master_port=1, devices_per_server=[s.devices for s in servers])

    async def run():
        try:
            await pusher.init()
        finally:
            await pusher._session.close()

    asyncio.run(run())
    assert [(u, *sent[u]) for u in pusher.server_urls] == weight_update_group_layout(servers)
    assert weight_update_group_layout(servers)[-1][1:] == (5, 7)


def test_keys_metrics_memory_and_extra_args(tmp_path):
    secrets = str(tmp_path / "sglang-secrets.yaml")
    (s,) = build("sglang:d1+fsdp:d1", None, api_key="u-key", admin_api_key="a-key", enable_metrics=False,
                 mem_fraction_static=0.7, extra_args=["--context-length", "4096"], secrets_file=secrets)
    argv = s.processes[0].argv
    assert flag(argv, "--config") == secrets
    assert "--enable-metrics" not in argv and flag(argv, "--mem-fraction-static") == "0.7"
    assert argv[-2:] == ("--context-length", "4096")
    assert redact_argv(["x", "--api-key", "k"]) == ["x", "--api-key", "***"]
    assert redact_argv(["x", "--admin-api-key"]) == ["x", "--admin-api-key"]  # no value to hide
    (s,) = build("sglang:d1+fsdp:d1", None)
    assert flag(s.processes[0].argv, "--api-key") is None and flag(s.processes[0].argv, "--admin-api-key") is None


def test_keys_go_to_a_0600_config_file_not_argv(tmp_path):
    """Issue 24 item 2: `ps` (/proc/<pid>/cmdline) shows argv to every local user, so neither key may be
    in it; they go into the --config YAML file, mode 0600, keyed by SGLang's flag names."""
    import os
    import stat

    import yaml

    secrets = str(tmp_path / "sglang-secrets.yaml")
    (s,) = build("sglang:d1+fsdp:d1", None, api_key="u-key-123", admin_api_key="0123", secrets_file=secrets)
    (p,) = s.processes
    joined = " ".join(p.argv)
    assert "u-key-123" not in joined and "0123" not in joined, joined
    assert "--api-key" not in p.argv and "--admin-api-key" not in p.argv
    assert flag(p.argv, "--config") == secrets and "u-key-123" not in repr(p)
    p.write_secrets()
    assert stat.S_IMODE(os.stat(secrets).st_mode) == 0o600
    # YAML reads back the same strings ("0123" stays text, not the number 83 or 123)
    assert yaml.safe_load(open(secrets)) == {"api-key": "u-key-123", "admin-api-key": "0123"}
    os.chmod(secrets, 0o644)  # a re-run: an existing file is truncated and made 0600 again
    (s,) = build("sglang:d1+fsdp:d1", None, admin_api_key="other", secrets_file=secrets)
    s.processes[0].write_secrets()
    assert stat.S_IMODE(os.stat(secrets).st_mode) == 0o600
    assert yaml.safe_load(open(secrets)) == {"admin-api-key": "other"}
    (s,) = build("sglang:d1+fsdp:d1", None)  # no key: no file, no --config
    assert flag(s.processes[0].argv, "--config") is None and s.processes[0].secrets_file is None


def test_keys_with_a_user_config_or_key_flag_are_refused(tmp_path):
    secrets = str(tmp_path / "s.yaml")
    with pytest.raises(SGLangArgsError, match=r"already have --config mine.yaml.*server.admin_api_key"):
        build("sglang:d1+fsdp:d1", None, admin_api_key="k", secrets_file=secrets, extra_args=["--config", "mine.yaml"])
    with pytest.raises(SGLangArgsError, match=r"--api-key: keys never go on the command line.*server.api_key"):
        build("sglang:d1+fsdp:d1", None, api_key="k", secrets_file=secrets, extra_args=["--api-key=k2"])
    with pytest.raises(SGLangArgsError, match="server.admin_api_key starts with '-'"):
        build("sglang:d1+fsdp:d1", None, admin_api_key="-abc", secrets_file=secrets)
    with pytest.raises(SGLangArgsError, match="no secrets_file"):
        build("sglang:d1+fsdp:d1", None, api_key="k")
    with pytest.raises(SGLangArgsError, match="no --config"):
        build("sglang:d1+fsdp:d1", None, api_key="k", secrets_file=secrets,
              supported_flags={"--model-path", "--api-key", "--admin-api-key"})
    # without a key, the user's own --config passes through untouched
    (s,) = build("sglang:d1+fsdp:d1", None, extra_args=["--config", "mine.yaml"])
    assert flag(s.processes[0].argv, "--config") == "mine.yaml"


def test_explicit_seeds_must_differ():
    servers = build("sglang:d2+fsdp:d1", None, seeds=[11, 5])
    assert [s.seed for s in servers] == [11, 5]
    with pytest.raises(SGLangArgsError, match="differ"):
        build("sglang:d2+fsdp:d1", None, seeds=[3, 3])
    with pytest.raises(SGLangArgsError, match="one per server"):
        build("sglang:d2+fsdp:d1", None, seeds=[3])


def test_pipeline_parallel_needs_disk_updates():
    with pytest.raises(SGLangArgsError, match="pp>1.*sglang:d2t4"):
        build("sglang:d2p2t2+fsdp:d8", None)
    servers = build("sglang:d2p2t2+fsdp:d8", None, weight_update="disk")
    assert [flag(s.processes[0].argv, "--pp-size") for s in servers] == ["2", "2"]
    assert [flag(s.processes[0].argv, "--base-gpu-id") for s in servers] == ["0", "4"]


def test_plan_errors_name_the_fix():
    with pytest.raises(SGLangArgsError, match="node_hosts"):
        build_sglang_servers(place("sglang:d2t8+fsdp:d8", 3, 8), model_path="m", ports=[1, 2], seeds=0)
    with pytest.raises(SGLangArgsError, match="both use port 30000 on node 0"):
        build("sglang:d2+fsdp:d1", None, ports=[30000, 30000])
    build("sglang:d2t8+fsdp:d8", 3, ports=[30000, 30000])  # same port on different nodes is fine
    with pytest.raises(SGLangArgsError, match="not 'sglang'"):
        build("embedded:d1+fsdp:d1", None)
    with pytest.raises(SGLangArgsError, match="no generation part"):
        build_sglang_servers(place("fsdp:d2"), model_path="m", ports=[], seeds=0)


def test_release_differences_by_supported_flags():
    old = {"--model-path", "--host", "--port", "--tp-size", "--api-key"}  # a 0.4.x-like release
    (s,) = build("sglang:d1+fsdp:d1", None, supported_flags=old)
    assert "--weight-version" not in s.processes[0].argv
    with pytest.raises(SGLangArgsError, match="--admin-api-key"):
        build("sglang:d1+fsdp:d1", None, supported_flags=old, admin_api_key="k")


def test_fp32_lm_head_is_sglangs_flag_or_refused():
    (s,) = build("sglang:d1+fsdp:d1", None, fp32_lm_head=True)
    assert "--enable-fp32-lm-head" in s.processes[0].argv
    (s,) = build("sglang:d1+fsdp:d1", None)
    assert "--enable-fp32-lm-head" not in s.processes[0].argv
    old = {"--model-path", "--host", "--port", "--tp-size", "--dtype"}  # a release without the flag
    with pytest.raises(SGLangArgsError, match="model.fp32_lm_head"):
        build("sglang:d1+fsdp:d1", None, supported_flags=old, fp32_lm_head=True)


def test_require_sglang_names_the_key_and_the_setup(tmp_path):
    """This interpreter has no sglang (the launcher never needs it): the error names server.python and
    how to build SGLang's own environment."""
    with pytest.raises(SGLangNotInstalled, match=r"server\.python = .*cannot import.*setup\.sh --sglang"):
        require_sglang(None)
    with pytest.raises(SGLangNotInstalled, match=r"server\.python = '/nonexistent/python' does not exist"):
        require_sglang("/nonexistent/python")


def _fake_sglang(tmp_path, version: str, msgspec_server_args: bool = True) -> str:
    """A python that imports a stand-in sglang of `version` (pure logic of the version/flag checks;
    the conformance suite runs the real one): ServerArgs is a msgspec Struct, as from 0.5.21."""
    pkg = tmp_path / "site" / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "srt" / "__init__.py").write_text("")
    (pkg / "srt" / "server_args.py").write_text(
        "import msgspec\n"
        "class ServerArgs(msgspec.Struct):\n"
        "    model_path: str = ''\n"
        "    tp_size: int = 1\n"
        "    @staticmethod\n"
        "    def add_cli_args(parser):\n"
        "        parser.add_argument('--model-path', '--model', type=str)\n"
        "        parser.add_argument('--tp-size', '--tp', type=int)\n"
        "        parser.add_argument('--weight-version', type=str)\n")
    dist = tmp_path / "site" / f"sglang-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    return str(py)


def test_flags_come_from_sglangs_own_parser_in_server_python(tmp_path):
    """From 0.5.21 ServerArgs is a msgspec Struct (dataclasses.fields raises TypeError): the flags are
    read from SGLang's argparse parser, aliases included, by the interpreter server.python names."""
    py = _fake_sglang(tmp_path, "0.5.23")
    assert sglang_server_flags(py) == {"--help", "--model-path", "--model", "--tp-size", "--tp", "--weight-version"}
    assert require_sglang(py) == "0.5.23"
    assert "sglang" not in sys.modules  # the launcher's process never imports it


def test_releases_outside_the_supported_range_are_refused(tmp_path):
    lo, hi = SUPPORTED_SGLANG
    for version in ("0.4.10", "0.5.19", "0.5.24", "0.6.0"):
        py = _fake_sglang(tmp_path / version, version)
        with pytest.raises(SGLangNotInstalled, match=rf"sglang {re.escape(version)}, outside the supported range "
                                                     rf"sglang{re.escape(lo)},{re.escape(hi)}"):
            require_sglang(py)
    assert sglang_version_supported("0.5.21") and sglang_version_supported("0.5.23.post1")


def test_pyproject_extra_is_the_supported_range():
    import tomllib
    from pathlib import Path

    extra = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["sglang"]
    assert extra == ["sglang" + ",".join(SUPPORTED_SGLANG)]


def test_transformers_lower_bound_admits_only_releases_the_learner_runs_on():
    """The learner's pipeline stage calls `create_causal_mask(config=, inputs_embeds=, attention_mask=,
    past_key_values=, position_ids=)`: before 5.4 the argument was `input_embeds` and `cache_position`
    was required (4.57–5.3 fail at the first forward), so pyproject.toml must not admit them."""
    import inspect
    import tomllib
    from pathlib import Path

    from transformers.masking_utils import create_causal_mask

    deps = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if d.startswith("transformers")]
    low = re.search(r">=\s*([\d.]+)", spec).group(1)
    assert tuple(int(x) for x in low.split(".")) >= (5, 4), spec
    params = inspect.signature(create_causal_mask).parameters
    assert "inputs_embeds" in params and params.get("cache_position", inspect.Parameter("x", 1, default=None)).default is None


def test_colocated_servers_get_the_memory_saver_and_share_the_learners_devices():
    """Co-located (`sglang:d2t2|fsdp:d4`): the servers run on the learner's devices, with
    --enable-memory-saver when they release memory (colocate.release_memory), refused on a release
    without the flag; the CUDA-IPC handoff is per TP rank, so pipeline-parallel servers are refused."""
    servers = build("sglang:d2t2|fsdp:d4", None, g=4, weight_update="memory", memory_saver=True)
    plan = place("sglang:d2t2|fsdp:d4", None, 4)
    assert [s.devices for s in plan.servers] == [(0, 1), (2, 3)]  # the learner's ranks are on these 4 too
    assert sorted(r.device for c in plan.training for r in c.ranks) == [0, 1, 2, 3]
    assert [flag(s.processes[0].argv, "--base-gpu-id") for s in servers] == ["0", "2"]
    assert all("--enable-memory-saver" in s.processes[0].argv for s in servers)
    (s,) = build("sglang:d1|fsdp:d1", None, weight_update="memory")
    assert "--enable-memory-saver" not in s.processes[0].argv
    with pytest.raises(SGLangArgsError, match="colocate.release_memory=false"):
        build("sglang:d1|fsdp:d1", None, weight_update="memory", memory_saver=True,
              supported_flags={"--model-path", "--host", "--port", "--tp-size"})
    with pytest.raises(SGLangArgsError, match="tensor parallelism"):
        build("sglang:d1p2|fsdp:d2", None, weight_update="memory")


def test_lora_flags_are_sglangs_runtime_lora_and_a_release_without_them_is_refused():
    targets = ("q_proj", "v_proj", "lm_head")
    (s,) = build("sglang:d1t2+fsdp:d2", None, lora_rank=16, lora_targets=targets)
    argv = list(s.processes[0].argv)
    assert "--enable-lora" in argv and flag(argv, "--max-lora-rank") == "16"
    i = argv.index("--lora-target-modules")
    assert argv[i + 1:i + 4] == list(targets) and argv[i + 4] == "--max-loras-per-batch"
    assert flag(argv, "--max-loras-per-batch") == "2" and flag(argv, "--max-loaded-loras") == "2"
    (plain,) = build("sglang:d1t2+fsdp:d2", None)
    assert "--enable-lora" not in plain.processes[0].argv
    old = frozenset({"--model-path", "--port", "--tp-size"})
    with pytest.raises(SGLangArgsError, match="model.lora_rank=16.*--enable-lora"):
        build("sglang:d1+fsdp:d1", None, lora_rank=16, lora_targets=targets, supported_flags=old)
    with pytest.raises(SGLangArgsError, match="lora_targets"):
        build("sglang:d1+fsdp:d1", None, lora_rank=16)


def test_delta_sync_registers_the_projects_loader_importable_from_a_dir_holding_the_package_alone(tmp_path):
    """weights.sync=delta (issue 42): SGLang applies each delta with weights/sglang_delta.py's loader, named by
    --custom-weight-loader and imported from a directory that holds only a link to the package (never the
    learner's whole site-packages); a release without the flag is refused, naming the key."""
    import importlib
    import os

    from areal_like.engine.sglang_args import DELTA_LOADER, delta_loader_dir
    from areal_like.weights import sglang_delta

    d = delta_loader_dir(str(tmp_path))
    assert delta_loader_dir(str(tmp_path)) == d and os.listdir(d) == ["areal_like"]
    assert os.path.samefile(os.path.join(d, "areal_like"), os.path.dirname(sglang_delta.__file__) + "/..")
    module, fn = DELTA_LOADER.rsplit(".", 1)
    assert DELTA_LOADER == sglang_delta.LOADER and getattr(importlib.import_module(module), fn) is sglang_delta.load_delta
    (s,) = build("sglang:d1t2+fsdp:d2", None, delta_loader=d)
    assert flag(s.processes[0].argv, "--custom-weight-loader") == DELTA_LOADER
    assert s.processes[0].env["PYTHONPATH"].split(os.pathsep)[0] == d
    (plain,) = build("sglang:d1t2+fsdp:d2", None)
    assert "--custom-weight-loader" not in plain.processes[0].argv and "PYTHONPATH" not in plain.processes[0].env
    with pytest.raises(SGLangArgsError, match="weights.sync=full"):
        build("sglang:d1+fsdp:d1", None, delta_loader=d, supported_flags={"--model-path", "--port", "--tp-size"})


def test_the_weight_senders_nccl_error_mode_aborts_without_tearing_down():
    """Issue 40 item 1, read from the torch the learner runs (its C++ header ships in the wheel): the
    value learner rank 0 gets for TORCH_NCCL_ASYNC_ERROR_HANDLING is CleanUpOnly — the watchdog aborts the
    failed group's communicators and does not tear the process down, as the default (3, SkipCleanUp)
    does — so a failed weight broadcast ends in an error the learner recovers from."""
    import re
    from pathlib import Path

    import torch

    from areal_like.engine.sglang_args import WEIGHT_SENDER_ENV

    header = (Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp").read_text()
    modes = {name: int(v) for name, v in re.findall(r"\b(NoHandling|TearDown|CleanUpOnly|SkipCleanUp) = (\d)", header)}
    assert modes == {"NoHandling": 0, "TearDown": 1, "CleanUpOnly": 2, "SkipCleanUp": 3}
    assert "#define SHOULD_TEAR_DOWN(a) (a != NoHandling && a != CleanUpOnly)" in header
    assert '"TORCH_NCCL_ASYNC_ERROR_HANDLING"' in header
    assert int(WEIGHT_SENDER_ENV["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) == modes["CleanUpOnly"]
