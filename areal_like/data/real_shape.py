"""A real architecture at random initialisation, with a real tokenizer, and gsm8k-style chat data.

`demo:qwen3-0.6b-shape` is Qwen3-0.6B's published config (written here, below) at random init, in
fp32 safetensors (the learner's master; servers cast to `server.dtype` when they load), with Qwen3's
real tokenizer and chat template (`tiny_model.copy_qwen3_tokenizer`): 596 M parameters, 151,936
vocabulary rows, tied embeddings — what memory, speed, weight pushes and the training–inference
mismatch are measured on (benchmarks/real_shape_run.py). Its outputs are noise: nothing learns.

`demo:gsm8k-style` (and `-val`): synthetic grade-school word problems in verl's gsm8k format — a chat
prompt ending in verl's instruction `Let's think step by step and output the final answer after
"####".`, data_source `openai/gsm8k`, the number as `reward_model.ground_truth` — so the built-in
gsm8k scorer and the chat template run as they do on the real dataset.

Both are built once into the demo cache (`demo_task.resolve_demo_name`), written to a temporary name and
renamed, like the other demo assets.
"""

from __future__ import annotations

import random

from areal_like.data.publish import build_model_dir_atomic, write_parquet_atomic

# Qwen3-0.6B's config.json as published (Qwen/Qwen3-0.6B on the HF hub), dtype aside: fp32 here.
QWEN3_0_6B: dict = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, attention_dropout=0.0,
    bos_token_id=151643, eos_token_id=151645, head_dim=128, hidden_act="silu", hidden_size=1024,
    initializer_range=0.02, intermediate_size=3072, max_position_embeddings=40960, max_window_layers=28,
    num_attention_heads=16, num_hidden_layers=28, num_key_value_heads=8, rms_norm_eps=1e-06, rope_scaling=None,
    rope_theta=1000000, sliding_window=None, tie_word_embeddings=True, use_cache=True, use_sliding_window=False,
    vocab_size=151936, torch_dtype="float32",
)

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's gsm8k.py


def build_real_shape_model(out_dir: str, config: dict | None = None, *, seed: int = 0) -> str:
    """Qwen3's tokenizer and a random-init model of `config` (default Qwen3-0.6B's) in `out_dir` (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from areal_like.data.tiny_model import copy_qwen3_tokenizer

    cfg = dict(config or QWEN3_0_6B)
    tok = copy_qwen3_tokenizer(out_dir)
    conf = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    conf.architectures = cfg.get("architectures")
    conf.pad_token_id = tok.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.pad_token_id]  # <|im_end|>, <|endoftext|>
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


_NAMES = ("Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Randy")
_ITEMS = ("clips", "apples", "books", "marbles", "stickers", "pencils", "cookies", "stamps")


def gsm8k_style_example(rng: random.Random) -> tuple[str, int]:
    """One word problem (two or three steps of + − ×) and its answer."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 9)
    kind = rng.randrange(3)
    if kind == 0:
        q = (f"{name} had {a} {item}. {name} bought {b} more and then gave away {min(c, a + b)}. "
             f"How many {item} does {name} have now?")
        return q, a + b - min(c, a + b)
    if kind == 1:
        q = f"{name} buys {c} boxes of {item} with {b} {item} in each box. How many {item} is that in total?"
        return q, b * c
    q = (f"{name} has {a} {item} and a friend has {c} times as many. "
         f"How many {item} do they have together?")
    return q, a + a * c


def build_gsm8k_style(out_path: str, n: int = 512, seed: int = 0, split: str = "train") -> str:
    """`n` gsm8k-style chat prompts as verl-format parquet at `out_path`."""
    import pyarrow as pa

    rng = random.Random(seed)
    rows = [gsm8k_style_example(rng) for _ in range(n)]
    table = pa.table({
        "prompt": [[{"role": "user", "content": f"{q} {GSM8K_INSTRUCTION}"}] for q, _ in rows],
        "data_source": ["openai/gsm8k"] * n,
        "reward_model": [{"ground_truth": str(a), "style": "rule"} for _, a in rows],
        "extra_info": [{"index": i, "split": split} for i in range(n)],
    })
    return write_parquet_atomic(table, out_path)


def ensure_real_shape_model(model_dir: str) -> str:
    """`build_real_shape_model` into `model_dir` unless it holds a model (temporary dir, then rename)."""
    return build_model_dir_atomic(model_dir, build_real_shape_model, prefix=".real_shape.")
