"""The real-shape demo assets (issue 26): Qwen3-0.6B's published config written in code, a model of that
architecture with Qwen3's real tokenizer, and gsm8k-style chat data in verl's format that the built-in
gsm8k scorer reads. The full-size model runs in benchmarks/real_shape_run.py; here a scaled-down
copy of the same architecture is built and loaded."""

from __future__ import annotations

import pytest

from allocation.memory import ModelShape
from areal_like.data.dataset import PromptDataset
from areal_like.data.real_shape import GSM8K_INSTRUCTION, QWEN3_0_6B, build_gsm8k_style, build_real_shape_model
from areal_like.reward import default_compute_score


def test_qwen3_0_6b_config_has_the_published_size():
    shape = ModelShape.from_config(QWEN3_0_6B)
    assert shape.count_params() == 596_049_920  # Qwen3-0.6B: 0.6 B, 0.44 B without the embedding
    assert shape.count_params() - 151936 * 1024 == 440_467_456


def test_scaled_down_model_loads_with_qwen3s_tokenizer_and_the_data_renders(tmp_path):
    from transformers import AutoModelForCausalLM

    small = dict(QWEN3_0_6B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    d = build_real_shape_model(str(tmp_path / "m"), small)
    m = AutoModelForCausalLM.from_pretrained(d)
    assert type(m).__name__ == "Qwen3ForCausalLM" and m.config.vocab_size == 151936
    assert m.config.tie_word_embeddings and m.config.pad_token_id == 151643
    f = build_gsm8k_style(str(tmp_path / "train.parquet"), n=16, seed=0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    ds = PromptDataset([f], tok, max_prompt_length=256, apply_chat_template=True)
    assert len(ds.records) == 16
    r = ds.records[0]
    text = tok.decode(r.input_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\n") and text.endswith(f"{GSM8K_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
    assert r.data_source == "openai/gsm8k"
    assert default_compute_score("openai/gsm8k", f"so the answer is\n#### {r.ground_truth}", r.ground_truth) == 1.0


@pytest.mark.parametrize("seed", [0, 1])
def test_gsm8k_style_answers_follow_the_question(tmp_path, seed):
    import pyarrow.parquet as pq

    f = build_gsm8k_style(str(tmp_path / "t.parquet"), n=50, seed=seed)
    rows = pq.read_table(f).to_pylist()
    assert all(int(r["reward_model"]["ground_truth"]) >= 0 for r in rows)
    assert len({r["prompt"][0]["content"] for r in rows}) > 40
