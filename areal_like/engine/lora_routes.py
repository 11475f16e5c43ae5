"""The embedded server's LoRA adapter routes (SGLang's /load_lora_adapter, /unload_lora_adapter and
/load_lora_adapter_from_distributed): adapters loaded into, and dropped from, a `GenerationServer`'s
adapter slots. Which adapter a request runs with (slots held while requests use them) stays with the
server, which serves the requests; these routes only load and unload. Buckets of a distributed adapter
load arrive through the weight group of `admin_routes.AdminRoutes` (its receiver and update lock).
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from areal_like.engine.admin_routes import RECV_SLOTS
from areal_like.engine.errors import BadRequest
from areal_like.engine.lora import NOT_ENABLED

log = logging.getLogger("areal_like.engine.server")  # the server's log: these are its routes


class LoraRoutes:
    """The adapter routes of one `GenerationServer` (see the module docstring)."""

    ROUTES = (("POST", "/load_lora_adapter", "load_lora"), ("POST", "/unload_lora_adapter", "unload_lora"),
              ("POST", "/load_lora_adapter_from_distributed", "load_lora_distributed"))

    def __init__(self, server, admin) -> None:
        self.server, self.admin = server, admin
        self.lora_lock = asyncio.Lock()
        # the buckets of /load_lora_adapter_from_distributed received so far per lora_name (the bucket
        # that sets weight_version is the last), and each one's adapter config
        self._lora_staged: dict[str, dict] = {}
        self._lora_staged_cfg: dict[str, dict] = {}

    def add_to(self, app: web.Application) -> None:
        for method, path, handler in self.ROUTES:
            app.router.add_route(method, path, getattr(self, handler))

    def _lora_reply(self, ok: bool, error_message: str | None = None) -> web.Response:
        """SGLang's LoRAUpdateOutput: 200 on success, 400 on failure."""
        return web.json_response({"success": ok, "error_message": error_message,
                                  "loaded_adapters": self.server.loras.loaded() if self.server.loras is not None else {}},
                                 status=200 if ok else 400)

    @staticmethod
    def _lora_name_of(b: dict) -> str:
        name = b.get("lora_name")
        if not isinstance(name, str) or not name:
            raise BadRequest("'lora_name' (a non-empty string) is required")
        return name

    async def load_lora(self, request: web.Request) -> web.Response:
        """SGLang's /load_lora_adapter {lora_name, lora_path, pinned, lora_id}: a peft adapter dir as a
        new adapter slot under `lora_name`. Refused (400, nothing changed): LoRA not enabled, the name
        loaded, --max-loaded-loras reached, a rank over --max-lora-rank, target modules outside
        --lora-target-modules, missing files, tensors that do not fit the model."""
        b = await self.server._json(request)
        if self.server.loras is None:
            return self._lora_reply(False, NOT_ENABLED)
        name = self._lora_name_of(b)
        path = b.get("lora_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("'lora_path' (the adapter directory) is required")
        if not isinstance(b.get("pinned", False), bool):
            raise BadRequest("'pinned' must be true or false")
        from areal_like.weights.adapter import read_adapter_config, read_adapter_tensors

        async with self.lora_lock:
            refused = self._lora_load_refused(name)
            if refused:
                return self._lora_reply(False, refused)
            try:
                cfg = await asyncio.to_thread(read_adapter_config, path, "lora_path")
                tensors = await asyncio.to_thread(read_adapter_tensors, path, "lora_path")
                slot = await self.server.scheduler.run_on_engine(self.server.runner.load_lora, cfg, tensors, name)
            except (OSError, ValueError, RuntimeError) as e:
                log.error("load_lora_adapter %s (%s) failed: %s", name, path, e)
                return self._lora_reply(False, f"Failed to load LoRA adapter {name} from {path}: {e}")
            self.server.loras.bind(name, slot, path)
        log.info("loaded LoRA adapter %s from %s (slot %s)", name, path, slot)
        return self._lora_reply(True)

    def _lora_load_refused(self, name: str, replacing: bool = False) -> str:
        if name in self.server.loras.names and not replacing:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        n = len(self.server.loras.names) + (0 if name in self.server.loras.names else 1)
        if n > self.server.args.max_loaded_loras:
            return (f"Failed to load LoRA adapter {name}: the maximum number of loaded LoRA adapters "
                    f"(--max-loaded-loras {self.server.args.max_loaded_loras}) is reached; unload one first")
        return ""

    async def unload_lora(self, request: web.Request) -> web.Response:
        """SGLang's /unload_lora_adapter {lora_name}: the name goes at once; its slot is freed once no
        request uses it."""
        b = await self.server._json(request)
        if self.server.loras is None:
            return self._lora_reply(False, NOT_ENABLED)
        name = self._lora_name_of(b)
        async with self.lora_lock:
            if name not in self.server.loras.names:
                return self._lora_reply(False, f"LoRA with name {name} does not exist")
            slot = self.server.loras.unbind(name)
            self.server.request_loras.free_if_dead(slot)
        log.info("unloaded LoRA adapter %s (slot %s)", name, slot)
        return self._lora_reply(True)

    async def load_lora_distributed(self, request: web.Request) -> web.Response:
        """Our extension: an adapter pushed over the weight group. The body is an
        /update_weights_from_distributed bucket (names: adapter tensor names without peft's prefix,
        `model.layers.0.self_attn.q_proj.lora_A.weight`) plus `lora_name` and `config_dict` (the
        adapter_config.json dict). Buckets are staged per lora_name; the one with a non-null
        `weight_version` is the last: the staged tensors become a new slot that `lora_name` names
        (replacing an adapter of that name; rows already on the old one finish on it) and the server's
        weight version moves to it. Failures: 400, nothing changed."""
        b = await self.server._json(request)
        if self.server.loras is None:
            return self._lora_reply(False, NOT_ENABLED)
        name = self._lora_name_of(b)
        try:
            names, dtypes, shapes = list(b["names"]), list(b["dtypes"]), [list(s) for s in b["shapes"]]
        except (KeyError, TypeError) as e:
            raise BadRequest(f"bad load_lora_adapter_from_distributed body: {e!r}")
        cfg = b.get("config_dict")
        if cfg is not None and not isinstance(cfg, dict):
            raise BadRequest("'config_dict' must be the adapter_config.json object")
        group_name = str(b.get("group_name") or "weight_update_group")
        refused = self.admin._update_refused()
        if refused is not None:
            body = json.loads(refused.body)
            return self._lora_reply(False, body["message"])
        async with self.admin.update_lock:  # receives in arrival order: the broadcasts' order
            loads = self.admin._group_loads.get(group_name, [])
            if loads:  # a full update's load may still read the group's receive buffers
                await asyncio.wait(loads)
            try:
                named = await self.admin._receive(group_name, names, dtypes, shapes, b.get("load_format"),
                                            self.admin._group_received.get(group_name, 0) % RECV_SLOTS)
                named = {k: v.detach().to("cpu", copy=True) for k, v in named.items()}  # the buffer is reused
            except Exception as e:
                self._lora_staged.pop(name, None)
                self._lora_staged_cfg.pop(name, None)
                log.error("load_lora_adapter_from_distributed %s failed: %s", name, e)
                return self._lora_reply(False, f"Failed to receive LoRA adapter {name}: {e}")
            self._lora_staged.setdefault(name, {}).update(named)
            if cfg is not None:
                self._lora_staged_cfg[name] = cfg
            if b.get("weight_version") is None:
                return web.json_response({"success": True, "error_message": None,
                                          "loaded_adapters": self.server.loras.loaded(),
                                          "message": f"staged {len(names)} tensors of LoRA adapter {name}"})
            tensors = self._lora_staged.pop(name)
            cfg = self._lora_staged_cfg.pop(name, None)
            if cfg is None:
                return self._lora_reply(False, f"Failed to load LoRA adapter {name}: no config_dict was sent")
            if b.get("abort_all_requests"):
                self.server.scheduler.abort(abort_all=True, message="aborted for weight update")
            async with self.lora_lock:
                refused = self._lora_load_refused(name, replacing=True)
                if refused:
                    return self._lora_reply(False, refused)
                try:
                    slot = await self.server.scheduler.run_on_engine(self.server.runner.load_lora, cfg, tensors, name)
                except (ValueError, RuntimeError) as e:
                    log.error("load_lora_adapter_from_distributed %s failed: %s", name, e)
                    return self._lora_reply(False, f"Failed to load LoRA adapter {name}: {e}")
                old = self.server.loras.bind(name, slot, f"distributed:{group_name}@{b['weight_version']}")
                self.server.request_loras.free_if_dead(old)
                self.server._set_version(str(b["weight_version"]))
        log.info("loaded LoRA adapter %s from group %s (slot %s, weight_version %s)", name, group_name, slot,
                 b["weight_version"])
        return self._lora_reply(True)
