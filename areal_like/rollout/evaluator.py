"""Validation during training: the evaluator answers the learner's requests (buffer/eval_channel.py).

    learner: push v → request(v, s) ─► evaluator (a task inside rollout worker 0):
        every validation prompt × eval.n samples on the generation servers (concurrently, at
        eval.temperature / eval.top_p, seeds derived from v) → reward_fn.score → aggregate → publish
    learner: train meanwhile → collect(v) before pushing v+1 → metrics.jsonl row (`val/…`), Prometheus

The servers hold version v for the whole evaluation (the learner does not push while one is pending),
so `val/version_mismatch_tokens` — generated tokens whose per-token version is not v — should be 0.
The evaluator takes no staleness-gate slot and never writes to the replay stream.

Results (`aggregate` is the pure part): for each data_source and for `all` prompts,
    val/<ds>/mean@<n>   mean over prompts of the prompt's mean reward over its samples
    val/<ds>/pass@<n>   fraction of prompts with at least one sample whose reward ≥ eval.pass_threshold
plus val/version, val/step, val/prompts, val/samples, val/failed_samples, val/seconds,
val/version_mismatch_tokens. A sample whose generation or reward failed is left out (counted in
val/failed_samples); an evaluation that crashed as a whole is answered with its error.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

from areal_like.api.config import EvalConfig, GenerationConfig
from areal_like.api.workflow import PromptRecord
from areal_like.workflow.rlvr import sample_seed


def aggregate(samples: Iterable[tuple[str, str, float]], n: int, pass_threshold: float = 1.0) -> dict[str, float]:
    """(data_source, prompt_id, reward) per scored sample → {val/<ds>/mean@n, val/<ds>/pass@n} for every
    data_source and for `all`. mean@n = mean over prompts of each prompt's mean reward (= the sample
    mean when every prompt has n samples); pass@n = fraction of prompts with a reward ≥ pass_threshold.
    Empty input → {}. Pure."""
    by_prompt: dict[tuple[str, str], list[float]] = defaultdict(list)
    for ds, pid, reward in samples:
        by_prompt[(ds, pid)].append(float(reward))
    if not by_prompt:
        return {}
    per_ds: dict[str, list[tuple[float, bool]]] = defaultdict(list)
    for (ds, _), rewards in by_prompt.items():
        per_ds[ds].append((sum(rewards) / len(rewards), max(rewards) >= pass_threshold))
    per_ds["all"] = [x for ds in list(per_ds) for x in per_ds[ds]]
    out: dict[str, float] = {}
    for ds in sorted(per_ds):
        prompts = per_ds[ds]
        out[f"val/{ds}/mean@{n}"] = sum(m for m, _ in prompts) / len(prompts)
        out[f"val/{ds}/pass@{n}"] = sum(1 for _, p in prompts if p) / len(prompts)
    return out


def _print_log(msg: str) -> None:
    print(f"[rollout0] {msg}", flush=True)


class Evaluator:
    """Answers validation requests with the weights the servers hold. See the module doc.

    `client` is the rollout worker's `GenerationClient`, `reward_fn` its `RewardFn`, `dataset` the
    validation prompts (a `PromptDataset` or any sequence of `PromptRecord`), `channel` an `EvalChannel`.
    """

    def __init__(self, client, reward_fn, tokenizer, dataset: Sequence[PromptRecord], eval_cfg: EvalConfig,
                 gen_cfg: GenerationConfig, channel, *, seed: int = 1, max_concurrency: int = 512,
                 log: Callable[[str], None] | None = None, runner=None) -> None:
        self.client = client
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer
        records = list(dataset)
        self.prompts = records[: eval_cfg.max_prompts] if eval_cfg.max_prompts else records
        self.eval_cfg = eval_cfg
        self.gen_cfg = gen_cfg
        self.channel = channel
        self.seed = seed
        self.max_new_tokens = eval_cfg.max_new_tokens or gen_cfg.max_new_tokens
        self._sem = asyncio.Semaphore(max_concurrency)  # bounds requests, not the answer (all are awaited)
        self.log = log or _print_log
        stop = list(gen_cfg.stop_token_ids)  # as RLVRWorkflow: the configured stop ids plus the EOS
        eos = tokenizer.eos_token_id
        if eos is not None and eos not in stop:
            stop.append(int(eos))
        self.stop_token_ids = stop
        self.evaluated = 0  # evaluations answered (for tests and the log)
        self.runner = runner
        """The rollout worker's WorkflowRunner: prompts whose workflow is not single-turn `rlvr` (multi-turn,
        tools, agents) are validated through it — a whole episode per sample, scored as in training."""
        g = gen_cfg
        self.episode_gen = GenerationConfig(n=eval_cfg.n, max_new_tokens=self.max_new_tokens,
                                            temperature=eval_cfg.temperature, top_p=eval_cfg.top_p, top_k=g.top_k,
                                            stop_token_ids=list(g.stop_token_ids))

    def _multi_turn(self, record: PromptRecord) -> bool:
        return self.runner is not None and self.runner.workflow_name(record) != "rlvr"

    async def _episode(self, record: PromptRecord, version: int) -> list[tuple[float, int, int]]:
        """eval.n samples of `record` through its workflow (one group): (reward, generated tokens,
        generated tokens whose version ≠ `version`) each; [] if the workflow skipped the prompt."""
        tag = f"val-v{version}-{record.prompt_id}"  # the group id: seeds derive from it (reproducible)
        async with self._sem:
            group = await self.runner.run_group(record, tag, gen=self.episode_gen, keep_info=False)
        out = []
        for t in (group.trajectories if group is not None else []):
            gen = t.mask_np().astype(bool)
            versions = t.versions_np()[gen]
            out.append((float(t.reward), int(gen.sum()), int((versions != version).sum())))
        return out

    async def _sample(self, record: PromptRecord, version: int, i: int) -> tuple[float, int, int]:
        """(reward, generated tokens, tokens whose version ≠ `version`) of one sample."""
        e = self.eval_cfg
        tag = f"val-v{version}-{record.prompt_id}"
        async with self._sem:
            res = await self.client.generate(
                record.input_ids, max_new_tokens=self.max_new_tokens, temperature=e.temperature, top_p=e.top_p,
                top_k=self.gen_cfg.top_k, stop_token_ids=self.stop_token_ids,
                sampling_seed=sample_seed(self.seed, tag, i), rid=f"{tag}-{i}-{time.monotonic_ns()}", key=tag)
        text = self.tokenizer.decode(res.output_ids, skip_special_tokens=True)
        reward = await self.reward_fn.score(record.data_source, text, record.ground_truth, record.extra_info,
                                            question=record.question, key=tag)
        mismatch = sum(1 for v in res.output_versions if v != version)
        return float(reward), len(res.output_ids), mismatch

    async def evaluate(self, version: int, step: int) -> dict[str, float]:
        """Every prompt × eval.n samples, scored and aggregated (the dict that is published)."""
        t0 = time.monotonic()
        n = self.eval_cfg.n
        single = [r for r in self.prompts if not self._multi_turn(r)]
        episodic = [r for r in self.prompts if self._multi_turn(r)]
        jobs = [(r, i) for r in single for i in range(n)]
        outs = await asyncio.gather(*(self._sample(r, version, i) for r, i in jobs), return_exceptions=True)
        if episodic:  # a whole group per prompt: its samples succeed or fail together
            groups = await asyncio.gather(*(self._episode(r, version) for r in episodic), return_exceptions=True)
            for rec, g in zip(episodic, groups):
                if isinstance(g, BaseException):
                    jobs += [(rec, i) for i in range(n)]
                    outs += [g] * n
                else:
                    jobs += [(rec, i) for i in range(len(g))]
                    outs += list(g)
        scored: list[tuple[str, str, float]] = []
        failed = mismatch = tokens = 0
        first_error: BaseException | None = None
        for (rec, _), out in zip(jobs, outs):
            if isinstance(out, asyncio.CancelledError):
                raise out
            if isinstance(out, BaseException):
                failed += 1
                first_error = first_error or out
                continue
            reward, ntok, mm = out
            scored.append((rec.data_source, rec.prompt_id, reward))
            tokens += ntok
            mismatch += mm
        if jobs and not scored:
            raise RuntimeError(f"every one of {len(jobs)} validation samples failed; first: "
                               f"{type(first_error).__name__}: {first_error}")
        if failed:
            self.log(f"validation of version {version}: {failed}/{len(jobs)} samples failed (left out); first: "
                     f"{type(first_error).__name__}: {first_error}")
        res = aggregate(scored, n, self.eval_cfg.pass_threshold)
        res.update({
            "val/version": float(version), "val/step": float(step), "val/prompts": float(len(self.prompts)),
            "val/samples": float(len(scored)), "val/failed_samples": float(failed),
            "val/generated_tokens": float(tokens), "val/version_mismatch_tokens": float(mismatch),
            "val/seconds": time.monotonic() - t0,
        })
        return res

    async def run(self, stop_event: asyncio.Event) -> None:
        """Answer requests until `stop_event` is set (or the task is cancelled)."""
        last = -1
        while not stop_event.is_set():
            req = await self.channel.next_request_async(last)
            if req is None:
                continue
            version, step = req
            try:
                res = await self.evaluate(version, step)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # answer with the error: the learner fails fast instead of timing out
                self.log(f"validation of version {version} (step {step}) failed: {type(e).__name__}: {e}")
                await self.channel.publish_async(version, {}, error=f"{type(e).__name__}: {e}")
                last = version
                continue
            await self.channel.publish_async(version, res)
            last = version
            self.evaluated += 1
            n = self.eval_cfg.n
            self.log(f"validated version {version} (step {step}): mean@{n} {res.get(f'val/all/mean@{n}', 0.0):.3f} "
                     f"pass@{n} {res.get(f'val/all/pass@{n}', 0.0):.3f} over {len(self.prompts)} prompts "
                     f"({int(res['val/samples'])} samples, {res['val/seconds']:.2f} s"
                     + (f", {int(res['val/version_mismatch_tokens'])} tokens of another version" if
                        res["val/version_mismatch_tokens"] else "") + ")")

