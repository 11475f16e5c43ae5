"""Issue 44: mixture-of-experts models — transformers' Qwen3-MoE and Qwen2-MoE classes at the demo's size — in the
learner and the embedded engine, and routing replay between them.

- The learner reads the per-expert checkpoint `save_pretrained` writes into transformers' fused experts: its
  weights are exactly the ones transformers loads, for both families.
- Router replay (learner/moe.py): replaying the router's own choices changes no number (loss, gradients — the
  router's included); replaying other experts changes the forward, and the router still gets gradients.
- The embedded server (`--enable-return-routed-experts`) answers SGLang's `return_routed_experts` /
  `routed_experts_start_len` with the experts its routers chose at every position it ran, equal to a plain
  transformers forward over the sequence, in the format SGLang's own reader decodes.
"""

from __future__ import annotations

import base64
import json
import os
import types
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import torch

from areal_like.api.config import TrainConfig
from areal_like.api.net import free_port
from areal_like.data.tiny_model import build_tiny_model
from areal_like.learner.moe import find_routers
from areal_like.learner.parallel.spawn import synthetic_groups
from areal_like.learner.trainer import Trainer

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SGLANG_PY = os.environ.get("AREAL_LIKE_SGLANG_CONFORMANCE_PYTHON",
                           os.path.join(ROOT, ".venv-sglang-conformance", "bin", "python"))


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("moe")
    return {a: build_tiny_model(str(base / a), arch=a) for a in ("qwen3_moe", "qwen2_moe")}


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_the_learner_reads_per_expert_checkpoints_into_the_fused_experts(moe_dirs, arch):
    from safetensors import safe_open

    with safe_open(os.path.join(moe_dirs[arch], "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in set(f.keys())  # HF's per-expert format on disk
    t = Trainer(moe_dirs[arch], TrainConfig(), None, temperature=1.0)
    mine = dict(t.full_state())
    hf = _hf(moe_dirs[arch]).state_dict()
    assert set(mine) == set(hf) and "model.layers.0.mlp.experts.gate_up_proj" in mine
    assert all(torch.equal(mine[n], hf[n]) for n in hf)


def test_replaying_the_routers_own_choice_changes_nothing_and_the_router_learns_through_replayed_experts(moe_dirs):
    torch.set_num_threads(1)
    path = moe_dirs["qwen3_moe"]
    groups = synthetic_groups(seed=0, n_groups=2, n=4, vocab=80)
    plain = Trainer(path, TrainConfig(lr=1e-2), None, temperature=1.0)
    st_plain = plain.train_step(groups, version=0)
    g_plain = dict(plain.named_full_grads())
    # behaviour (R2): the routes of a recording pass, replayed — the router's own choice with one minibatch
    r2 = Trainer(path, TrainConfig(lr=1e-2, routing_replay="behaviour"), None, temperature=1.0)
    st_r2 = r2.train_step(groups, version=0)
    g_r2 = dict(r2.named_full_grads())
    assert st_r2.loss == st_plain.loss and st_r2.grad_norm == st_plain.grad_norm and st_r2.routing_agreement == 1.0
    assert all(torch.equal(g_r2[n], g_plain[n]) for n in g_plain)
    assert g_r2["model.layers.0.mlp.gate.weight"].abs().sum() > 0  # the router trains under replay
    # rollout (R3) with routes that disagree with the router: another forward, the router still gets gradients
    other = [g.__class__(group_id=g.group_id, prompt_id=g.prompt_id, created_at=0.0, trajectories=[
        x.with_routes(np.tile(np.array([[6, 7, 6, 7]]), (x.num_tokens - 1, 1))) for x in g.trajectories]) for g in groups]
    r3 = Trainer(path, TrainConfig(lr=1e-2, routing_replay="rollout"), None, temperature=1.0)
    st_r3 = r3.train_step(other, version=0)
    g_r3 = dict(r3.named_full_grads())
    assert st_r3.loss != st_plain.loss and 0.0 <= st_r3.routing_agreement < 1.0
    assert g_r3["model.layers.0.mlp.gate.weight"].abs().sum() > 0
    # experts 6 and 7 alone took the tokens: the others' weights got no gradient
    gu = g_r3["model.layers.0.mlp.experts.gate_up_proj"]
    assert gu[:6].abs().sum() == 0 and gu[6:].abs().sum() > 0
    # train.routing_replay_measure: the same tokens with the given routes and with the router's own — equal when the
    # routes are the router's own choice (recorded by a behaviour pass), apart when they are not
    rec = Trainer(path, TrainConfig(routing_replay="behaviour"), None, temperature=1.0)
    samples = [x for g in groups for x in g.trajectories]
    rec._forward_only(rec.actor, samples, list(range(len(samples))), lambda mb, y: y[:, :-1, 0])
    mine = iter(rec._routes[i] for i in range(len(samples)))
    own_routes = [g.__class__(group_id=g.group_id, prompt_id=g.prompt_id, created_at=0.0, trajectories=[
        x.with_routes(next(mine)) for x in g.trajectories]) for g in groups]
    for routed, same in ((own_routes, True), (other, False)):
        m = Trainer(path, TrainConfig(lr=1e-2, routing_replay="rollout", routing_replay_measure=True), None,
                    temperature=1.0).train_step(routed, version=0)
        assert (m.routing_dlogp_replayed == m.routing_dlogp_own) == same, (m.routing_dlogp_replayed, m.routing_dlogp_own)
    # a dense model refuses replay, naming the key
    with pytest.raises(ValueError, match="not a mixture-of-experts model .* train.routing_replay=off"):
        from areal_like.data.tiny_model import build_tiny_model as build

        dense = build(os.path.join(os.path.dirname(path), "dense"))
        Trainer(dense, TrainConfig(routing_replay="rollout"), None, temperature=1.0)


def _post(url: str, body: dict):
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_the_embedded_server_returns_each_positions_routed_experts_as_sglang_does(moe_dirs, tmp_path):
    path = moe_dirs["qwen3_moe"]
    port = free_port()
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "areal_like.engine.server", "--model-path", path, "--port", str(port),
                             "--enable-return-routed-experts", "--torch-threads", "1"], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        from launcher.run import _wait_health

        _wait_health(url, 120, types.SimpleNamespace(proc=proc, tail=lambda: "", log_path=str(tmp_path)), "server")
        prompt = [1, 5, 9, 12, 7]
        status, replies = _post(url, {"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
                                      "sampling_params": {"max_new_tokens": 6, "n": 2, "temperature": 1.0}})
        assert status == 200
        model = _hf(path)
        caught: dict[int, torch.Tensor] = {}
        for layer, router in find_routers(model):
            router.register_forward_hook(lambda _m, _a, out, layer=layer: caught.__setitem__(layer, out[2]))
        for rep in replies:
            ids = prompt + rep["output_ids"]
            got = np.frombuffer(base64.b64decode(rep["meta_info"]["routed_experts"]), np.int32)
            got = got.reshape(len(ids) - 1, 2, 2)  # every position the server ran: [0, prompt + output − 1)
            with torch.no_grad():
                model(torch.tensor([ids[:-1]]))
            want = torch.stack([caught[0][:, :], caught[1][:, :]], 1).numpy()
            assert (np.sort(got, -1) == np.sort(want, -1)).all()
        # SGLang's own reader (its `extract_routed_experts_from_meta_info`) decodes the same ids (one interpreter for both)
        assert os.path.exists(SGLANG_PY), f"no SGLang conformance environment at {SGLANG_PY}: run scripts/setup.sh"
        code = (f"import json,sys; sys.path.insert(0, {os.path.join(ROOT, 'tests', 'conformance')!r}); "
                "import sglang_harness; sglang_harness._stub_torchvision(); "  # as the conformance harness does
                "from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info as f; "
                "print(json.dumps([f(r).tolist() for r in json.load(sys.stdin)]))")
        out = subprocess.run([SGLANG_PY, "-c", code], input=json.dumps(replies), capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout) == [np.frombuffer(base64.b64decode(
            r["meta_info"]["routed_experts"]), np.int32).tolist() for r in replies]
        # from a start position: positions [start, prompt + output − 1)
        status, rep = _post(url, {"input_ids": prompt, "return_routed_experts": True, "routed_experts_start_len": 3,
                                  "sampling_params": {"max_new_tokens": 4}})
        assert status == 200 and len(base64.b64decode(rep["meta_info"]["routed_experts"])) == \
            (5 + len(rep["output_ids"]) - 1 - 3) * 2 * 2 * 4
        status, err = _post(url, {"input_ids": prompt, "return_routed_experts": True, "routed_experts_start_len": 6,
                                  "sampling_params": {"max_new_tokens": 1}})
        assert status == 400 and "routed_experts_start_len=6 must be in [0, 5]" in err["error"]["message"]
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
