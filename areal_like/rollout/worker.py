"""A rollout worker process: prompts → workflow → groups → replay buffer, under the staleness gate.

    for each prompt of this worker's shard (epoch after epoch):
        wait for a free local slot (rollout.max_concurrent_groups)
        wait for the global staleness gate  (Redis, atomic; unblocked when the learner bumps v)
        spawn: workflow.run_group(prompt)   (n samples on the servers, rewards)
                 ├─ ok     → buffer.add_group   (atomically: stream entry, accepted += 1, running −= 1)
                 └─ failed → gate.release        (the slot is freed; the prompt is retried: always after a
                                                  generation failure, once after the workflow raised or
                                                  returned a bad result, never after a timeout)

It never talks to the learner: the version key in Redis is the only thing it reads from it — except
that worker 0, when `data.val_files` is set, also runs the evaluator (rollout/evaluator.py) as a
concurrent task answering the learner's validation requests (buffer/eval_channel.py); it takes no
gate slot and writes nothing to the stream.
On SIGTERM it stops starting groups, cancels what is in flight and frees those slots.

Reward failures (reward/fn.py) score 0 and are counted by kind in the run's Redis counters
(reward/report.py). When more than `reward.max_failure_fraction` of the last `reward.failure_window`
scored samples failed, the worker stops as on SIGTERM and exits with EXIT_REWARD_FAILURES, its last
log line naming the reward function and the counts (the launcher shows it as the reason the run stopped).
Agent completions the proxy refused past `rollout.multi_turn.max_completions_per_episode` are counted
per accepted group: Prometheus `areal_like_rollout_agent_completions_refused`, the episode dump, and the
run's Redis counter `agent_completions_refused` (summary.json `buffer.agent_completions_refused`).

Workflow failures (rollout/failures.py): a group whose workflow raised, ran past
`rollout.episode_timeout_s` (cancelled, its slot freed) or returned something that is not a group
(WorkflowResultError, e.g. a reward "1.0") is counted by kind — Prometheus
`areal_like_rollout_workflow_failures{kind}`, the run's Redis counters `workflow_failures:<kind>`
(summary.json `buffer.workflow_failures`) — its prompt retried later, and the next group started after
a backoff that doubles per failure in a row. The first failure of each kind is logged with its
traceback, later ones only counted. When more than `rollout.max_failure_fraction` of the last
`rollout.failure_window` groups failed, the worker stops and exits with EXIT_WORKFLOW_FAILURES, its last
log line naming the workflow, the key and the first traceback.
Groups in flight when the worker is stopped are cancelled and counted: Redis `dropped_in_flight_at_stop`
(summary.json `buffer.dropped_in_flight_at_stop`), Prometheus `areal_like_rollout_dropped_in_flight_at_stop`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

from areal_like import metrics as M
from areal_like.api.config import decode_config
from areal_like.api.run_files import Endpoints

EXIT_REWARD_FAILURES = 3
EXIT_WORKFLOW_FAILURES = 4
EXIT_BAD_DATA = 5
"""Exit code of a worker whose data files cannot be used (no rows, every prompt longer than
data.max_prompt_length, a malformed cell): restarting it would fail the same way. `launcher run`'s
preflight catches most of these before anything starts; this is the rest (lengths need the tokenizer)."""
PROMPT_RETRIES = 1
"""Times a prompt whose workflow raised or returned a bad result is tried again (a timed-out one is not:
it would hold a slot for another rollout.episode_timeout_s; a generation failure always is)."""
"""Exit code of a worker that stopped because too many of its groups failed in the workflow
(rollout.max_failure_fraction; restarting it would not help)."""
GROUP_OUTCOMES = ("accepted", "duplicate", "skipped", "failed")
"""`areal_like_rollout_groups_total{outcome}`: accepted into the buffer, duplicate (its id was already
there), skipped (the workflow returned no group, e.g. dynamic sampling), failed (retried later)."""
"""Exit code of a worker that stopped because too many reward calls failed (restarting it would not help)."""


def assistant_turns(t) -> int:
    """Runs of trained (generated) tokens in a trajectory: its assistant turns."""
    m = t.mask_np()
    return int(m[0]) + int(((m[1:] == 1) & (m[:-1] == 0)).sum()) if len(m) else 0


def _log(k: int, msg: str) -> None:
    print(f"[rollout{k}] {msg}", flush=True)


async def run(run_dir: str, index: int, metrics_port: int | None, launch: str) -> int:
    from transformers import AutoTokenizer

    from areal_like.buffer.replay_buffer import ReplayBuffer
    from areal_like.data.dataset import PromptDataset
    from areal_like.api.config import LORA_ADAPTER_NAME
    from areal_like.engine.client import GenerationClient
    from areal_like.reward import RewardFn
    from areal_like.rollout.gate import StalenessGate

    with open(os.path.join(run_dir, "config.json"), "rb") as f:
        cfg = decode_config(f.read())
    # Started while the servers load (its imports and tokenizer overlap theirs): their URLs come once healthy.
    endpoints = await asyncio.to_thread(Endpoints.wait, run_dir, launch, max(cfg.server.health_timeout_s, 900.0) + 60.0)
    if metrics_port:
        M.serve(metrics_port)
    M.export_at_zero(M.ROLLOUT_GROUPS, GROUP_OUTCOMES)
    from areal_like.buffer.scripts import WORKFLOW_FAILURE_KINDS

    M.export_at_zero(M.WORKFLOW_FAILURES, WORKFLOW_FAILURE_KINDS)
    redis_url = os.environ["AREAL_LIKE_REDIS_URL"]
    n_workers = cfg.rollout.workers

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    try:
        dataset = PromptDataset(cfg.data.train_files, tokenizer, prompt_key=cfg.data.prompt_key,
                                max_prompt_length=cfg.data.max_prompt_length,
                                apply_chat_template=cfg.data.apply_chat_template)
    except ValueError as e:
        _log(index, f"exit {EXIT_BAD_DATA}: {e}")
        return EXIT_BAD_DATA
    prompts = dataset.iterate(seed=cfg.seed, shuffle=cfg.data.shuffle, shard=index, num_shards=n_workers)
    val_dataset = None
    if index == 0 and cfg.data.val_files:  # worker 0 also answers the learner's validation requests
        for i, path in enumerate(cfg.data.val_files):
            if not os.path.exists(path):
                raise FileNotFoundError(f"data.val_files[{i}]={path} does not exist: fix data.val_files=[…]")
        try:
            val_dataset = PromptDataset(cfg.data.val_files, tokenizer, prompt_key=cfg.data.prompt_key,
                                        max_prompt_length=cfg.data.max_prompt_length,
                                        apply_chat_template=cfg.data.apply_chat_template, key="data.val_files")
        except ValueError as e:
            _log(index, f"exit {EXIT_BAD_DATA}: {e}")
            return EXIT_BAD_DATA
    buffer = ReplayBuffer.from_config(cfg.buffer, url=redis_url)
    # One Redis endpoint for both: a Redis restart is noticed once and recovered in one fixed order.
    gate = StalenessGate.from_config(cfg.buffer, url=redis_url, batch_size=cfg.train.batch_size,
                                     max_staleness=cfg.rollout.max_staleness, endpoint=buffer.endpoint)
    reward_fn = RewardFn.from_config(cfg.custom_reward_function, cfg.reward)
    stop = asyncio.Event()
    from areal_like.reward.report import FailureReporter

    reward_report = FailureReporter(buffer, producer=f"rollout{index}", log=lambda msg: _log(index, msg))
    reward_fn.on_failure = reward_report.record
    reward_stop: list[str] = []  # the failure-fraction message, once

    def _reward_limit(msg: str) -> None:
        reward_stop.append(msg)
        _log(index, "stopping: more than reward.max_failure_fraction of the recent reward calls failed")
        stop.set()

    reward_fn.on_limit = _reward_limit
    if endpoints.judge_servers:  # the allocation's judge component (judge.*): its grades enter every reward
        from areal_like.reward.judge import Judge

        reward_fn.judge = Judge.from_config(cfg.judge, endpoints.judge_servers, api_key=cfg.server.api_key)
        _log(index, f"judge {cfg.judge.model_path} on {', '.join(endpoints.judge_servers)} (score_rule "
                    f"{cfg.judge.score_rule}; reward = {cfg.judge.rule_weight:g} × rule + {cfg.judge.weight:g} × judge)")
    teacher = None
    if endpoints.teacher_servers:  # the allocation's teacher component (teacher.*): on-policy distillation
        from areal_like.rollout.teacher import Teacher

        teacher = Teacher.from_config(cfg.teacher, endpoints.teacher_servers, api_key=cfg.server.api_key)
        _log(index, f"teacher {cfg.teacher.model_path} on {', '.join(endpoints.teacher_servers)} scores every sample "
                    f"(advantage = {cfg.teacher.reward_weight:g} × reward's − {cfg.teacher.kl_coef:g} × reverse KL)")
    report_task = asyncio.create_task(reward_report.run(stop), name="reward-failure-report")
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)

    # `launcher run` resolved a null max_concurrent_groups into config.json; resolved the same way here
    # otherwise (from the allocation's generation backend).
    from allocation import parse_allocation

    gen = parse_allocation(cfg.allocation).generation
    max_groups = cfg.resolved_max_concurrent_groups(num_servers=len(endpoints.servers),
                                                    sglang=gen is not None and gen.backend == "sglang")
    slots = asyncio.Semaphore(max_groups)
    inflight: set[asyncio.Task] = set()
    retry: list = []  # prompts whose group failed: tried again before new ones
    # A re-run of the same run dir continues this worker's group numbers and prompt order where the
    # last run stopped (saved in Redis after every group started): no group id is reused, so none is
    # generated only to be discarded as already trained.
    seq = 0
    cursor = await buffer.run.rollout_cursor_async(index)
    if cursor is not None:
        seq = int(cursor["seq"])
        prompts.load_state_dict(cursor["prompts"])
        _log(index, f"resuming at group w{index}-{seq}, epoch {prompts.epoch} position {prompts.position}")

    async with GenerationClient(endpoints.servers, request_timeout_s=cfg.rollout.request_timeout_s,
                                max_timeout_retries=cfg.rollout.request_retries, api_key=cfg.server.api_key,
                                lora_name=LORA_ADAPTER_NAME if cfg.model.lora_rank > 0 else None) as client:
        from areal_like.rollout.dump import DumpWriter
        from areal_like.rollout.workflows import WorkflowRunner

        tools = None
        if cfg.rollout.tools_config:
            from areal_like.tools import ToolSet

            tools = ToolSet.from_config(cfg.rollout.tools_config)
            _log(index, f"tools from rollout.tools_config={cfg.rollout.tools_config}: {', '.join(tools.names)}")
            M.export_at_zero(M.TOOL_CALLS, [(name, "ok") for name in tools.names])
        # rollout.workflow (built-in name or path/to/file.py:Name) and every row's agent_name, resolved now:
        # a bad file or name fails at start, naming the key or the row.
        workflow = WorkflowRunner(cfg, client, reward_fn, tokenizer, producer=f"rollout{index}", tools=tools)
        per_row = workflow.check_rows(dataset.records)
        _log(index, f"workflow {cfg.rollout.workflow}" + (f"; rows also use {', '.join(per_row)}" if per_row else ""))
        dump = None
        if cfg.rollout.dump_dir:  # a relative path is inside the run directory: every run its own dump
            dump = DumpWriter(os.path.join(run_dir, cfg.rollout.dump_dir), index, tokenizer)
            _log(index, f"dumping accepted groups to {dump.path}")

        from areal_like.api.workflow import WorkflowResultError
        from areal_like.engine.client import GenerationError
        from areal_like.rollout.failures import WorkflowFailures

        ro = cfg.rollout
        failures = WorkflowFailures(ro.workflow, max_failure_fraction=ro.max_failure_fraction,
                                    failure_window=ro.failure_window, timeout_s=ro.episode_timeout_s,
                                    log=lambda msg: _log(index, msg))
        workflow_stop: list[str] = []  # the failure-fraction message, once
        dropped_at_stop = [0]  # groups cancelled because the worker stopped
        failed_tries: dict[str, int] = {}  # prompt id → workflow failures in a row (retry bound)
        count_warned = [False]

        async def flush_failures() -> None:
            counts = failures.take_unflushed()
            if not counts:
                return
            try:
                await buffer.run.count_workflow_failures_async(counts)
                count_warned[0] = False
            except Exception as e:  # Redis away (restarting): keep them for the next flush
                failures.put_back(counts)
                if not count_warned[0]:
                    _log(index, f"could not count workflow failures in Redis ({type(e).__name__}: {e}); will retry")
                    count_warned[0] = True

        async def workflow_failed(kind: str, record, group_id: str, exc: BaseException | None) -> None:
            M.ROLLOUT_GROUPS.labels("failed").inc()
            M.WORKFLOW_FAILURES.labels(kind).inc()
            if failures.failed(kind, group_id, record.prompt_id, exc, workflow=workflow.workflow_name(record)):
                workflow_stop.append(failures.limit_message)
                _log(index, "stopping: more than rollout.max_failure_fraction of the recent groups failed in "
                            f"workflow {ro.workflow}")
                stop.set()
            await flush_failures()

        async def acquire_slot() -> bool:
            """A free local slot, or False once `stop` is set: with every slot held (groups hanging), a
            stop must still be seen — then the groups in flight are cancelled and counted."""
            if stop.is_set():
                return False
            acq, stopped = asyncio.ensure_future(slots.acquire()), asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({acq, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
                if not acq.done():
                    acq.cancel()
            if acq.done() and not acq.cancelled():
                if stop.is_set():
                    slots.release()
                    return False
                return True
            return False

        async def one(record, group_id: str) -> None:
            accepted = False
            try:
                # The episode, bounded by rollout.episode_timeout_s (None = no limit): past it the workflow
                # is cancelled, and the group counts as a failure of kind `timeout`.
                bound = asyncio.timeout(ro.episode_timeout_s)
                try:
                    async with bound:
                        group = await workflow.run_group(record, group_id)
                        if teacher is not None and group is not None:  # its logprobs of every sample's tokens
                            await teacher.score_group(group)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the workflow's failure: counted, the prompt retried after a backoff
                    kind = ("timeout" if isinstance(e, TimeoutError) and bound.expired() else
                            "bad_result" if isinstance(e, WorkflowResultError) else
                            "generation" if isinstance(e, GenerationError) else "exception")
                    tries = failed_tries.get(record.prompt_id, 0)
                    if kind == "generation" or (kind != "timeout" and tries < PROMPT_RETRIES):
                        failed_tries[record.prompt_id] = tries + 1
                        retry.append(record)
                    else:  # a prompt that hangs (or keeps failing) would take the slots again and again
                        failed_tries.pop(record.prompt_id, None)
                    await workflow_failed(kind, record, group_id, e)
                    return
                failures.ok()
                failed_tries.pop(record.prompt_id, None)
                if group is None:
                    M.ROLLOUT_GROUPS.labels("skipped").inc()
                else:
                    # Accepting frees this group's gate slot in the same atomic script.
                    accepted = await buffer.add_group_async(group)
                    M.ROLLOUT_GROUPS.labels("accepted" if accepted else "duplicate").inc()
                    M.ROLLOUT_SAMPLES.inc(len(group.trajectories))
                    for t in group.trajectories:
                        M.ROLLOUT_REWARD.observe(t.reward)
                        M.ROLLOUT_FINISH.labels(t.finish_reason).inc()
                        M.ROLLOUT_TURNS.observe(assistant_turns(t))
                    if dump is not None and accepted:
                        dump.write(group, workflow.episode_info.get(group_id))
                    refused = (workflow.episode_info.get(group_id) or {}).get("agent_completions_refused", 0)
                    if refused:  # past rollout.multi_turn.max_completions_per_episode (agent/proxy.py)
                        M.AGENT_COMPLETIONS_REFUSED.inc(refused)
                        try:  # the group is in the buffer already: a lost count must not fail (and retry) it
                            await buffer.run.count_agent_refusals_async(refused)
                        except Exception as e:
                            _log(index, f"group {group_id}: counting {refused} refused agent completion(s) "
                                        f"in Redis failed: {type(e).__name__}: {e}")
            except asyncio.CancelledError:
                if not accepted and stop.is_set():  # the worker is stopping: this group is dropped
                    dropped_at_stop[0] += 1
                raise
            except Exception as e:  # one failed group must not end the worker: free the slot, retry the prompt
                M.ROLLOUT_GROUPS.labels("failed").inc()
                _log(index, f"group {group_id} failed: {type(e).__name__}: {e}")
                retry.append(record)
            finally:
                workflow.episode_info.pop(group_id, None)  # the episode's counters, kept for the dump until here
                if not accepted:
                    await gate.release_async(group_id)
                slots.release()
                M.ROLLOUT_INFLIGHT.dec()

        eval_task: asyncio.Task | None = None
        eval_failed: list[BaseException] = []
        if val_dataset is not None:
            from areal_like.buffer.eval_channel import EvalChannel
            from areal_like.rollout.evaluator import Evaluator

            # Validation runs beside the rollouts: no gate slot, nothing written to the stream (evaluator.py).
            workflow.check_rows(val_dataset.records)
            evaluator = Evaluator(client, reward_fn, tokenizer, val_dataset, cfg.eval, cfg.generation,
                                  EvalChannel.from_buffer(buffer, evaluator=f"rollout{index}"), seed=cfg.seed,
                                  log=lambda msg: _log(index, msg), runner=workflow)
            eval_task = asyncio.create_task(evaluator.run(stop), name="evaluator")

            def _eval_done(t: asyncio.Task) -> None:
                if not t.cancelled() and t.exception() is not None:  # e.g. Redis gone for good: end the worker
                    eval_failed.append(t.exception())
                    _log(index, f"evaluator failed: {type(t.exception()).__name__}: {t.exception()}")
                    stop.set()

            eval_task.add_done_callback(_eval_done)
            _log(index, f"evaluator: {len(evaluator.prompts)} validation prompts × eval.n={cfg.eval.n}")
        _log(index, f"started: {len(dataset)} prompts (shard {index}/{n_workers}), servers {endpoints.servers}, "
                    f"{max_groups} groups in flight at most (rollout.max_concurrent_groups)")
        while not stop.is_set():
            pause = failures.backoff_s()  # failures in a row: wait before the next group (no spinning)
            if pause:
                try:
                    await asyncio.wait_for(stop.wait(), pause)
                except TimeoutError:
                    pass
                if stop.is_set():
                    break
            if not await acquire_slot():
                break
            got = False
            group_id = f"w{index}-{seq}"  # also the gate slot id: retried gate calls stay idempotent
            while not stop.is_set():
                if await gate.try_acquire_async(group_id):
                    got = True
                    break
                # (the gate client counted the refusal in areal_like_gate_rejections_total)
                # Re-check when the learner bumps the version (the usual way the gate opens), at the
                # latest after 50 ms (drops credit the gate too; `stop` is seen within the same bound).
                # A fixed 50 ms sleep here cost ~25 ms per bump on average before generation resumed.
                await gate.wait_version_async(0.05)
            if not got:
                slots.release()
                break
            record = retry.pop(0) if retry else next(prompts)
            seq += 1
            await buffer.run.set_rollout_cursor_async(index, {"seq": seq, "prompts": prompts.state_dict()})
            M.ROLLOUT_INFLIGHT.inc()
            task = asyncio.create_task(one(record, group_id))
            inflight.add(task)
            task.add_done_callback(inflight.discard)

        _log(index, f"stopping: cancelling {len(inflight)} group(s) in flight")
        for t in list(inflight):
            t.cancel()
        if eval_task is not None:
            eval_task.cancel()
        await asyncio.gather(*inflight, *([eval_task] if eval_task is not None else []), return_exceptions=True)
        await flush_failures()
        if dropped_at_stop[0]:
            M.ROLLOUT_DROPPED_AT_STOP.inc(dropped_at_stop[0])
            try:
                await buffer.run.count_dropped_at_stop_async(dropped_at_stop[0])
                _log(index, f"{dropped_at_stop[0]} group(s) in flight dropped at stop "
                            f"(summary.json buffer.dropped_in_flight_at_stop)")
            except Exception as e:
                _log(index, f"counting {dropped_at_stop[0]} group(s) dropped at stop in Redis failed: "
                            f"{type(e).__name__}: {e}")
        await workflow.close()
        if dump is not None:
            dump.close()
    await reward_fn.close()
    if teacher is not None:
        await teacher.close()
    stop.set()
    await asyncio.gather(report_task, return_exceptions=True)  # its last flush: every failure counted
    await buffer.aclose()  # closes the endpoint the gate shares
    if reward_stop:
        # The last line of this log: the launcher shows it as the reason the run stopped.
        _log(index, f"exit {EXIT_REWARD_FAILURES}: {reward_stop[0]}")
        return EXIT_REWARD_FAILURES
    if workflow_stop:
        _log(index, f"exit {EXIT_WORKFLOW_FAILURES}: {workflow_stop[0]}")
        return EXIT_WORKFLOW_FAILURES
    return 1 if eval_failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m areal_like.rollout.worker")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--launch", required=True, help="the launch whose endpoints.json it waits for")
    a = p.parse_args(argv)
    import uvloop

    return uvloop.run(run(a.run_dir, a.index, a.metrics_port, a.launch))


if __name__ == "__main__":
    from areal_like.api.process import exit_now

    exit_now(main())  # everything is closed: skip the interpreter's finalization (api/process.py)
