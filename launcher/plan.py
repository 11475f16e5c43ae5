"""`launcher plan`: show where every generation server and learner rank of an allocation lands.

Parses ``--allocation``, places it on ``--nodes × --devices-per-node`` devices (see
`allocation.placement` for the rules and `allocation.placement.resolve_cluster` for the
defaults) and prints a table, or with ``--json`` exactly one JSON object (`Placement.to_dict`).
A bad allocation or a cluster that is too small prints the parser's message on stderr and
returns 2. Pure: imports neither torch nor redis, starts nothing.

With ``--model DIR|config.json`` it adds the memory of every device (`allocation.memory`): the
learner ranks' parameters, gradients, optimizer state, activations, logits chunk, reference and
critic, the servers' weights and KV-cache room, each device marked when over ``--device-memory``,
and the knobs that would make it fit. The learner's settings come from the experiment config as
`launcher run` reads it (defaults, ``--config``, ``a.b.c=value`` overrides); the JSON gains a
``memory`` object. `launcher run` refuses a plan that does not fit its CUDA devices with the same
arithmetic (launcher/run.py `_check_memory`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

# Submodule imports (not `from allocation import ...`) keep this working even where an editable
# install registered `allocation` as a namespace package.
from allocation.errors import AllocationError
from allocation.parser import parse_allocation
from allocation.memory import format_memory
from allocation.placement import Placement, place
from allocation.spec import GenerationSpec


def _devices_text(nodes: tuple[int, ...], devices: tuple[int, ...]) -> str:
    if len(set(nodes)) == 1:
        return ",".join(str(d) for d in devices)
    return " ".join(f"{n}:{d}" for n, d in zip(nodes, devices))


def format_table(plan: Placement) -> str:
    """Human-readable plan: one row per server and learner rank of every component (with its role),
    then a line per component (its pool: components joined by '|' share one) and the totals."""
    alloc = plan.allocation
    rows: list[tuple[str, str, str, str, str, str]] = []
    for g in plan.generation:
        gen = g.spec
        for s in g.servers:
            rows.append(
                (
                    f"generation/{gen.name}",
                    gen.role,
                    str(s.index),
                    ",".join(str(n) for n in dict.fromkeys(s.nodes)),
                    _devices_text(s.nodes, s.devices),
                    f"{gen.backend} server dp_rank={s.index} (p{gen.pp} t{gen.tp})",
                )
            )
    for comp in plan.training:
        t = comp.spec
        for r in comp.ranks:
            coords = f"dp={r.dp_rank} pp={r.pp_rank} tp={r.tp_rank}"
            if t.cp > 1:
                coords += f" cp={r.cp_rank}"
            rows.append((f"training/{t.name}", t.role, str(r.rank), str(r.node), str(r.device), coords))
    header = ("component", "role", "index", "node", "devices", "coordinates")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        f"allocation: {alloc}  (kind {alloc.kind})",
        f"cluster:    {plan.nodes} node(s) × {plan.devices_per_node} devices = {plan.cluster_devices}",
        "",
        "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    lines.extend("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
    lines.append("")
    for pool, group in enumerate(alloc.groups):
        for spec in group:
            others = [c.name for c in group if c is not spec]
            where = f"pool {pool}" + (f", shared with {', '.join(others)}" if others else "")
            if isinstance(spec, GenerationSpec):
                lines.append(
                    f"generation: {spec.name} (role {spec.role}, {spec.backend}) {spec.num_servers} server(s) × "
                    f"{spec.server_size} device(s) = {spec.world_size} devices  [{where}]"
                )
                continue
            grid = f"dp {spec.dp} × pp {spec.pp} × tp {spec.tp}" + (f" × cp {spec.cp}" if spec.cp > 1 else "")
            extra = f", ep {spec.ep}" if spec.ep > 1 else ""
            if spec.ffn is not None:
                extra += f", ffn dp {spec.ffn.dp} × pp {spec.ffn.pp} × tp {spec.ffn.tp} × ep {spec.ffn.ep}"
            lines.append(f"training:   {spec.name} (role {spec.role}, {spec.backend}) {spec.world_size} ranks = "
                         f"{grid}{extra}  [{where}]")
    shared = " (colocated: the rollout servers share the actor's devices)" if alloc.colocated else ""
    lines.append(
        f"total:      {alloc.total_devices} devices needed, {len(plan.used_devices)} used "
        f"of {plan.cluster_devices}{shared}"
    )
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Entry point of `launcher plan`; returns the exit status (0 ok, 2 bad allocation)."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    try:
        alloc = parse_allocation(args.allocation)
        plan = place(alloc, nodes=args.nodes, devices_per_node=args.devices_per_node)
    except AllocationError as exc:
        print(str(exc), file=err)
        return 2
    memory = None
    model = getattr(args, "model", None)
    if model is None and (getattr(args, "overrides", None) or getattr(args, "config", None)):
        print("config overrides and --config only shape the memory plan: add --model DIR|config.json", file=err)
        return 2
    if model is not None:
        try:
            memory = memory_plan(plan, model, config=getattr(args, "config", None),
                                 # the config is read for this allocation (its checks: e.g. judge.model_path
                                 # needs a judge component)
                                 overrides=[*(getattr(args, "overrides", None) or []), f"allocation={args.allocation}"],
                                 seq_len=getattr(args, "seq_len", None),
                                 micro_batch_tokens=getattr(args, "micro_batch_tokens", None),
                                 device_memory=getattr(args, "device_memory", None) or "80GB")
        except ValueError as exc:  # ConfigError is a ValueError
            print(str(exc), file=err)
            return 2
    if args.json:
        d = plan.to_dict()
        if memory is not None:
            d["memory"] = memory.to_dict()
        print(json.dumps(d), file=out)
    else:
        print(format_table(plan), file=out)
        if memory is not None:
            print(format_memory(memory), file=out)
    return 0


def memory_plan(plan: Placement, model: str, *, config: str | None, overrides: list[str], seq_len: int | None,
                micro_batch_tokens: int | None, device_memory: str, suggest: bool = True):
    """`allocation.memory.plan_memory` for a placement, with the learner's settings read from the
    experiment config (defaults, `--config`, overrides: as `launcher run` reads them). Torch-free."""
    from allocation.memory import ModelShape, TrainSettings, parse_bytes, plan_memory
    from areal_like.api.config import apply_gpu_defaults, explicit_keys, load_config

    cfg = load_config(config, overrides)
    gen = plan.allocation.generation
    if gen is not None and gen.backend == "sglang":  # as `launcher run` reads it: the GPU run's defaults
        apply_gpu_defaults(cfg, explicit_keys(config, overrides))
    settings = TrainSettings.from_config(cfg, sglang=gen is not None and gen.backend == "sglang", seq_len=seq_len,
                                         micro_batch_tokens=micro_batch_tokens)
    return plan_memory(plan, ModelShape.load(model), settings, parse_bytes(device_memory), suggest=suggest,
                       aux_shapes=aux_shapes(cfg, plan))


def aux_shapes(cfg, plan) -> dict:
    """For the memory plan: each judge or teacher pool's model shape (`allocation.memory.ModelShape`, from
    `judge.model_path` / `teacher.model_path`), or why it is unknown."""
    from allocation.memory import ModelShape

    out: dict = {}
    for role in {g.spec.role for g in plan.generation} & {"judge", "teacher"}:
        path = getattr(cfg, role).model_path
        if not path:
            out[role] = f"{role}.model_path is not set"
            continue
        try:
            out[role] = ModelShape.load(path)
        except ValueError:
            out[role] = f"{role}.model_path {path!r} is not an HF model dir or config.json"
        except KeyError as e:  # a config without a field the planner reads
            out[role] = f"{role}.model_path {path!r}: its config.json has no {e}"
    return out

