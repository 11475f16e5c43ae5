"""Runtime LoRA serving in the embedded server (`--enable-lora`): peft's LoRA layers in the runner's
model, one peft adapter per loaded adapter *slot*, mixed adapters within one batch.

    slots      `LoraSlots` (engine thread): each loaded adapter is injected with peft's
               `inject_adapter_in_model` under a fresh internal adapter name (`a0`, `a1`, …) — peft adds
               it to the existing `lora.Linear` layers — with its own rank and lora_alpha from its
               adapter_config; its tensors are copied in. A slot is deleted with each LoraLayer's
               `delete_adapter` once no running row uses it. No LoRA math here: peft's
               `lora.Linear._mixed_batch_forward` adds each row's adapter (`adapter_names`, one per
               batch row, `"__base__"` = none).
    forward    `LoraSlots.rows(names)`: a context in which every LoraLayer's forward pre-hook (installed
               once per layer) passes `adapter_names=names`; outside it the hook adds nothing, and no
               peft adapter is *active* (`set_adapter([])`), so a plain forward is the base model.
    names      peft renames a wrapped base parameter (`q_proj.weight` → `q_proj.base_layer.weight`) and
               adds `lora_A.<slot>.weight`: `base_layer_name` maps back to the HF name, `is_lora_name`
               keeps adapter tensors out of the runner's base weights.
    registry   `LoraRegistry` (event loop): lora_name → slot, the path it came from, and per slot the
               requests that resolved to it (queued, held or running). A slot no name points to and no
               request holds is handed back to the engine to be freed.

Adapter tensors arrive by areal_like name (`model.layers.0.self_attn.q_proj.lora_A.weight`: peft's
saved name without its `base_model.model.` prefix, `weights/adapter.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from areal_like.api.config import LORA_LINEARS, LORA_TARGETS
from areal_like.engine.errors import BadRequest, short
from areal_like.weights.adapter import tensor_name

BASE = "__base__"  # peft's adapter name of a row without adapter (mixed-batch forward)
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


def resolve_targets(targets: Any, where: str) -> list[str]:
    """target_modules (a list of decoder linear names, `all` / `all-linear`) → the module names."""
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{where}: target_modules must be a non-empty list of module names, got {targets!r}")
    if any(t in ("all", "all-linear") for t in targets):
        return list(LORA_LINEARS)
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"{where}: unsupported target modules {unknown}: use {', '.join(LORA_TARGETS)} or all")
    return list(dict.fromkeys(targets))


@dataclass
class AdapterSpec:
    """An adapter's config, checked against the server's LoRA limits."""

    r: int
    alpha: float
    targets: list[str]
    use_rslora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Any, *, max_rank: int, allowed: list[str], where: str) -> "AdapterSpec":
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: the adapter config must be an object (adapter_config.json), got {cfg!r}")
        if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
            raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
        if cfg.get("use_dora"):
            raise ValueError(f"{where}: a DoRA adapter (use_dora) is not served: give a plain LoRA adapter")
        if cfg.get("modules_to_save"):
            raise ValueError(f"{where}: modules_to_save={cfg['modules_to_save']!r} is not served (LoRA layers only)")
        if cfg.get("lora_bias"):
            raise ValueError(f"{where}: lora_bias is not served")
        try:
            r = int(cfg.get("r", 8))
            alpha = float(cfg.get("lora_alpha", 8))
        except (TypeError, ValueError):
            raise ValueError(f"{where}: r / lora_alpha must be numbers, got {cfg.get('r')!r} / {cfg.get('lora_alpha')!r}")
        rank_pattern = dict(cfg.get("rank_pattern") or {})
        ranks = [r, *(int(v) for v in rank_pattern.values())]
        if min(ranks) < 1:
            raise ValueError(f"{where}: LoRA rank r={r} must be ≥ 1")
        if max(ranks) > max_rank:
            raise ValueError(f"LoRA adapter {where} has rank {max(ranks)}, which exceeds the server's "
                             f"--max-lora-rank {max_rank}")
        targets = resolve_targets(cfg.get("target_modules"), where)
        outside = [t for t in targets if t not in allowed]
        if outside:
            raise ValueError(f"LoRA adapter {where} targets {outside}, which are not in the server's "
                             f"--lora-target-modules {allowed}")
        return cls(r=r, alpha=alpha, targets=targets, use_rslora=bool(cfg.get("use_rslora", False)),
                   rank_pattern=rank_pattern, alpha_pattern=dict(cfg.get("alpha_pattern") or {}))

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, target_modules=list(self.targets), lora_dropout=0.0,
                          bias="none", use_rslora=self.use_rslora, rank_pattern=self.rank_pattern,
                          alpha_pattern=self.alpha_pattern, inference_mode=True)


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


class LoraSlots:
    """The adapters injected into one model (engine thread only)."""

    def __init__(self, model: nn.Module, *, max_rank: int, target_modules: list[str]) -> None:
        self.model = model
        self.max_rank = max_rank
        self.targets = list(target_modules)
        self.slots: dict[str, AdapterSpec] = {}
        self._next = 0
        self._names: list[str] | None = None  # adapter_names of the forward in progress (None: base)
        self._hooked: set[int] = set()
        self._to_free: set[str] = set()  # unnamed slots some running row still uses
        # One freed slot kept injected, for the next adapter of the same shape: a LoRA run replaces its
        # adapter every step, and peft's injection walks the whole model (0.1–0.3 s for 0.5 B) where a
        # reused slot is a copy of the tensors
        self._spare: dict[str, AdapterSpec] = {}

    # ---------------------------------------------------------------- forward
    def _hook(self, module, args, kwargs):
        if self._names is not None:
            kwargs["adapter_names"] = self._names
        return args, kwargs

    def _install_hooks(self) -> None:
        for _, m in _lora_layers(self.model):
            if id(m) not in self._hooked:
                m.register_forward_pre_hook(self._hook, with_kwargs=True)
                self._hooked.add(id(m))
            m.set_adapter([])  # no adapter applies by default: a forward without names is the base model

    @contextlib.contextmanager
    def rows(self, slots: list[str | None]):
        """Forwards inside run each batch row with its slot's adapter (None = the base model)."""
        if all(s is None for s in slots):
            yield  # no adapter in this batch: the plain base forward
            return
        self._names = [BASE if s is None else s for s in slots]
        try:
            yield
        finally:
            self._names = None

    # ---------------------------------------------------------------- slots
    def expected(self, spec: AdapterSpec) -> dict[str, tuple[int, ...]]:
        """The adapter tensor names and shapes `spec` has in this model (areal_like names)."""
        from peft.tuners.lora import LoraLayer

        out: dict[str, tuple[int, ...]] = {}
        for name, mod in self.model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in spec.targets:
                continue
            base = mod.get_base_layer() if isinstance(mod, LoraLayer) else mod
            if not isinstance(base, nn.Linear):
                continue
            r = spec.r
            for pat, v in spec.rank_pattern.items():  # peft's rule: a key matching the module name's end
                if name == pat or name.endswith("." + pat):
                    r = int(v)
            out[f"{name}.lora_A.weight"] = (r, base.in_features)
            out[f"{name}.lora_B.weight"] = (base.out_features, r)
        return out

    def check(self, cfg: Any, tensors: dict[str, torch.Tensor], where: str) -> AdapterSpec:
        """The adapter's spec, or ValueError: rank, targets, tensor names and shapes against the model."""
        spec = AdapterSpec.from_config(cfg, max_rank=self.max_rank, allowed=self.targets, where=where)
        tensors = {tensor_name(k): v for k, v in tensors.items()}
        want = self.expected(spec)
        if not want:
            raise ValueError(f"LoRA adapter {where}: target_modules {spec.targets} match no linear layer of the model")
        unknown = sorted(set(tensors) - set(want))
        missing = sorted(set(want) - set(tensors))
        if unknown or missing:
            raise ValueError(f"LoRA adapter {where}: tensor names do not match the model: "
                             f"unexpected {unknown[:4]}{' …' if len(unknown) > 4 else ''}, "
                             f"missing {missing[:4]}{' …' if len(missing) > 4 else ''}")
        bad = [f"{n}: got {tuple(t.shape)}, expected {want[n]}" for n, t in tensors.items() if tuple(t.shape) != want[n]]
        bad += [f"{n}: dtype {t.dtype} is not floating point" for n, t in tensors.items() if not t.is_floating_point()]
        if bad:
            raise ValueError(f"LoRA adapter {where}: tensor shapes do not match: {bad[:4]}")
        return spec

    @torch.no_grad()
    def add(self, cfg: Any, tensors: dict[str, torch.Tensor], where: str) -> str:
        """Check, inject and fill a new slot; returns its peft adapter name. Nothing changes on failure."""
        from peft import inject_adapter_in_model

        spec = self.check(cfg, tensors, where)
        tensors = {tensor_name(k): v for k, v in tensors.items()}
        reuse = next((s for s, sp in self._spare.items() if sp == spec), None)
        if reuse is not None:  # same rank, alpha and targets: its layers take the new tensors
            del self._spare[reuse]
            self._fill(reuse, tensors)
            self.slots[reuse] = spec
            return reuse
        slot = f"a{self._next}"
        self._next += 1
        try:
            inject_adapter_in_model(spec.peft_config(), self.model, adapter_name=slot)
            if hasattr(self.model, "peft_config"):  # one LoraModel per injection: no shared config
                del self.model.peft_config
            self._fill(slot, tensors)
        except BaseException:
            self._delete(slot)
            raise
        finally:
            self._install_hooks()
        self.slots[slot] = spec
        return slot

    @torch.no_grad()
    def _fill(self, slot: str, tensors: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        for n, t in tensors.items():
            mod, kind = n.rsplit(".", 2)[0], n.rsplit(".", 2)[1]  # "<module>", "lora_A"
            params[f"{mod}.{kind}.{slot}.weight"].copy_(t)

    def free(self, slot: str, in_use: set[str]) -> None:
        """Delete `slot` now, or once no running row uses it (`in_use`: the slots of running rows)."""
        if slot not in self.slots:
            return
        if slot in in_use:
            self._to_free.add(slot)
            return
        self._to_free.discard(slot)
        spec = self.slots.pop(slot)
        if not self._spare:  # kept for the next adapter of its shape (no request can name it)
            self._spare[slot] = spec
            return
        self._delete(slot)

    def collect(self, in_use: set[str]) -> None:
        """Free the slots waiting for their last running row (called when rows leave)."""
        for slot in [s for s in self._to_free if s not in in_use]:
            self.free(slot, in_use)

    def _delete(self, slot: str) -> None:
        for _, m in _lora_layers(self.model):
            if slot in m.lora_A or slot in m.lora_B:
                m.delete_adapter(slot)
            m.set_adapter([])  # delete_adapter may make another adapter active: none is


class LoraRegistry:
    """lora_name → slot (event loop side), and the requests that hold each slot."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        self.paths: dict[str, str] = {}
        self.refs: dict[str, int] = {}

    def loaded(self) -> dict[str, str]:
        return dict(self.paths)

    def bind(self, name: str, slot: str, path: str) -> str | None:
        """Point `name` at `slot`; returns the slot it pointed to before (None)."""
        old = self.names.get(name)
        self.names[name] = slot
        self.paths[name] = path
        return old

    def unbind(self, name: str) -> str | None:
        self.paths.pop(name, None)
        return self.names.pop(name, None)

    def acquire(self, name: str) -> str | None:
        slot = self.names.get(name)
        if slot is not None:
            self.refs[slot] = self.refs.get(slot, 0) + 1
        return slot

    def release(self, slot: str) -> None:
        n = self.refs.get(slot, 0) - 1
        if n > 0:
            self.refs[slot] = n
        else:
            self.refs.pop(slot, None)

    def dead(self, slot: str) -> bool:
        """No name points to `slot` and no request holds it: it may be freed."""
        return slot not in self.names.values() and self.refs.get(slot, 0) == 0

class RequestLoras:
    """Which adapter slot each request runs with (the server's side of `lora_path`): names resolved to
    slots at submission — or, while paused, when generation continues — held until the request ends,
    and a slot no name points to and no request holds freed on the engine thread. `registry` None: LoRA
    is not enabled (a request naming an adapter is a 400)."""

    def __init__(self, registry: LoraRegistry | None, scheduler, runner) -> None:
        self.registry, self.scheduler, self.runner = registry, scheduler, runner

    def names(self, lp: Any, n_prompts: int) -> list[str | None]:
        """`lora_path` of /generate: null, an adapter name, or a list of names (one, or one per prompt)."""
        if lp is None:
            return [None] * n_prompts
        names = lp if isinstance(lp, list) else [lp]
        if not names or not all(x is None or isinstance(x, str) for x in names) or len(names) not in (1, n_prompts):
            raise BadRequest(f"'lora_path' must be a loaded adapter's name, a list of one name (or one per prompt) or "
                             f"null, got {short(lp)}")
        if self.registry is None and any(x is not None for x in names):
            raise BadRequest(f"LoRA adapter '{next(x for x in names if x is not None)}' was requested, but LoRA is "
                             "not enabled. Please launch the server with --enable-lora flag and preload adapters "
                             "using --lora-paths or /load_lora_adapter endpoint.")
        return names * n_prompts if len(names) == 1 else list(names)

    @staticmethod
    def unknown(name: str) -> str:
        return f"Got LoRA adapter that has never been loaded: {name}"

    def acquire(self, seq) -> bool:
        """Resolve `seq.lora_name` to the adapter slot it names now (holding that slot until the request
        ends); False when no adapter has that name."""
        slot = self.registry.acquire(seq.lora_name)
        if slot is None:
            return False
        self.drop(seq)
        seq.lora = slot
        return True

    def drop(self, seq) -> None:
        """Let go of `seq`'s adapter slot; a slot no name points to and no request holds is freed (on the
        engine thread, once no running row uses it)."""
        slot, seq.lora = seq.lora, None
        if slot is None or self.registry is None:
            return
        self.registry.release(slot)
        self.free_if_dead(slot)

    def free_if_dead(self, slot: str | None) -> None:
        if slot is not None and self.registry.dead(slot):
            fut = asyncio.ensure_future(self.scheduler.run_on_engine(self.runner.free_lora, slot))
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    def resolve(self, jobs: list) -> None:
        """At submission: each job's adapter name → its slot. While paused the names are resolved when
        generation continues (`resolve_held`): a request held by a pause runs on the adapter the
        name points to after it. An unknown name is a 400 (nothing submitted)."""
        if self.registry is None or self.scheduler.paused:
            return
        for j in jobs:
            if j.seq.lora_name is not None and not self.acquire(j.seq):
                name = j.seq.lora_name
                self.release(jobs)
                raise BadRequest(self.unknown(name))

    def release(self, jobs: list) -> None:
        if self.registry is not None:
            for j in jobs:
                self.drop(j.seq)

    def resolve_held(self) -> None:
        """/continue_generation: the requests the pause held resolve their adapter names now (the
        adapters may have been replaced meanwhile); an unknown name fails that request with a 400."""
        if self.registry is None:
            return
        for req in list(self.scheduler.held):
            seq = req.seq
            if seq.lora_name is None or req.done:
                continue
            if not self.acquire(seq):
                self.drop(seq)
                self.scheduler._finish(req, {"type": "abort", "message": self.unknown(seq.lora_name),
                                             "status_code": 400, "err_type": "BadRequest"})
