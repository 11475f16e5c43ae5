"""The model runner's slot KV cache against a plain full forward: rows join and leave at different
steps, n samples share one prefill row, and every logprob equals the learner's recomputation."""

import pytest
import torch

from areal_like.engine.runner import FINISH_LENGTH, FINISH_STOP, RUNNING, ModelRunner, Seq
from areal_like.learner.logprobs import token_logprobs_from_logits


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    torch.set_num_threads(1)
    return ModelRunner(tiny_model_dir, max_batch_size=6, max_context_len=128, max_prefill_tokens=16)


def drive(runner, schedule, max_steps=200):
    """schedule: {step: [seqs to admit]}; runs until every row finished; returns finish code per seq."""
    fins, drop = {}, []
    for step in range(max_steps):
        out = runner.step(schedule.get(step, []), drop)
        drop = []
        for s, tok, lp, fin in zip(out.seqs, out.tokens, out.logprobs, out.finish):
            s.output_ids.append(tok)
            s.output_logprobs.append(lp)
            if fin != RUNNING:
                fins[s.rid] = fin
                drop.append(s)
        if not runner.rows and step >= max(schedule):
            runner.release(drop)
            return fins
    raise AssertionError("did not finish")


def reference_logprobs(runner, s):
    ids = torch.tensor([s.prompt_ids + s.output_ids])
    with torch.no_grad():
        logits = runner.model(input_ids=ids).logits
    P = len(s.prompt_ids)
    return token_logprobs_from_logits(logits[:, P - 1:-1], ids[:, P:], s.temperature)[0]


def test_rows_join_and_leave_and_match_a_full_forward(runner):
    mk = lambda rid, p, n, **kw: Seq(rid=rid, prompt_ids=p, max_new_tokens=n, seed=hash(rid) % 1000, **kw)  # noqa: E731
    a = mk("a", [5, 6, 7], 30, temperature=0.8)
    b = mk("b", [9, 10, 11, 12, 13, 14, 15], 5, temperature=0.0)
    g = [mk(f"g{i}", [20, 21, 22, 23], 12 + 4 * i) for i in range(3)]  # one prompt, three samples
    c = mk("c", list(range(30, 60)), 20, top_k=5, top_p=0.9)  # longer than the prefill token budget
    fins = drive(runner, {0: [a, b], 3: g, 4: [c]})
    assert set(fins.values()) == {FINISH_LENGTH}
    assert [len(s.output_ids) for s in (a, b, *g, c)] == [30, 5, 12, 16, 20, 20]
    assert g[1].cached_tokens == 4 and g[0].cached_tokens == 0
    assert len({tuple(s.output_ids[:12]) for s in g}) > 1  # shared prefill, separate random streams
    for s in (a, b, *g, c):
        got = torch.tensor(s.output_logprobs)
        assert (got - reference_logprobs(runner, s)).abs().max() < 1e-4, s.rid
    # greedy row equals argmax decoding of the full model
    ids = list(b.prompt_ids)
    with torch.no_grad():
        for _ in range(5):
            ids.append(int(runner.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert b.output_ids == ids[len(b.prompt_ids):]
    assert runner.rows == [] and runner.slot_of == {}


def test_batch_composition_does_not_change_a_seeded_row(runner):
    alone = Seq(rid="x", prompt_ids=[3, 4], max_new_tokens=15, seed=42)
    drive(runner, {0: [alone]})
    crowd = [Seq(rid=f"o{i}", prompt_ids=[7 + i], max_new_tokens=3 + 5 * i, seed=i) for i in range(4)]
    again = Seq(rid="x2", prompt_ids=[3, 4], max_new_tokens=15, seed=42)
    drive(runner, {0: crowd[:2], 1: [again], 2: crowd[2:]})
    assert again.output_ids == alone.output_ids


def test_min_new_tokens_masks_stop_ids_and_penalties(runner):
    # stop on whatever greedy decoding emits first: min_new_tokens must push the stop later
    probe = Seq(rid="p", prompt_ids=[5, 6], max_new_tokens=8, temperature=0.0)
    drive(runner, {0: [probe]})
    first = probe.output_ids[0]
    s = Seq(rid="m", prompt_ids=[5, 6], max_new_tokens=8, temperature=0.0, stop_ids=(first,), min_new_tokens=4)
    fins = drive(runner, {0: [s]})
    assert first not in s.output_ids[:3]
    assert fins["m"] == FINISH_LENGTH or (fins["m"] == FINISH_STOP and len(s.output_ids) >= 4)
    # a strong presence penalty forbids repeats under greedy decoding
    r = Seq(rid="r", prompt_ids=[5, 6], max_new_tokens=20, temperature=0.0, presence_penalty=100.0)
    drive(runner, {0: [r]})
    assert len(set(r.output_ids)) == 20
    # logprobs keep the shared definition (raw logits), whatever shaped the sampling
    assert (torch.tensor(r.output_logprobs) - reference_logprobs(runner, r)).abs().max() < 1e-4


def test_bfloat16_runner_matches_its_own_full_forward(tiny_model_dir):
    r = ModelRunner(tiny_model_dir, dtype="bfloat16", max_batch_size=3, max_context_len=64)
    seqs = [Seq(rid=f"b{i}", prompt_ids=[5 + i, 6, 7], max_new_tokens=6 + 3 * i, seed=i) for i in range(3)]
    drive(r, {0: seqs[:2], 2: seqs[2:]})
    for s in seqs:
        # bf16 rounding differs between one-token decode and a full forward; the definition is the same
        assert (torch.tensor(s.output_logprobs) - reference_logprobs(r, s)).abs().max() < 0.1
