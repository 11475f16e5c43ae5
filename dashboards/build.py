"""Writes dashboards/grafana/areal_like.json, the Grafana dashboard of areal_like runs.

    .venv/bin/python dashboards/build.py          (tests/unit/test_dashboards.py checks the file is current)

Every panel's query selects by the labels `launcher run` puts on its Prometheus targets
(prometheus_targets.json: experiment, run, role, kind), so the variables $experiment, $run and $role
pick runs and roles. Generation panels carry two queries: the embedded engine's `areal_like_*` series
and real SGLang's `sglang:*` series (names from SGLang's metrics collector), so one dashboard serves
both backends; a target whose query reads `sglang:*` is marked `"areal_like_backend": "sglang"`.
Redis panels read the launcher's own Redis metrics endpoint (role/kind `redis`; prometheus-redis-exporter's
metric names), served beside its Redis (metrics.redis_exporter).
"""

from __future__ import annotations

import json
import os

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grafana", "areal_like.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"


def sel(kind: str, extra: str = "") -> str:
    """The label selector of a kind's series under the dashboard's variables."""
    s = f'kind="{kind}", experiment=~"$experiment", run=~"$run", role=~"$role"'
    return "{" + s + (", " + extra if extra else "") + "}"


L, SV, RO, RD = sel("learner"), sel("server"), sel("rollout"), sel("redis")


def sg(name: str) -> str:
    """An SGLang series under the variables. SGLang names its metrics `sglang:<name>`, but
    prometheus_client 0.2x writes the samples as `sglang_<name>` when Prometheus scrapes in OpenMetrics
    (which it prefers; prometheus/client_python#1177), so match both spellings."""
    return sel("server", f'__name__=~"sglang[:_]{name}"')


def p50(metric: str, by: str = "run") -> str:
    return f"histogram_quantile(0.5, sum by (le, {by}) (rate({metric}_bucket{L}[{RI}])))"


def target(expr: str, legend: str, *, sglang: bool = False, fmt: str | None = None) -> dict:
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "range": True}
    if sglang:
        t["areal_like_backend"] = "sglang"
    if fmt:
        t["format"] = fmt
    return t


def ts(title: str, description: str, targets: list[dict], *, unit: str | None = None) -> dict:
    defaults = {"custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 0, "showPoints": "never",
                           "spanNulls": True}}
    if unit:
        defaults["unit"] = unit
    return {"type": "timeseries", "title": title, "description": description, "datasource": DS,
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []},
                        "tooltip": {"mode": "multi", "sort": "none"}},
            "targets": [dict(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)]}


def heatmap(title: str, description: str, expr: str) -> dict:
    return {"type": "heatmap", "title": title, "description": description, "datasource": DS,
            "fieldConfig": {"defaults": {}, "overrides": []},
            "options": {"calculate": False, "yAxis": {"axisLabel": "staleness (versions)"},
                        "cellGap": 1, "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64, "exponent": 0.5, "fill": "dark-orange",
                                  "reverse": False},
                        "legend": {"show": True}, "tooltip": {"mode": "single", "yHistogram": True},
                        "exemplars": {"color": "rgba(255,0,255,0.7)"}, "showValue": "never",
                        "rowsFrame": {"layout": "le"}},
            "targets": [dict(target(expr, "{{le}}", fmt="heatmap"), refId="A")]}


LEARNER = [
    ts("Reward (training batch mean)", "Mean reward of the groups the last step trained on (learner rank 0).",
       [target(f"areal_like_reward_mean{L}", "{{run}}")]),
    ts("Validation", "Latest validation result per data source and metric (mean@k, pass@k), every "
       "train.test_freq steps.", [target("areal_like_val_score" + sel("learner", 'data_source!="_"'),
                                          "{{run}} {{data_source}} {{metric}}")]),
    ts("Loss", "Policy loss of the last step.", [target(f"areal_like_loss{L}", "{{run}}")]),
    ts("KL", "k3 estimate of KL(π_prox ‖ π_θ) over the step, and KL to the reference model (0 without one).",
       [target(f"areal_like_learner_approx_kl{L}", "{{run}} KL(prox‖θ)"),
        target(f"areal_like_learner_kl_ref{L}", "{{run}} KL(θ‖ref)")]),
    ts("Training–inference mismatch", "The learner's logprobs (the step's starting weights) against the servers' "
       "on the same tokens: mean and max |Δ log p|, KL(π_behav ‖ π_learner) (k3 estimate), and the share of "
       "tokens whose ratio π_learner/π_behav leaves [0.5, 5]. Includes the policy lag of stale tokens. "
       "train.rejection_sampling (IcePop, TIS) corrects it; the tokens it acted on are a series. MoE runs with "
       "train.routing_replay: the share of replayed expert choices the learner's own router agrees with.",
       [target(f"areal_like_learner_mismatch{L}", "{{run}} {{stat}}"),
        target(f"areal_like_learner_behav_tokens_corrected{L}", "{{run}} tokens corrected"),
        # MoE routing replay (train.routing_replay): how often the learner's router agrees with the replayed experts
        target(f"areal_like_learner_routing_agreement{L}", "{{run}} routing agreement (replay)")]),
    ts("Clip fraction", "Fraction of loss tokens where the PPO clip was active.",
       [target(f"areal_like_learner_clipfrac{L}", "{{run}}")], unit="percentunit"),
    ts("Entropy", "Mean policy entropy over loss tokens.", [target(f"areal_like_learner_entropy{L}", "{{run}}")]),
    ts("Gradient norm", "Actor gradient norm before clipping.",
       [target(f"areal_like_learner_grad_norm{L}", "{{run}}")]),
    ts("Step / push / fetch seconds (p50)", "Median seconds of a training step (without the push), of a weight "
       "push (pause → continue), and of waiting for a step's B groups (0 = the buffer held them).",
       [target(p50("areal_like_learner_step_seconds"), "{{run}} step"),
        target(p50("areal_like_weight_push_seconds"), "{{run}} push"),
        target(p50("areal_like_learner_fetch_seconds"), "{{run}} fetch")], unit="s"),
    ts("Trained tokens/s", "Loss tokens trained per second.",
       [target(f"sum by (run) (rate(areal_like_trained_tokens_total{L}[{RI}]))", "{{run}}")]),
    ts("Policy version", "The learner's policy version v (one per step).",
       [target(f"areal_like_policy_version{L}", "{{run}}")]),
]

GENERATION = [
    ts("Generated tokens/s", "Output tokens per second per server (embedded engine; SGLang: "
       "sglang:generation_tokens_total).",
       [target(f"rate(areal_like_generated_tokens_total{SV}[{RI}])", "{{run}} {{role}}"),
        target(f"rate({sg('generation_tokens_total')}[{RI}])", "{{run}} {{role}} (sglang)", sglang=True)]),
    ts("Busy fraction", "Fraction of wall time the engine computed (embedded engine: rate of busy seconds). "
       "SGLang exports no busy time; its KV-cache token usage is shown instead.",
       [target(f"rate(areal_like_server_busy_seconds_total{SV}[{RI}])", "{{run}} {{role}} busy"),
        target(sg("token_usage"), "{{run}} {{role}} KV usage (sglang)", sglang=True)],
       unit="percentunit"),
    ts("Running / waiting requests", "Requests in the decode batch and waiting to join it.",
       [target(f"areal_like_server_running_requests{SV}", "{{run}} {{role}} running"),
        target(f"areal_like_server_waiting_requests{SV}", "{{run}} {{role}} waiting"),
        target(sg("num_running_reqs"), "{{run}} {{role}} running (sglang)", sglang=True),
        target(sg("num_queue_reqs"), "{{run}} {{role}} waiting (sglang)", sglang=True)]),
    ts("Weight version per server", "The weight version each server serves (embedded engine; the learner's "
       "policy version is in the learner row).",
       [target(f"areal_like_server_weight_version{SV}", "{{run}} {{role}}")]),
    ts("Interrupted requests", "Requests aborted before finishing, per second: by a weight update's pause "
       "(abort mode) or a client that went away; the rollout worker resubmits them. SGLang: aborted/s, and "
       "requests paused by an async weight sync (a count).",
       [target("sum by (run, role) (rate(areal_like_generate_requests_total" + sel("server", 'finish_reason="abort"')
               + f"[{RI}]))",
               "{{run}} {{role}}"),
        target(f"sum by (run, role) (rate({sg('num_aborted_requests_total')}[{RI}]))", "{{run}} {{role}} aborted (sglang)",
               sglang=True),
        target(f"sum by (run, role) ({sg('num_paused_reqs')})", "{{run}} {{role}} paused for weight sync (sglang)",
               sglang=True)]),
    ts("Generation throughput (SGLang's own)", "SGLang's scheduler-measured decode throughput (tokens/s) and "
       "median time to first token; the embedded engine's throughput is the first panel of this row.",
       [target(sg("gen_throughput"), "{{run}} {{role}} tokens/s", sglang=True),
        target(f"histogram_quantile(0.5, sum by (le, run, role) (rate({sg('time_to_first_token_seconds_bucket')}[{RI}])))",
               "{{run}} {{role}} TTFT p50 (s)", sglang=True)]),
]

ROLLOUT = [
    ts("Groups/s by outcome", "Groups finished by the rollout workers: accepted into the buffer, duplicate, "
       "skipped (no group, e.g. dynamic sampling), failed (retried).",
       [target(f"sum by (run, outcome) (rate(areal_like_rollout_groups_total{RO}[{RI}]))", "{{run}} {{outcome}}")]),
    ts("Gate refusals/s", "Staleness-gate refusals: a worker waited because starting a group would break the "
       "staleness bound η.",
       [target(f"sum by (run) (rate(areal_like_gate_rejections_total{RO}[{RI}]))", "{{run}}")]),
    ts("Reward function timeouts and errors/s", "Reward calls that timed out, and that failed and scored 0 by "
       "kind (exception, timeout, non_finite, not_a_number).",
       [target(f"sum by (run) (rate(areal_like_reward_timeouts_total{RO}[{RI}]))", "{{run}} timeouts"),
        target(f"sum by (run, kind) (rate(areal_like_reward_failures_total{RO}[{RI}]))", "{{run}} {{kind}}")]),
    ts("Judge gradings/s and mean latency", "Gradings by the judge servers (judge.*, the allocation's judge "
       "component), and their mean time, request to score, retries included (0 while none ran; failed gradings "
       "count in both, and as reward failures in the panel above). Empty rates (0) in a run without a judge.",
       [target(f"sum by (run) (rate(areal_like_judge_latency_seconds_count{RO}[{RI}]))", "{{run}} gradings/s"),
        target(f"sum by (run) (rate(areal_like_judge_latency_seconds_sum{RO}[{RI}])) / clamp_min(sum by (run) "
               f"(rate(areal_like_judge_latency_seconds_count{RO}[{RI}])), 1e-9)", "{{run}} mean latency (s)")]),
    ts("Tool calls/s by outcome", "Tool calls per tool and outcome: `ok`, or the error kind (timeout, exception, "
       "bad_arguments, unknown_tool, refused, memory, …). Empty unless rollout.tools_config is set.",
       [target(f"sum by (run, tool, outcome) (rate(areal_like_tool_calls_total{RO}[{RI}]))",
               "{{run}} {{tool}} {{outcome}}")]),
    ts("Trajectories/s by finish reason", "Accepted trajectories by finish reason (stop, length, max_turns, "
       "context_limit, …).",
       [target(f"sum by (run, reason) (rate(areal_like_rollout_finish_reasons_total{RO}[{RI}]))", "{{run}} {{reason}}")]),
    ts("Groups in flight", "Groups the rollout workers are generating.",
       [target(f"sum by (run) (areal_like_rollout_inflight_groups{RO})", "{{run}}")]),
]

BUFFER = [
    ts("Buffer depth / pending", "Groups in the Redis replay buffer not yet read by the learner (depth), and "
       "read but not yet acknowledged (pending).",
       [target(f"areal_like_buffer_depth{L}", "{{run}} depth"),
        target(f"areal_like_buffer_pending{L}", "{{run}} pending")]),
    ts("Drops/s by reason", "Groups dropped instead of trained: stale (consume-time limit), malformed, "
       "duplicate, already_trained, filtered (dynamic sampling).",
       [target(f"sum by (run, reason) (rate(areal_like_buffer_dropped_groups_total{L}[{RI}]))", "{{run}} {{reason}}")]),
    ts("Oldest unconsumed group age", "Seconds the oldest group has waited in the buffer.",
       [target(f"areal_like_buffer_oldest_age_seconds{L}", "{{run}}")], unit="s"),
    ts("Redis memory", "Memory used by the run's redis-server (INFO used_memory, served by the launcher).",
       [target(f"redis_memory_used_bytes{RD}", "{{run}} used")], unit="bytes"),
    ts("Redis commands/s", "Commands the run's redis-server processed per second (INFO, served by the launcher).",
       [target(f"sum by (run) (rate(redis_commands_processed_total{RD}[{RI}]))", "{{run}}")]),
]

STALENESS = [
    heatmap("Staleness distribution", "Policy versions between a trained group's oldest token and the learner, "
            "per step (count of groups per staleness bucket).",
            f"sum by (le) (increase(areal_like_staleness_bucket{L}[{RI}]))"),
    ts("Max staleness vs η", "Largest staleness trained in the last step, against the run's bound η "
       "(rollout.max_staleness); the first never exceeds the second.",
       [target(f"areal_like_staleness_max{L}", "{{run}} max"),
        target(f"areal_like_staleness_limit{L}", "{{run}} η")]),
]

ROWS = [("Learner", LEARNER), ("Generation", GENERATION), ("Rollout", ROLLOUT), ("Buffer", BUFFER),
        ("Staleness", STALENESS)]


def variable(name: str, label: str, query: str) -> dict:
    return {"type": "query", "name": name, "label": label, "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"},
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*", "sort": 1,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "hide": 0}


def dashboard() -> dict:
    panels, y, pid = [], 0, 1
    for title, row in ROWS:
        panels.append({"type": "row", "title": title, "id": pid, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        for i, panel in enumerate(row):
            panels.append(dict(panel, id=pid, gridPos={"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)}))
            pid += 1
        y += 8 * ((len(row) + 2) // 3)
    up = 'up{job="areal_like"'
    return {
        "uid": "areal-like", "title": "areal_like", "description": "Runs of areal_like: learner, generation, rollout, "
        "replay buffer and staleness. Variables pick the experiment, run and role (labels of "
        "prometheus_targets.json).",
        "tags": ["areal_like", "rl"], "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 2,
        "time": {"from": "now-30m", "to": "now"}, "refresh": "5s", "timezone": "browser",
        "annotations": {"list": []}, "links": [],
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
             "current": {"selected": False, "text": "Prometheus", "value": "prometheus"}, "options": [],
             "refresh": 1, "hide": 0, "includeAll": False, "multi": False, "regex": ""},
            variable("experiment", "Experiment", f"label_values({up}}}, experiment)"),
            variable("run", "Run", f'label_values({up}, experiment=~"$experiment"}}, run)'),
            variable("role", "Role", f'label_values({up}, experiment=~"$experiment", run=~"$run"}}, role)'),
        ]},
        "panels": panels,
    }


def main() -> None:
    with open(OUT, "w") as f:
        json.dump(dashboard(), f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
