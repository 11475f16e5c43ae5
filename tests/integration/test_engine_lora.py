"""Runtime LoRA serving in the embedded server (--enable-lora): peft adapters loaded from disk, mixed
adapters in one batch, SGLang's LoRA routes and errors, full-weight updates on a LoRA server."""

import asyncio
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_like.learner.logprobs import token_logprobs_from_logits

from test_engine_server import get, post

pytestmark = pytest.mark.integration

ADMIN = "admin-key"
H = {"Authorization": f"Bearer {ADMIN}"}
TARGETS = ["q_proj", "v_proj", "down_proj"]


def make_adapter(model_dir: str, out_dir: str, *, r: int, alpha: float, targets, seed: int) -> str:
    """A peft adapter with random lora_B (so it changes outputs), saved as peft saves it."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pm = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                                         task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n or "lora_A" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    pm.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(tiny_model_dir, str(d / "a"), r=4, alpha=8, targets=["q_proj", "v_proj"], seed=1),
        "b": make_adapter(tiny_model_dir, str(d / "b"), r=2, alpha=4, targets=TARGETS, seed=2),
        "big": make_adapter(tiny_model_dir, str(d / "big"), r=16, alpha=16, targets=["q_proj"], seed=3),
    }


@pytest.fixture(scope="module")
def lora_server(engine_servers, tiny_model_dir):
    (srv,) = engine_servers(tiny_model_dir, 1, "--admin-api-key", ADMIN, "--enable-lora", "--max-lora-rank", "8",
                            "--lora-target-modules", *TARGETS, "--max-loras-per-batch", "2", "--max-loaded-loras", "3")
    return srv


@pytest.fixture(scope="module")
def plain_server(engine_servers, tiny_model_dir):
    (srv,) = engine_servers(tiny_model_dir, 1, "--admin-api-key", ADMIN)
    return srv


def reference_logprobs(model_dir, adapter_dir, prompt, out, temperature):
    """Logprobs of `out` after `prompt` computed by peft's own model (fp32), or the base model."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return token_logprobs_from_logits(logits[:, len(prompt) - 1:-1], ids[:, len(prompt):], temperature)[0]


def gen(prompt, lora=None, n=8, rid=None, **extra):
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0.9, "ignore_eos": True, "sampling_seed": 3}}
    if lora is not None:
        body["lora_path"] = lora
    if rid:
        body["rid"] = rid
    body.update(extra)
    return body


def lps(r):
    return torch.tensor([t[0] for t in r["meta_info"]["output_token_logprobs"]])


async def load(url, name, path):
    return await post(url, "/load_lora_adapter", {"lora_name": name, "lora_path": path}, headers=H)


async def test_lora_routes_errors_and_mixed_batches(lora_server, tiny_model_dir, adapters):
    url = lora_server.url
    st, r = await load(url, "A", adapters["a"])
    assert st == 200 and r == {"success": True, "error_message": None, "loaded_adapters": {"A": adapters["a"]}}
    st, r = await load(url, "B", adapters["b"])
    assert st == 200 and r["loaded_adapters"] == {"A": adapters["a"], "B": adapters["b"]}

    # errors: duplicate, rank too big, missing dir, unknown name — nothing changes
    st, r = await load(url, "A", adapters["b"])
    assert st == 400 and r["success"] is False
    assert r["error_message"] == "Failed to load LoRA adapter A because it is already loaded"
    st, r = await load(url, "BIG", adapters["big"])
    assert st == 400 and "exceeds the server's --max-lora-rank 8" in r["error_message"]
    st, r = await load(url, "X", "/nonexistent/adapter")
    assert st == 400 and "adapter_config.json" in r["error_message"]
    assert r["loaded_adapters"] == {"A": adapters["a"], "B": adapters["b"]}
    st, r = await post(url, "/unload_lora_adapter", {"lora_name": "nope"}, headers=H)
    assert st == 400 and r["error_message"] == "LoRA with name nope does not exist"
    st, r = await post(url, "/generate", gen([5, 6], "nope"))
    assert st == 400 and r["error"]["message"] == "Got LoRA adapter that has never been loaded: nope"
    st, info = await get(url, "/server_info", headers=H)
    info = __import__("json").loads(info)
    assert info["enable_lora"] is True and info["max_lora_rank"] == 8 and info["lora_target_modules"] == TARGETS
    assert info["max_loras_per_batch"] == 2 and info["loaded_lora_adapters"] == {"A": adapters["a"],
                                                                                  "B": adapters["b"]}

    # one mixed batch: base, A, B, A (different prompts) at once
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [5, 6, 7]]
    loras = [None, "A", "B", "A"]
    reps = await asyncio.gather(*(post(url, "/generate", gen(p, lo, rid=f"mix{i}"))
                                  for i, (p, lo) in enumerate(zip(prompts, loras))))
    for (st, r), p, lo in zip(reps, prompts, loras):
        assert st == 200, r
        ref = reference_logprobs(tiny_model_dir, adapters[lo.lower()] if lo else None, p, r["output_ids"], 0.9)
        assert (lps(r) - ref).abs().max() < 1e-4, lo
    # the adapter changes outputs: the same prompt under A and under the base model differ
    ref_base = reference_logprobs(tiny_model_dir, None, prompts[3], reps[3][1]["output_ids"], 0.9)
    assert (lps(reps[3][1]) - ref_base).abs().max() > 1e-3
    # a batch request with the list form, input logprobs under the adapter
    st, r = await post(url, "/generate", gen([7, 8, 9], ["B"], logprob_start_len=0))
    assert st == 200
    ref = reference_logprobs(tiny_model_dir, adapters["b"], [7], [8, 9], 1.0)
    got = torch.tensor([t[0] for t in r["meta_info"]["input_token_logprobs"][1:]])
    assert (got - ref).abs().max() < 1e-4

    # unload, then load the same name from another dir: new outputs
    st, r = await post(url, "/unload_lora_adapter", {"lora_name": "A"}, headers=H)
    assert st == 200 and r["loaded_adapters"] == {"B": adapters["b"]}
    st, r = await post(url, "/generate", gen([8, 9], "A"))
    assert st == 400 and "never been loaded: A" in r["error"]["message"]
    st, r = await load(url, "A", adapters["b"])
    assert st == 200
    st, r = await post(url, "/generate", gen([8, 9], "A"))
    assert st == 200
    ref = reference_logprobs(tiny_model_dir, adapters["b"], [8, 9], r["output_ids"], 0.9)
    assert (lps(r) - ref).abs().max() < 1e-4

    # a request held by a pause resolves its name after the pause
    assert (await post(url, "/pause_generation", {"mode": "abort"}, headers=H))[0] == 200
    held = asyncio.ensure_future(post(url, "/generate", gen([8, 9], "A", rid="held")))
    await asyncio.sleep(0.3)
    assert (await post(url, "/unload_lora_adapter", {"lora_name": "A"}, headers=H))[0] == 200
    assert (await load(url, "A", adapters["a"]))[0] == 200
    assert (await post(url, "/continue_generation", {}, headers=H))[0] == 200
    st, r = await held
    assert st == 200
    ref = reference_logprobs(tiny_model_dir, adapters["a"], [8, 9], r["output_ids"], 0.9)
    assert (lps(r) - ref).abs().max() < 1e-4

    # --max-loaded-loras 3: a fourth name is refused
    assert (await load(url, "C", adapters["a"]))[0] == 200
    st, r = await load(url, "D", adapters["a"])
    assert st == 400 and "--max-loaded-loras 3" in r["error_message"]
    assert (await post(url, "/unload_lora_adapter", {"lora_name": "C"}, headers=H))[0] == 200

    # /update_weight_version
    st, r = await post(url, "/update_weight_version", {"new_version": "7"}, headers=H)
    assert st == 200 and r == {"success": True, "message": "Weight version updated to 7", "new_version": "7"}
    st, r = await post(url, "/generate", gen([5], "B", n=2))
    assert st == 200 and r["meta_info"]["weight_version"] == "7"


async def test_full_weight_update_on_a_lora_server(lora_server, tiny_model_dir, adapters, tmp_path):
    url = lora_server.url
    # a different base checkpoint: the tiny model with perturbed weights
    new_dir = str(tmp_path / "base2")
    shutil.copytree(tiny_model_dir, new_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    for f in os.listdir(new_dir):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(new_dir, f))
    model.save_pretrained(new_dir)
    st, r = await post(url, "/update_weights_from_disk", {"model_path": new_dir, "weight_version": "w2"}, headers=H)
    assert st == 200 and r["success"] is True, r
    st, r = await post(url, "/get_weights_by_name", {"name": "model.layers.0.self_attn.q_proj.weight",
                                                      "truncate_size": 2}, headers=H)
    assert st == 200
    assert torch.allclose(torch.tensor(r), model.model.layers[0].self_attn.q_proj.weight[:2], atol=1e-6)
    for lo in (None, "B"):
        st, r = await post(url, "/generate", gen([5, 6, 7], lo))
        assert st == 200 and r["meta_info"]["weight_version"] == "w2"
        ref = reference_logprobs(new_dir, adapters["b"] if lo else None, [5, 6, 7], r["output_ids"], 0.9)
        assert (lps(r) - ref).abs().max() < 1e-4
    # back to the original base for the next test
    st, r = await post(url, "/update_weights_from_disk", {"model_path": tiny_model_dir}, headers=H)
    assert st == 200 and r["success"] is True


async def test_lora_disabled(plain_server, adapters):
    url = plain_server.url
    st, r = await post(url, "/generate", gen([5, 6], "A"))
    assert st == 400 and r["error"]["message"] == (
        "LoRA adapter 'A' was requested, but LoRA is not enabled. Please launch the server with --enable-lora flag "
        "and preload adapters using --lora-paths or /load_lora_adapter endpoint.")
    st, r = await load(url, "A", adapters["a"])
    assert st == 400 and r == {"success": False, "loaded_adapters": {},
                               "error_message": "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."}
    st, r = await post(url, "/generate", gen([5, 6], None, lora_path=None))
    assert st == 200


def test_lora_flags_are_required():
    from areal_like.engine.server import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model-path", "x", "--enable-lora", "--lora-target-modules", "q_proj"])
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "x", "--enable-lora", "--max-lora-rank", "8"])
    a = parse_args(["--model-path", "x", "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"])
    assert a.lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert a.max_loaded_loras == a.max_loras_per_batch == 8


async def test_load_lora_adapter_from_distributed(lora_server, tiny_model_dir, adapters):
    """Two buckets over the gloo weight group (per-tensor, then a flattened bucket that sets the
    version) become adapter "P"; a bad last bucket changes nothing."""
    import json

    from conftest import free_port

    from areal_like.weights.adapter import read_adapter_config, read_adapter_tensors
    from areal_like.weights.group import init_weight_group

    url = lora_server.url
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = free_port()
    init = asyncio.ensure_future(post(url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "lora_g", "backend": "gloo"}, headers=H))
    group = await asyncio.to_thread(init_weight_group, master_address="127.0.0.1", master_port=port, world_size=2,
                                    rank=0, group_name="lora_g", backend="gloo", timeout_s=60)
    assert (await init)[1]["success"] is True
    cfg = read_adapter_config(adapters["b"], "x")
    tensors = sorted(read_adapter_tensors(adapters["b"], "x").items())
    half = len(tensors) // 2

    async def push(items, version, flat, config=cfg):
        body = {"names": [n for n, _ in items], "dtypes": ["float32"] * len(items),
                "shapes": [list(t.shape) for _, t in items], "group_name": "lora_g",
                "load_format": "flattened_bucket" if flat else None, "weight_version": version,
                "lora_name": "P", "config_dict": config}
        fut = asyncio.ensure_future(post(url, "/load_lora_adapter_from_distributed", body, headers=H))
        await asyncio.sleep(0.05)
        if flat:
            buf = torch.cat([t.float().contiguous().view(-1).view(torch.uint8) for _, t in items])
            await asyncio.to_thread(group.broadcast, buf, 0)
        else:
            for _, t in items:
                await asyncio.to_thread(group.broadcast, t.float().contiguous(), 0)
        return await fut

    try:
        st, r = await push(tensors[:half], None, False)
        assert st == 200 and r["success"] is True and "P" not in r["loaded_adapters"]
        st, r = await push(tensors[half:], "lora-1", True)
        assert st == 200 and r["success"] is True and "P" in r["loaded_adapters"], r
        st, r = await post(url, "/generate", gen([5, 6, 7], "P"))
        assert st == 200 and r["meta_info"]["weight_version"] == "lora-1"
        ref = reference_logprobs(tiny_model_dir, adapters["b"], [5, 6, 7], r["output_ids"], 0.9)
        assert (lps(r) - ref).abs().max() < 1e-4
        # a rank over --max-lora-rank in the last bucket: 400, "P" and the version unchanged
        st, r = await push(tensors, "lora-2", True, dict(cfg, r=32))
        assert st == 400 and "exceeds the server's --max-lora-rank" in r["error_message"]
        st, info = await get(url, "/server_info", headers=H)
        assert json.loads(info)["weight_version"] == "lora-1"
    finally:
        await post(url, "/destroy_weights_update_group", {"group_name": "lora_g"}, headers=H)
        group.destroy()
