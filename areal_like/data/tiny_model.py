"""Build tiny HF models and a character-level tokenizer locally — nothing is downloaded from a hub.

`build_char_tokenizer(dir)` writes a `PreTrainedTokenizerFast` (one token per character, special
tokens `<pad>`, `<bos>`, `<eos>`, `<unk>`, a chat template) that `AutoTokenizer.from_pretrained`
loads. `build_tiny_model(dir, …)` writes a randomly initialised Qwen2 or Llama causal LM in
safetensors next to that tokenizer, so the directory is a complete HF model repo.
"""

from __future__ import annotations

import os
import string

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Printable ASCII without the rarely needed characters keeps the vocabulary (and the demo) small.
CHARSET = string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/=?:.,()[]<>|#_\n"

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}#S:{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}#U:{{ m['content'] }}\n"
    "{% elif m['role'] == 'tool' %}#T:{{ m['content'] }}\n"
    "{% else %}#A:{{ m['content'] }}<eos>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}#A:{% endif %}"
)


def char_vocab() -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARSET:
        vocab.setdefault(ch, len(vocab))
    return vocab


def build_char_tokenizer(out_dir: str):
    """Write a character-level fast tokenizer to `out_dir` and return it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Special tokens are matched whole first (added tokens), then every other character is one token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(
    out_dir: str,
    *,
    arch: str = "qwen2",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> str:
    """Write a random tiny causal LM + char tokenizer to `out_dir` (HF layout, safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = build_char_tokenizer(out_dir)
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    if arch == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        raise ValueError(f"unknown tiny-model arch {arch!r}: use 'qwen2' or 'llama'")
    torch.manual_seed(seed)
    model = cls(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
