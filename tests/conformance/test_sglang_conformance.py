"""The `sglang` backend against SGLang's own code (issue 23): its HTTP app, parser and weight receiver.

SGLang runs in its own environment (.venv-sglang-conformance, built by scripts/setup.sh: the release
`pip install .[sglang]` resolves to, without its CUDA dependencies, torch the CPU wheel); each test
starts tests/conformance/sglang_harness.py there — SGLang's real FastAPI app on loopback with only
its TokenizerManager replaced by a recorder, and SGLang's model-runner weight receiver joining our
gloo group — and drives it with the project's real parts: the launcher's argv
(`build_sglang_servers`, flags from `sglang_server_flags`) and env, the client
(`GenerationClient`), both pushers (`WeightPusher`, flattened and per tensor), the launcher's pause
of a restarted server and the re-sync (`WeightPusher.reform` → `wait_servers`).

Breakages this suite caught (each test failed before its fix): flags read with
`dataclasses.fields` from a msgspec ServerArgs (1); a join-handshake broadcast SGLang never joins (2);
no cache flush after an update (3); `/health` generating a token while paused (4); buckets mixing
dtypes at unaligned offsets, and a 401 probe of /begin_weight_update with an api key (11).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import types
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
import torch

from allocation import place
from areal_like.api.net import free_port
from areal_like.engine.client import GenerationClient
from areal_like.engine.sglang_args import (SUPPORTED_SGLANG, build_sglang_servers, delta_loader_dir,
                                           require_sglang, sglang_server_flags)
from areal_like.weights import CudaIpcWeightPusher, SharedMemoryWeightPusher, WeightPusher
from areal_like.weights.adapter import AdapterWeights, adapter_config, file_key
from areal_like.weights.adapter_tensors import AdapterTensorPusher
from areal_like.weights.admin import WeightPushError
from areal_like.weights.disk import DiskWeightPusher
from areal_like.weights.source import LocalWeights

ROOT = Path(__file__).resolve().parents[2]
PY = os.environ.get("AREAL_LIKE_SGLANG_CONFORMANCE_PYTHON", str(ROOT / ".venv-sglang-conformance" / "bin" / "python"))
HARNESS = str(Path(__file__).with_name("sglang_harness.py"))
API, ADMIN = "api-key", "admin-key"

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module", autouse=True)
def _conformance_env() -> None:
    # Not a skip: the README's test command runs scripts/setup.sh, which builds this environment, so
    # its absence is a broken set-up that CI must not pass over.
    if not os.path.exists(PY):
        pytest.fail(f"no SGLang conformance environment at {PY}: run scripts/setup.sh (it builds "
                    ".venv-sglang-conformance), or point AREAL_LIKE_SGLANG_CONFORMANCE_PYTHON at one")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the pusher (rank 0) lives in this test process


@pytest.fixture(scope="module")
def flags() -> frozenset[str]:
    return sglang_server_flags(PY)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """What SGLang's argument resolution reads of the model (config.json); no weights are loaded."""
    d = tmp_path_factory.mktemp("qwen2-config")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128,
        "max_position_embeddings": 256, "torch_dtype": "float32", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": True}))
    return str(d)


class Harness:
    """One SGLang harness process (its own process group, ended by its id)."""

    def __init__(self, server, proc: subprocess.Popen, log_path: Path):
        self.server, self.proc, self.log_path = server, proc, log_path
        self.url = server.url

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def record(self) -> dict:
        req = urllib.request.Request(self.url + "/_recorder", headers={"Authorization": f"Bearer {API}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_harness(tmp_path, model_dir, flags, *, extra_args=(), drop_routes=(), env=None,
                  allocation="sglang:d1+fsdp:d1", lora_rank=0, lora_targets=(), delta_loader=False,
                  return_routed_experts=False) -> Harness:
    """Start SGLang's app with the argv and env the launcher builds; wait for its /health."""
    plan = place(allocation, None, 8)
    (server,) = build_sglang_servers(plan, model_path=model_dir, ports=[free_port()], seeds=11, api_key=API,
                                     admin_api_key=ADMIN, python=PY, supported_flags=flags,
                                     lora_rank=lora_rank, lora_targets=lora_targets,
                                     delta_loader=delta_loader_dir(str(tmp_path)) if delta_loader else None,
                                     return_routed_experts=return_routed_experts,
                                     extra_args=["--context-length", "256", *extra_args],
                                     secrets_file=str(tmp_path / "sglang-secrets.yaml"))
    (proc,) = server.processes
    assert proc.argv[:3] == (PY, "-m", "sglang.launch_server")
    proc.write_secrets()  # as the launcher does before starting the process
    argv = [PY, HARNESS, *(a for r in drop_routes for a in ("--drop-route", r)), "--", *proc.argv[3:]]
    log_path = tmp_path / f"sglang-{server.port}.log"
    penv = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the launcher's env alone decides it
    penv.update({**(proc.env if env is None else env), "GLOO_SOCKET_IFNAME": "lo"})
    p = subprocess.Popen(argv, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=penv,
                         start_new_session=True, cwd=str(tmp_path))
    h = Harness(server, p, log_path)
    # The launcher's own wait (launcher/run.py `_wait_health`): GET /health until 200.
    from launcher.run import RunError, _wait_health

    role = types.SimpleNamespace(proc=p, tail=h.tail, log_path=str(log_path))
    try:
        _wait_health(h.url, 300, role, "sglang conformance server")
    except RunError:
        h.stop()
        raise
    return h


@pytest.fixture
def harness(tmp_path, model_dir, flags):
    started: list[Harness] = []

    def start(**kw) -> Harness:
        h = start_harness(tmp_path, model_dir, flags, **kw)
        started.append(h)
        return h

    yield start
    for h in started:
        h.stop()


def mixed_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """A model-order list mixing dtypes at odd sizes: in this order the fp32 and int64 tensors would
    sit at unaligned offsets of a flattened bucket (SGLang refuses those)."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.layers.0.mask", torch.rand(3, generator=g) > 0.5),                      # 3 bytes
        ("model.layers.0.mlp.weight", torch.randn(5, 7, generator=g)),                  # fp32 at offset 3
        ("model.layers.0.norm.weight", torch.randn(9, generator=g).to(torch.bfloat16)),  # 18 bytes
        ("model.layers.0.pos", torch.arange(5, dtype=torch.int64) * seed),              # int64
        ("lm_head.weight", torch.randn(4, 8, generator=g)),
    ]


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def assert_bit_exact(record: dict, named: list[tuple[str, torch.Tensor]]) -> None:
    for name, t in named:
        got = record["received"][name]
        assert got["dtype"] == str(t.dtype).removeprefix("torch.") and got["shape"] == list(t.shape), name
        assert got["sha256"] == sha(t), f"{name}: SGLang's receiver got other bytes"


def kinds(record: dict) -> list[str]:
    return [e["kind"] for e in record["events"] if e["kind"] != "generate"]


# ------------------------------------------------------------------------------------------ tests
def test_the_release_is_supported_and_its_parser_takes_the_launchers_argv(tmp_path, model_dir, flags, harness):
    """Item 1/5/11: the flags come from SGLang's own parser, read by server.python (0.5.21+ made
    ServerArgs a msgspec Struct); every flag the launcher builds is accepted by that parser."""
    version = require_sglang(PY)
    assert version.startswith("0.5.") and "--weight-version" in flags and "--admin-api-key" in flags
    h = harness()  # started = SGLang's prepare_server_args accepted the argv
    assert "--skip-server-warmup" in h.server.processes[0].argv
    # and the parser does refuse what it does not know (the check above can fail)
    bad = subprocess.run([PY, HARNESS, "--", *h.server.processes[0].argv[3:], "--no-such-flag"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr
    assert SUPPORTED_SGLANG[0] == ">=0.5.21"


_PARSE = """\
import json, sys
from sglang.srt.server_args import prepare_server_args
a = prepare_server_args(sys.argv[1:] + ["--device", "cpu"])
print(json.dumps({"api_key": a.api_key, "admin_api_key": a.admin_api_key}))
"""


def test_keys_reach_sglang_through_its_config_file_not_argv(tmp_path, model_dir, flags, harness):
    """Issue 24 item 2: SGLang 0.5.23's own `prepare_server_args` on the launcher's argv takes both keys
    from the 0600 `--config` file, and the key strings appear in no argv: neither the launcher's nor
    the running server's /proc/<pid>/cmdline, which `ps` shows to every local user."""
    api, admin = "api-" + os.urandom(8).hex(), "admin-" + os.urandom(8).hex()
    plan = place("sglang:d1+fsdp:d1", None, 8)
    secrets = tmp_path / "sglang-secrets.yaml"
    (server,) = build_sglang_servers(plan, model_path=model_dir, ports=[free_port()], seeds=11, api_key=api,
                                     admin_api_key=admin, python=PY, supported_flags=flags,
                                     extra_args=["--context-length", "256"], secrets_file=str(secrets))
    (proc,) = server.processes
    assert not any(api in a or admin in a for a in proc.argv), proc.argv
    proc.write_secrets()
    assert (secrets.stat().st_mode & 0o777) == 0o600
    out = subprocess.run([PY, "-c", _PARSE, *proc.argv[3:]], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"api_key": api, "admin_api_key": admin}
    # The running server (the harness starts SGLang's app with the launcher's argv): its command line,
    # as any user reads it, has no key, and the keys still guard it.
    h = harness()
    cmdline = Path(f"/proc/{h.proc.pid}/cmdline").read_bytes().decode(errors="replace")
    assert "--config" in cmdline and API not in cmdline.split("\0") and ADMIN not in cmdline, cmdline
    assert "--api-key" not in cmdline and "--admin-api-key" not in cmdline
    for key, code in ((None, 401), (API, 200)):
        req = urllib.request.Request(h.url + "/_recorder", headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        assert status == code, (key, status)


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened", "per_tensor"])
def test_push_reaches_sglangs_receiver_bit_exact_with_one_flush(harness, flattened):
    """Items 2, 3, 11: the group forms with SGLang's own init_weights_update_group (no extra
    handshake), every bucket lands bit-exact through SGLang's receiver (flattened buckets mixing
    dtypes aligned), and each update flushes SGLang's cache once (`/flush_cache`, PROTOCOL.md's
    order), after the last bucket, before continue."""
    h = harness()
    named = mixed_weights(3)

    async def go():
        p = WeightPusher([h.url], master_port=free_port(), backend="gloo", timeout_s=60, admin_api_key=ADMIN,
                         bucket_bytes=64, flattened=flattened)
        try:
            await p.init()
            s = await p.update(named, version=1)
            assert s.buckets > 1
            await p.update(mixed_weights(4), version=2)
        finally:
            await p.close()

    asyncio.run(go())
    rec = h.record()
    assert_bit_exact(rec, mixed_weights(4))
    updates = [e for e in rec["events"] if e["kind"] == "update"]
    assert all(e["success"] for e in updates), [e.get("error") for e in updates]
    assert {e["load_format"] for e in updates} == {"flattened_bucket" if flattened else None}
    seq = kinds(rec)
    assert seq[0] == "init_group" and seq[-1] == "destroy_group"
    for push in ("1", "2"):  # each push: pause, begin, updates…, one flush, end, continue
        last = max(i for i, e in enumerate(rec["events"]) if e["kind"] == "update" and e["weight_version"] == push)
        start = max(i for i, e in enumerate(rec["events"][:last]) if e["kind"] == "pause")
        end = next(i for i, e in enumerate(rec["events"]) if i > last and e["kind"] == "continue")
        window = [e["kind"] for e in rec["events"][start:end + 1]]
        assert window[:2] == ["pause", "begin"] and window[-1] == "continue" and "end" in window
        # exactly one flush, after the last bucket landed and before generation continues
        assert window.count("flush") == 1 and window.index("flush") > len(window) - 1 - window[::-1].index("update")
    versions = [e["weight_version"] for e in updates]
    assert versions.count("1") == 1 and versions.count("2") == 1  # only the last bucket sets it


def test_health_and_resync_while_paused(harness):
    """Item 4: a restarted server is paused by the launcher until the learner re-syncs; SGLang's
    /health must answer meanwhile (with the launcher's env) for the client's probe and for
    `reform` → `wait_servers`; the re-formed group then takes the push, and the client's requests
    (SGLang's own /generate contract) continue with the new version."""
    h = harness()
    from launcher.run import Run

    async def go():
        p = WeightPusher([h.url], master_port=free_port(), backend="gloo", timeout_s=60, admin_api_key=ADMIN)
        client = GenerationClient([h.url], api_key=API, health_interval_s=None, request_timeout_s=60)
        try:
            await p.init()
            await p.update(mixed_weights(1), version=1)
            # the launcher pauses a restarted SGLang server (it has no start-paused flag)
            Run._pause_server(types.SimpleNamespace(cfg=types.SimpleNamespace(
                server=types.SimpleNamespace(admin_api_key=ADMIN))), h.url)
            assert await client.health(h.url)  # the client's probe during a long pause
            msg = await p.reform()  # waits for /health, drops the old group, forms a new one
            assert "_r1" in msg
            await p.update(mixed_weights(2), version=2)  # ends with /continue_generation
            r = await client.generate([1, 2, 3], max_new_tokens=4, rid="conf-1")
            return r
        finally:
            await client.close()
            await p.close()

    r = asyncio.run(go())
    assert len(r.output_ids) == 4 and set(r.output_versions) == {2}
    rec = h.record()
    assert_bit_exact(rec, mixed_weights(2))
    groups = [e["group_name"] for e in rec["events"] if e["kind"] == "init_group"]
    assert groups == ["weight_update_group", "weight_update_group_r1"]
    gen = [e for e in rec["events"] if e["kind"] == "generate" and e["rid"] == "conf-1"]
    assert gen and gen[0]["input_ids"] == [1, 2, 3] and gen[0]["sampling_params"]["max_new_tokens"] == 4


def test_a_release_without_begin_weight_update_answers_401_and_the_push_goes_on(harness):
    """Item 11: 0.5.10–0.5.19 lack /begin_weight_update; with `server.api_key` set SGLang's auth
    middleware answers the unknown route 401 (NORMAL level wants the api key, we send the admin key).
    SGLang 0.5.23's own middleware with those routes removed shows it; the probe must take it as
    "not supported" and push."""
    h = harness(drop_routes=("/begin_weight_update", "/end_weight_update"))
    req = urllib.request.Request(h.url + "/begin_weight_update", data=b"{}", method="POST",
                                 headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401

    async def go():
        p = WeightPusher([h.url], master_port=free_port(), backend="gloo", timeout_s=60, admin_api_key=ADMIN)
        try:
            await p.init()
            await p.update(mixed_weights(5), version=1)
            assert p._begin_end == {h.url: False}
        finally:
            await p.close()

    asyncio.run(go())
    assert_bit_exact(h.record(), mixed_weights(5))


def test_abort_request_is_admin_level_in_sglang(harness):
    """Issue 24 item 3: our embedded server puts /abort_request on SGLang's ADMIN_OPTIONAL level (with an
    admin key set, only that key passes). SGLang 0.5.23's own middleware, both keys set: no key and the
    api key are 401s, for `abort_all` and a per-rid abort alike; the admin key gets through."""
    h = harness()

    def post(body, key):
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(h.url + "/abort_request", data=json.dumps(body).encode(), method="POST",
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    for body in ({"abort_all": True}, {"rid": "x"}):
        assert post(body, None) == 401 and post(body, API) == 401, body
        assert post(body, ADMIN) != 401, body


def test_release_and_resume_memory_reach_sglang_as_its_request_types(harness):
    """Issue 27 item 6: the handle's co-located verbs through SGLang's own routes and auth (admin key):
    SGLang parses our bodies into its `ReleaseMemoryOccupationReqInput` / `ResumeMemoryOccupationReqInput`
    with the tags we sent (None = all, as SGLang reads it)."""
    h = harness()

    async def go():
        p = WeightPusher([h.url], master_port=free_port(), backend="gloo", timeout_s=60, admin_api_key=ADMIN)
        try:
            await p.init()
            await p.pause()
            await p.release_memory(["kv_cache", "weights"])
            await p.resume_memory(["weights"])
            await p.resume_memory(None)
        finally:
            await p.close()

    asyncio.run(go())
    ev = [e for e in h.record()["events"] if e["kind"] in ("pause", "release_memory", "resume_memory")]
    assert [(e["kind"], e.get("type"), e.get("tags")) for e in ev] == [
        ("pause", None, None),
        ("release_memory", "ReleaseMemoryOccupationReqInput", ["kv_cache", "weights"]),
        ("resume_memory", "ResumeMemoryOccupationReqInput", ["weights"]),
        ("resume_memory", "ResumeMemoryOccupationReqInput", None)]


def test_the_shm_handoff_reaches_sglang_as_its_update_from_tensor_request(harness):
    """Issue 27 item 6: the co-located handoff's request through SGLang's own route and auth: SGLang parses
    each bucket into its `UpdateWeightsFromTensorReqInput` — one base64 entry (our JSON descriptor, decoded
    by SGLang's Base64Bytes schema intact), `load_format` as sent, the version on the last bucket only,
    no flush per bucket — between its pause and continue. Not checked here: SGLang's scheduler loading it
    (its loader unpickles CUDA-IPC handles; `areal_like_shm` is our embedded server's format, and the config
    refuses SGLang co-located until that CUDA-IPC path exists)."""
    h = harness()
    weights = [("model.embed_tokens.weight", torch.randn(8, 4)), ("lm_head.weight", torch.randn(8, 4)),
               ("model.norm.weight", torch.ones(4))]

    async def go():
        p = SharedMemoryWeightPusher([h.url], owner=f"conf{os.getpid()}", bucket_bytes=160, timeout_s=60,
                                     admin_api_key=ADMIN)
        try:
            await p.init()
            return await p.update(weights, 12)
        finally:
            await p.close()

    res = asyncio.run(go())
    ev = [e for e in h.record()["events"] if e["kind"] in ("pause", "update_tensor", "flush", "continue")]
    kinds = [e["kind"] for e in ev]
    assert kinds == ["pause"] + ["update_tensor"] * res.buckets + ["flush", "continue"] and res.buckets == 2
    ups = [e for e in ev if e["kind"] == "update_tensor"]
    assert all(e["type"] == "UpdateWeightsFromTensorReqInput" and e["load_format"] == "areal_like_shm"
               and e["flush_cache"] is False and e["abort_all_requests"] is False for e in ups)
    assert [e["weight_version"] for e in ups] == [None, "12"]
    names = [t["name"] for e in ups for t in e["payloads"][0]["tensors"]]
    assert sorted(names) == sorted(n for n, _ in weights)
    assert all(e["payloads"][0]["path"].startswith(os.path.join("/dev/shm", "areal_like-")) for e in ups)


def test_the_cuda_ipc_handoff_is_deserialised_by_sglangs_own_serializer(harness):
    """Issue 27 item 6, co-located SGLang: each bucket reaches SGLang as its `UpdateWeightsFromTensorReqInput`
    with one payload per TP rank (here t2), inside a /begin_weight_update session, and SGLang's own
    `MultiprocessingSerializer.deserialize` (its SafeUnpickler's allow-list) rebuilds exactly our tensors —
    names, shapes, dtypes (cast to the servers' bf16), bytes. On this CPU machine the tensors travel as
    shared-memory storage (torch's `file_system` sharing); on a GPU the same pickle carries CUDA-IPC handles
    with the device named by UUID (`rebuild_cuda_tensor`, which SGLang patches to map it back): that leg,
    and SGLang's `model.load_weights` from it, need a GPU and are not checked here."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    h = harness()
    weights = mixed_weights(5)

    async def go():
        p = CudaIpcWeightPusher([h.url], tp_per_server=[2], bucket_bytes=100, timeout_s=60, admin_api_key=ADMIN,
                                dtype="bfloat16")
        try:
            await p.init()
            return await p.update(weights, 21)
        finally:
            await p.close()

    try:
        res = asyncio.run(go())
    finally:
        torch.multiprocessing.set_sharing_strategy(before)
    ev = [e for e in h.record()["events"] if e["kind"] in ("pause", "update_tensor", "flush", "continue")]
    assert [e["kind"] for e in ev] == ["pause"] + ["update_tensor"] * res.buckets + ["flush", "continue"]
    ups = [e for e in ev if e["kind"] == "update_tensor"]
    assert res.buckets >= 2 and [e["weight_version"] for e in ups][-1] == "21"
    assert all(e["weight_version"] is None for e in ups[:-1])
    assert all(e["type"] == "UpdateWeightsFromTensorReqInput" and e["load_format"] is None and len(e["payloads"]) == 2
               and e["payloads"][0] == e["payloads"][1] for e in ups)  # the same tensors for each TP rank
    got = {n: (shape, dt, digest) for e in ups for n, shape, dt, digest in e["payloads"][0]}
    want = {n: (list(t.shape), str(t.dtype if not t.is_floating_point() else torch.bfloat16).removeprefix("torch."),
                sha(t.to(torch.bfloat16) if t.is_floating_point() else t)) for n, t in weights}
    assert got == want


def _handoff_rank(rank: int, world: int, port: int, layout: str, model_dir: str, url: str, out: str) -> None:
    """One rank of a two-rank learner pool (gloo) pushing to a co-located t2 server, as the learner loop does:
    rank 0 runs the pusher, the other rank serves its handoff commands from its `leader_ready` wait."""
    import datetime

    import torch.distributed as dist
    import torch.multiprocessing as tmp

    from areal_like.api.config import TrainConfig
    from areal_like.learner.parallel.spawn import leave_pool
    from areal_like.learner.trainer import Trainer

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    tmp.set_sharing_strategy("file_system")  # CPU tensors pickle as named shared memory (CUDA: IPC handles)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        tr = Trainer(model_dir, TrainConfig(dp_sharding="full", collective_timeout_s=120), layout, temperature=1.0)
        full = tr.full_state()  # collective: the whole model on rank 0, to compare with what the server got
        with open(f"{out}.pid{rank}", "w") as f:
            f.write(str(os.getpid()))
        if rank == 0:
            async def push():
                p = CudaIpcWeightPusher([url], tp_per_server=[2], bucket_bytes=16 << 10, timeout_s=60,
                                        admin_api_key=ADMIN, dtype="bfloat16",
                                        server_gpus=[[[0, 0], [0, 1]]], learner_gpus=[[0, 0], [0, 1]])
                try:
                    await p.init()
                    return await p.update(tr.weight_source(), 7)
                finally:
                    await p.close()

            res = msgspec.structs.asdict(asyncio.run(push()))
            res["want"] = {n: [list(t.shape), str(t.dtype if not t.is_floating_point() else torch.bfloat16)
                               .removeprefix("torch."), sha(t.to(torch.bfloat16) if t.is_floating_point() else t)]
                           for n, t in full}
            with open(out, "w") as f:
                json.dump(res, f)
        tr.layout.leader_ready("finish the weight handoff")  # the other rank serves the handoff's commands here
        leave_pool()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["d2p1t1", "d1p2t1"], ids=["fsdp-d2", "pipeline-p2"])
def test_each_colocated_learner_rank_hands_its_own_copy_to_the_server_rank_on_its_gpu(harness, tmp_path, layout):
    """Issue 40 item 3 (`sglang:d1t2|fsdp:d2`): each TP rank of the server receives the bucket from the learner
    rank on its own GPU — never every TP rank from rank 0's GPU — and SGLang's own deserializer rebuilds
    the whole model, bf16, bit for bit, from each. A sharded learner (FSDP: every rank all-gathers) and a
    pipelined one (each stage broadcasts its tensors to the other's ranks). On this CPU machine a rank's
    buffer travels as named shared memory, whose name carries the pid of the process that made it: that
    is how the test tells which rank packed what (on a GPU the same pickle carries a CUDA-IPC handle of the
    buffer on that rank's GPU)."""
    import torch.multiprocessing as mp

    from areal_like.data.tiny_model import build_tiny_model

    h = harness()
    model = build_tiny_model(str(tmp_path / "m"), hidden_size=32, intermediate_size=64, num_layers=2)
    out = str(tmp_path / "handoff.json")
    ctx = mp.spawn(_handoff_rank, args=(2, free_port(), layout, model, h.url, out), nprocs=2, join=False)
    # joined by waitpid, not by spawn's pipes: torch's shared-memory manager (file_system sharing), started by
    # a rank, inherits them and lives as long as the harness holds a segment open
    for p in ctx.processes:
        p.join()
    assert [p.exitcode for p in ctx.processes] == [0, 0]
    res = json.loads(Path(out).read_text())
    pids = [int(Path(f"{out}.pid{r}").read_text()) for r in range(2)]
    assert res["per_rank"] and res["buckets"] >= 3, res
    ups = [e for e in h.record()["events"] if e["kind"] == "update_tensor"]
    assert len(ups) == res["buckets"] and [e["weight_version"] for e in ups][-1] == "7"
    for e in ups:
        assert len(e["payloads"]) == 2 and e["payloads"][0] == e["payloads"][1]  # the same tensors for each TP rank
        assert e["origins"] == [[pids[0]], [pids[1]]], (e["origins"], pids)  # TP rank r ← learner rank r's buffer
    got = {n: [shape, dt, digest] for e in ups for n, shape, dt, digest in e["payloads"][1]}
    assert got == res["want"]


_PARSE_SAVER = """\
import json, sys
from sglang.srt.server_args import prepare_server_args
a = prepare_server_args(sys.argv[1:] + ["--device", "cpu"])
print(json.dumps({"enable_memory_saver": a.enable_memory_saver, "tp_size": a.tp_size}))
"""


def test_colocated_launch_command_is_parsed_by_sglang_with_its_memory_saver(tmp_path, model_dir, flags):
    """Co-located SGLang servers (`sglang:d1t2|fsdp:d2`, colocate.release_memory): SGLang's own parser
    takes the launcher's argv with --enable-memory-saver (what makes /release_memory_occupation free GPU
    memory; the running server also needs the torch_memory_saver package, a GPU dependency)."""
    (server,) = build_sglang_servers(place("sglang:d1t2|fsdp:d2", None, 2), model_path=model_dir, ports=[free_port()],
                                     seeds=3, python=PY, supported_flags=flags, weight_update="memory",
                                     memory_saver=True)
    argv = server.processes[0].argv
    out = subprocess.run([PY, "-c", _PARSE_SAVER, *argv[3:]], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"enable_memory_saver": True, "tp_size": 2}


# ------------------------------------------------------------------------------------------ LoRA (issue 28)
# The conformance model (model_dir): hidden 32, 4 heads of 8, 2 KV heads, MLP 64, 2 layers, vocab 128.
_LORA_SHAPES = {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16), "o_proj": (32, 32),
                "gate_proj": (32, 64), "up_proj": (32, 64), "down_proj": (64, 32)}
_LORA_TARGETS = (*_LORA_SHAPES, "lm_head")


def lora_adapter(seed: int, rank: int = 8) -> AdapterWeights:
    """An adapter as the learner's `Trainer.weight_source()` gives it (areal_like names, fp32) on every
    linear layer and the LM head, with its peft config."""
    from areal_like.learner.lora import LoraSettings

    g = torch.Generator().manual_seed(seed)
    named = []
    for layer in range(2):
        for mod, (fan_in, fan_out) in _LORA_SHAPES.items():
            part = "self_attn" if mod.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            base = f"model.layers.{layer}.{part}.{mod}"
            named += [(f"{base}.lora_A.weight", torch.randn(rank, fan_in, generator=g)),
                      (f"{base}.lora_B.weight", torch.randn(fan_out, rank, generator=g))]
    named += [("lm_head.lora_A.weight", torch.randn(rank, 32, generator=g)),
              ("lm_head.lora_B.weight", torch.randn(128, rank, generator=g))]
    return AdapterWeights(LocalWeights(named), adapter_config(LoraSettings(rank, 16.0, list(_LORA_TARGETS)), None))


def adapter_digests(adapter: AdapterWeights, dtype: torch.dtype) -> dict[str, str]:
    """What SGLang should hold: peft's saved names, the tensors cast to the servers' dtype."""
    return {file_key(n): sha(t.to(dtype)) for n, t in adapter.open(range(len(adapter.meta)))}


def lora_events(record: dict) -> list[dict]:
    return [e for e in record["events"] if e["kind"] in ("pause", "lora_unload", "lora_load", "weight_version",
                                                         "flush", "continue", "generate_lora", "generate_refused")]


@pytest.mark.parametrize("transport", ["disk", "tensors"])
def test_lora_pushes_reach_sglangs_own_lora_path_and_requests_resolve_to_the_new_adapter(harness, tmp_path, transport):
    """Issue 28 item 4, SGLang's side: the launcher's LoRA argv (--enable-lora, --max-lora-rank,
    --lora-target-modules with lm_head, --max-loras-per-batch, --max-loaded-loras) is taken by SGLang's
    parser and its check_lora_server_args; a request naming the run's adapter before the first push is
    held by the launcher's pause instead of SGLang's "never been loaded" 400; each push — `disk`: a peft
    dir through /load_lora_adapter, `tensors`: by value through /load_lora_adapter_from_tensors (t2: one
    payload per TP rank, each deserialised by SGLang's TP worker code and checked against
    `expected_checksums`) — passes SGLang's own registry (unload, load under the same name), its
    LoRAConfig and its `validate_new_adapter` (rank and targets against the server's pool), sets the
    weight version, and the next request resolves (SGLang's `_resolve_lora_path`) to an adapter with
    exactly the pushed bytes. A push SGLang refuses (rank 16 > --max-lora-rank 8) raises naming the server,
    the previous adapter is loaded back and generation continues on it."""
    from launcher.run import Run

    h = harness(allocation="sglang:d1t2+fsdp:d1" if transport == "tensors" else "sglang:d1+fsdp:d1",
                lora_rank=8, lora_targets=_LORA_TARGETS)
    Run._pause_server(types.SimpleNamespace(cfg=types.SimpleNamespace(  # what `launcher run` does for LoRA
        server=types.SimpleNamespace(admin_api_key=ADMIN))), h.url)
    v1, v2 = lora_adapter(1), lora_adapter(2)

    async def go():
        if transport == "disk":
            p = DiskWeightPusher([h.url], out_dir=str(tmp_path / "weights_disk"), timeout_s=60, admin_api_key=ADMIN,
                                 dtype="bfloat16")
        else:
            p = AdapterTensorPusher([h.url], tp_per_server=[2], timeout_s=60, admin_api_key=ADMIN, dtype="bfloat16")
        client = GenerationClient([h.url], api_key=API, health_interval_s=None, request_timeout_s=60,
                                  lora_name="policy")
        try:
            await p.init()
            early = asyncio.ensure_future(client.generate([1, 2, 3], max_new_tokens=2, rid="early"))
            await asyncio.sleep(1.0)
            assert not early.done()  # held by the pause, not refused
            res1 = await p.update(v1, version=1)
            r_early = await early
            r1 = await client.generate([4, 5], max_new_tokens=2, rid="after-v1")
            await p.update(v2, version=2)
            r2 = await client.generate([6], max_new_tokens=2, rid="after-v2")
            with pytest.raises(WeightPushError, match="incompatible|rank"):
                await p.update(lora_adapter(3, rank=16), version=3)
            r3 = await client.generate([7], max_new_tokens=2, rid="after-refused")
            return res1, r_early, r1, r2, r3
        finally:
            await client.close()
            await p.close()

    res1, r_early, r1, r2, r3 = asyncio.run(go())
    assert res1.adapter and res1.bytes == sum(t.numel() * 2 for _, t in v1.open(range(len(v1.meta))))
    assert set(r_early.output_versions) == set(r1.output_versions) == {1} and set(r2.output_versions) == {2}
    assert set(r3.output_versions) == {2}
    ev = lora_events(h.record())
    loads = [e for e in ev if e["kind"] == "lora_load"]
    want_type = "LoadLoRAAdapterReqInput" if transport == "disk" else "LoadLoRAAdapterFromTensorsReqInput"
    assert [e["type"] for e in loads] == [want_type] * 4  # v1, v2, refused v3, v2 loaded back
    assert [e["success"] for e in loads] == [True, True, False, True] and "incompatible" in loads[2]["error"]
    assert loads[0]["config"]["r"] == 8 and sorted(loads[0]["config"]["target_modules"]) == sorted(_LORA_TARGETS)
    gen = {e["rid"]: e for e in ev if e["kind"] == "generate_lora"}
    assert set(gen) == {"early", "after-v1", "after-v2", "after-refused"}
    assert all(e["lora_path"] == "policy" for e in gen.values())
    assert gen["early"]["tensors"] == gen["after-v1"]["tensors"] == adapter_digests(v1, torch.bfloat16)
    assert gen["after-v2"]["tensors"] == gen["after-refused"]["tensors"] == adapter_digests(v2, torch.bfloat16)
    # the launcher's pause, then each push: pause → (unload: none before the first) → load → version → flush
    # → continue
    seq = [e["kind"] for e in ev if e["kind"] != "generate_lora"]
    pauses = [k for k, kind in enumerate(seq) if kind == "pause"]
    assert seq[pauses[1]:pauses[2]] == ["pause", "lora_load", "weight_version", "flush", "continue"], seq
    assert seq[pauses[2]:pauses[3]] == ["pause", "lora_unload", "lora_load", "weight_version", "flush", "continue"], seq
    assert {e["lora_name"] for e in loads} == {"policy"}


_WEIGHT_GROUP_TIMEOUT = r"""
# Read as source (importing these modules pulls SGLang's GPU dependencies, absent here), with Python's ast.
import ast, importlib.util, json, os
from torch.distributed.distributed_c10d import default_pg_timeout

root = os.path.dirname(importlib.util.find_spec("sglang").origin)
def tree(rel):
    with open(os.path.join(root, rel)) as f:
        return ast.parse(f.read())
def find(t, kind, name):
    return next(n for n in ast.walk(t) if isinstance(n, kind) and n.name == name)

req = find(tree("srt/managers/io_struct.py"), ast.ClassDef, "InitWeightsUpdateGroupReqInput")
fields = [n.target.id for n in req.body if isinstance(n, ast.AnnAssign)]
runner = find(tree("srt/model_executor/model_runner_components/weight_updater.py"), ast.FunctionDef,
              "init_weights_update_group")
calls = [n for n in ast.walk(runner) if isinstance(n, ast.Call)
         and getattr(n.func, "id", getattr(n.func, "attr", "")) == "init_custom_process_group"]
fn = find(tree("srt/utils/common.py"), ast.FunctionDef, "init_custom_process_group")
args = [a.arg for a in fn.args.args]
defaults = dict(zip(args[len(args) - len(fn.args.defaults):], fn.args.defaults))
to_default = any(isinstance(n, ast.If) and "timeout is None" in ast.unparse(n.test)
                 and "timeout = default_pg_timeout" in ast.unparse(n) for n in ast.walk(fn))
print(json.dumps({"fields": fields, "call_keywords": [[k.arg for k in c.keywords] for c in calls],
                  "default_none": isinstance(defaults.get("timeout"), ast.Constant) and defaults["timeout"].value is None,
                  "none_means_default_pg_timeout": to_default,
                  "default_pg_timeout_s": default_pg_timeout.total_seconds()}))
"""


def test_sglangs_side_of_the_weight_group_waits_30_minutes_and_takes_no_timeout():
    """Issue 40 item 1, read from SGLang's own code: `/init_weights_update_group` takes no timeout, the
    model runner creates its side of the group without one, and `init_custom_process_group` then uses
    torch's `default_pg_timeout` (30 minutes). A server inside a broadcast whose sender failed or died
    therefore waits 30 minutes, and no route ends that wait — which is why the learner asks the launcher to
    restart the servers a failed NCCL push left behind, and the launcher restarts every server when the
    learner dies inside one (tests/integration/test_restart_budgets.py). Should a release take a timeout,
    this fails, and the pusher should send `weights.timeout_s` instead."""
    out = subprocess.run([PY, "-c", _WEIGHT_GROUP_TIMEOUT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert "timeout" not in facts["fields"] and "master_address" in facts["fields"], facts
    assert facts["call_keywords"] and all("timeout" not in kw for kw in facts["call_keywords"]), facts
    assert facts["default_none"] and facts["none_means_default_pg_timeout"], facts
    assert facts["default_pg_timeout_s"] == 1800.0, facts


# ------------------------------------------------------------------------------------------ delta sync (issue 42)
def _qwen2_weights(model_dir: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The conformance model's weights as a learner pushes them: Hugging Face names, fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), torch_dtype=torch.float32)
    return [(n, p.detach().clone()) for n, p in m.named_parameters()]


def _step(named: list[tuple[str, torch.Tensor]], seed: int, share: float) -> list[tuple[str, torch.Tensor]]:
    """An RL step as the servers see it: a `share` of each matrix's elements moves past a bf16 rounding
    boundary, the rest stays bit-equal in bf16; the norms change everywhere (a dense delta)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, t in named:
        if "norm" in n:
            out.append((n, t + 0.25))
        else:
            hit = torch.rand(t.shape, generator=g) < share
            out.append((n, torch.where(hit, t * 1.5 + 0.01, t)))
    return out


def test_a_delta_reaches_sglangs_model_through_its_own_tensor_route_bit_exact(tmp_path, model_dir, flags, harness):
    """Issue 42, SGLang's side of `weights.sync=delta`: the launcher's argv (`--custom-weight-loader`, the
    package root on PYTHONPATH) is taken by SGLang's parser; the first push is full over SGLang's
    distributed route; the next ones go by value through SGLang's /update_weights_from_tensor, deserialised by
    SGLang's SafeUnpickler and applied by the project's loader through SGLang's own weight loaders into SGLang's
    own Qwen2 model (stacked qkv_proj / gate_up_proj, bf16). After two deltas every parameter of SGLang's model
    equals, byte for byte, what a full push of the same weights loads; a delta that does not decode is refused
    and changes nothing. With `weights.mode=disk` the delta is a directory whose path reaches the same loader;
    it lands bit-exact too."""
    from areal_like.weights.sglang_delta import LOADER

    h = harness(delta_loader=True, extra_args=["--dtype", "bfloat16"])
    assert h.server.processes[0].argv[h.server.processes[0].argv.index("--custom-weight-loader") + 1] == LOADER
    w1 = _qwen2_weights(model_dir, 0)
    w2 = _step(w1, 1, 0.02)
    w3 = _step(w2, 2, 0.05)
    w4 = _step(w3, 3, 0.03)

    async def go():
        p = WeightPusher([h.url], master_port=free_port(), backend="gloo", timeout_s=60, admin_api_key=ADMIN,
                         api_key=API, dtype="bfloat16", sync="delta", delta_route="tensor")
        try:
            await p.init()
            r1 = await p.update(w1, version=1)
            r2 = await p.update(w2, version=2)
            r3 = await p.update(w3, version=3)
            after_delta = h.record()["params"]
            # a payload that does not decode: refused, nothing written, the version kept
            await p.pause("abort")
            await p._begin_or_end("/begin_weight_update")
            from areal_like.weights.sglang_delta import serialize
            bad = serialize([("not a delta header", torch.zeros(8, dtype=torch.uint8))])
            with pytest.raises(WeightPushError, match="not a delta bucket"):
                await p._post(h.url, "/update_weights_from_tensor", {
                    "serialized_named_tensors": [bad], "load_format": LOADER, "weight_version": "99"})
            await p._begin_or_end("/end_weight_update")
            await p.resume()
            assert h.record()["params"] == after_delta
            p.sent.invalidate()  # the same weights again, as a full push
            r4 = await p.update(w3, version=4)
            after_full = h.record()["params"]
            # weights.mode=disk: a delta dir on the shared filesystem, its path to the same loader. The disk
            # pusher's copy of what the server holds (version 4, w3 in bf16) is given to it as its own full push
            # would have recorded it (the harness stands in for SGLang's disk load of a whole checkpoint).
            dp = DiskWeightPusher([h.url], out_dir=str(tmp_path / "disk"), timeout_s=60, admin_api_key=ADMIN,
                                  api_key=API, dtype="bfloat16", sync="delta", delta_route="tensor", tp_per_server=[1])
            await dp.init()
            try:
                for n, t in w3:
                    dp.sent.record(n, t.to(torch.bfloat16))
                dp.sent.version = 4
                r5 = await dp.update(w4, version=5)
            finally:
                await dp.close()
            after_disk = h.record()["params"]
            r6 = await p.update(w4, version=6)  # the server holds 5, not p's 4: a full push of the same weights
            return r1, r2, r3, r4, after_delta, after_full, r5, after_disk, r6
        finally:
            await p.close()

    r1, r2, r3, r4, after_delta, after_full, r5, after_disk, r6 = asyncio.run(go())
    assert r5.delta and not r6.delta and os.path.isfile(os.path.join(r5.path, "delta.json"))
    assert after_disk == h.record()["params"] != after_delta
    assert (r1.delta, r2.delta, r3.delta, r4.delta) == (False, True, True, False)
    assert r2.bytes < 0.25 * r1.bytes and r3.bytes < 0.35 * r1.bytes, (r1.bytes, r2.bytes, r3.bytes)
    rec = h.record()
    full = after_full
    assert set(full) >= {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"}
    assert after_delta == full, [n for n in full if after_delta[n] != full[n]]
    tensor_updates = [e for e in rec["events"] if e["kind"] == "update_tensor"]
    assert [(e["load_format"], e["success"], e["weight_version"]) for e in tensor_updates] == [
        (LOADER, True, "2"), (LOADER, True, "3"), (LOADER, False, "99"), (LOADER, True, "5")]
    assert "not a delta bucket" in tensor_updates[2]["error"]
    # each delta push: pause, begin, the update, end, one flush, continue
    i = next(k for k, e in enumerate(rec["events"]) if e["kind"] == "update_tensor")
    start = max(k for k, e in enumerate(rec["events"][:i]) if e["kind"] == "pause")
    window = [e["kind"] for e in rec["events"][start:] if e["kind"] != "generate"][:7]
    assert window == ["pause", "begin", "update_tensor", "weight_version", "end", "flush", "continue"], window


# ------------------------------------------------------------------------------------------ teacher scoring (issue 43)
def test_a_teachers_scoring_request_is_sglangs_batched_generate_with_per_sequence_logprob_starts(harness):
    """Issue 43 item 4: `GenerationClient.score` (a teacher scoring a group's samples for on-policy
    distillation) is one /generate that SGLang 0.5.23's own request type takes — `input_ids` a list of
    sequences, `logprob_start_len` one per sequence, `max_new_tokens` 0, `return_logprob` — and that SGLang's
    own normalisation splits into single requests, each asking for its sequence's logprobs from its start;
    the client reads each reply's `input_token_logprobs` (SGLang's shape) back in order."""
    h = harness()
    seqs, starts = [[3, 4, 5, 6], [9, 8], [1, 2, 3, 4, 5]], [2, 1, 4]

    async def go():
        async with GenerationClient([h.url], api_key=API) as client:
            return await client.score(seqs, starts, key="g")

    got = asyncio.run(go())
    assert got == [[-0.25 - 0.01 * k for k in range(st, len(ids))] for ids, st in zip(seqs, starts)]
    gens = [e for e in h.record()["events"] if e["kind"] == "generate"]
    assert [(e["input_ids"], e["logprob_start_len"], e["return_logprob"], e["sampling_params"]["max_new_tokens"])
            for e in gens] == [(ids, st, True, 0) for ids, st in zip(seqs, starts)]


def _routes(positions, layers=2, top_k=2) -> list[list[int]]:
    """The harness's routes (sglang_harness.py): expert (p·7 + l·3 + j) mod 8 at position p, layer l, slot j."""
    return [[(p * 7 + l * 3 + j) % 8 for l in range(layers) for j in range(top_k)] for p in positions]


def test_routed_experts_are_asked_for_and_read_as_sglang_defines_them(harness):
    """Issue 44 item 2: rollout routing replay against SGLang 0.5.23. The launcher's `--enable-return-routed-experts`
    is taken by SGLang's parser (the harness started); the client's `return_routed_experts` and
    `routed_experts_start_len` are SGLang's own request fields (its GenerateReqInput read them); and the reply —
    encoded by SGLang's own DetokenizerManager, base64 of int32 (positions, layers, top-k) for positions
    [start, prompt + output − 1) — is read back into one row per position (layers × top-k ids)."""
    h = harness(return_routed_experts=True)
    assert "--enable-return-routed-experts" in h.server.processes[0].argv

    async def go():
        async with GenerationClient([h.url], api_key=API) as client:
            whole = await client.generate([3, 4, 5], max_new_tokens=4, routed_experts_start_len=0)
            tail = await client.generate([3, 4, 5, 6, 7], max_new_tokens=2, routed_experts_start_len=4)
            plain = await client.generate([3, 4, 5], max_new_tokens=2)
            return whole, tail, plain

    whole, tail, plain = asyncio.run(go())
    assert whole.extra["routed_experts"].tolist() == _routes(range(0, 3 + 4 - 1))
    assert tail.extra["routed_experts"].tolist() == _routes(range(4, 5 + 2 - 1))
    assert "routed_experts" not in plain.extra
    gens = [e for e in h.record()["events"] if e["kind"] == "generate"]
    assert [(e["return_routed_experts"], e["routed_experts_start_len"]) for e in gens] == [(True, 0), (True, 4),
                                                                                          (False, 0)]


# --------------------------------------------------------------- the MoE push to SGLang (issue 44 item 3)
_LOAD_EXPERTS = """\
import json, sys, types
sys.path.insert(0, sys.argv[1])
import sglang_harness
sglang_harness._stub_torchvision()
import torch
from sglang.srt.models.qwen2_moe import Qwen2MoeForCausalLM
from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
out = {}
for arch, layers, experts, names in json.loads(sys.argv[2]):
    calls = out[arch] = []

    def param(pname):
        p = torch.nn.Parameter(torch.empty(0), requires_grad=False)

        def loader(param, w, *a, **k):
            calls.append([pname, list(w.shape), k.get("shard_id"), k.get("expert_id")])
        p.weight_loader = loader
        return p

    params = {f"model.layers.{l}.{p}": param(f"model.layers.{l}.{p}") for l in range(layers)
              for p in ("mlp.experts.w13_weight", "mlp.experts.w2_weight", "mlp.gate.weight")}
    me = types.SimpleNamespace(config=types.SimpleNamespace(num_experts=experts),
                               model=types.SimpleNamespace(start_layer=0, end_layer=layers), start_layer=0,
                               end_layer=layers, named_parameters=params.items, routed_experts_weights_of_layer=1)
    M = Qwen3MoeForCausalLM if arch == "qwen3_moe" else Qwen2MoeForCausalLM
    M.load_weights(me, [(n, torch.zeros(s)) for n, s in names])
print(json.dumps(out))
"""


def test_the_moe_push_names_each_expert_as_sglangs_load_weights_places_it():
    """A push of a MoE model to SGLang servers (`PerExpertWeights`): the fused experts split into per-expert tensors
    whose names SGLang 0.5.23's own `load_weights` (Qwen3-MoE's and Qwen2-MoE's, run here with its parameters
    stood in by recorders) places in its fused MoE parameters — each expert's gate as shard w1 and up as w3 of
    `w13_weight`, its down as w2 of `w2_weight`, at that expert's id — and the router where SGLang keeps it.
    (A fused name, `…mlp.experts.gate_up_proj`, SGLang skips without a word: hence the split.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    from areal_like.data.tiny_model import MOE_DEFAULTS, moe_config
    from areal_like.learner.moe import PerExpertWeights
    from areal_like.weights.source import LocalWeights

    common = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64)
    asked, want = [], {}
    for arch in ("qwen3_moe", "qwen2_moe"):
        config, _ = moe_config(arch, common, head_dim=8)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.to_dict()))
        src = PerExpertWeights(LocalWeights(list(model.named_parameters())))
        routed = [(n, list(s)) for n, s, _ in src.meta if ".mlp.experts." in n or n.endswith(".mlp.gate.weight")]
        E, I = MOE_DEFAULTS[arch]["num_experts"], MOE_DEFAULTS[arch]["moe_intermediate_size"]
        assert len(routed) == 2 * (3 * E + 1)
        asked.append([arch, 2, E, routed])
        want[arch] = [[f"model.layers.{layer}.mlp.gate.weight", [E, 16], None, None] for layer in range(2)]
        want[arch] += [[f"model.layers.{layer}.mlp.experts.{p}", shape, shard, e] for layer in range(2) for e in range(E)
                       for p, shape, shard in (("w13_weight", [I, 16], "w1"), ("w13_weight", [I, 16], "w3"),
                                               ("w2_weight", [16, I], "w2"))]
    out = subprocess.run([PY, "-c", _LOAD_EXPERTS, str(ROOT / "tests" / "conformance"), json.dumps(asked)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    calls = json.loads(out.stdout.strip().splitlines()[-1])
    for arch, w in want.items():
        assert sorted(map(json.dumps, calls[arch])) == sorted(map(json.dumps, w)), arch
