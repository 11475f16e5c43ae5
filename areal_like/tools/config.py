"""The tool config file (`rollout.tools_config`), in verl's shape:

    tools:
      - class_name: python            # built-in: python, search, calculator; or "pkg.mod.Class" (a Tool)
        config: {timeout_s: 5, ...}    # checked against the tool's Config dataclass: unknown keys are errors
        tool_schema: {type: function, function: {name, description, parameters}}   # optional for built-ins

Every mistake is a ValueError that names the file, the tool (`tools[i]`) and the key, and says what to
write instead: a typo in a limit must never silently become the default. Relative paths inside
`config` (the search corpus) are resolved from the current directory, like the rest of the run config.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import types
import typing
from typing import Any

import yaml

from areal_like.tools.base import Tool

BUILTIN_TOOLS: dict[str, str] = {
    "python": "areal_like.tools.python_tool.PythonTool",
    "search": "areal_like.tools.search.SearchTool",
    "calculator": "areal_like.tools.calculator.CalculatorTool",
}
"""Short `class_name`s. Imported on use, so a config without `search` never imports bm25s."""

_ENTRY_KEYS = ("class_name", "config", "tool_schema")
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


def load_tools(path: str) -> list[Tool]:
    """Build every tool the file declares, in order."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError:
        raise ValueError(f"tool config {path} does not exist: set rollout.tools_config to a YAML file "
                         "(examples in configs/tools/)") from None
    except yaml.YAMLError as e:
        raise ValueError(f"tool config {path} is not valid YAML: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tools"), list):
        raise ValueError(f"tool config {path}: the top level must be a mapping with a `tools:` list "
                         "(tools: [{class_name: python}], see configs/tools/python.yaml)")
    extra = sorted(set(doc) - {"tools"})
    if extra:
        raise ValueError(f"tool config {path}: unknown top-level key(s) {extra}; only `tools` is read")
    if not doc["tools"]:
        raise ValueError(f"tool config {path}: `tools` is empty: declare at least one tool")
    tools = []
    names: dict[str, int] = {}
    for i, entry in enumerate(doc["tools"]):
        tool = _build_tool(path, i, entry)
        if tool.name in names:
            raise ValueError(f"tool config {path}: tools[{i}] and tools[{names[tool.name]}] are both named "
                             f"{tool.name!r}: give one a different tool_schema.function.name")
        names[tool.name] = i
        tools.append(tool)
    return tools


def _build_tool(path: str, i: int, entry: Any) -> Tool:
    where = f"tool config {path}: tools[{i}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a mapping with `class_name` (and optionally `config`, `tool_schema`), "
                         f"got {entry!r}")
    extra = sorted(set(entry) - set(_ENTRY_KEYS))
    if extra:
        raise ValueError(f"{where}: unknown key(s) {extra}; a tool entry has only {', '.join(_ENTRY_KEYS)}")
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name:
        raise ValueError(f"{where}.class_name is missing: use one of {', '.join(BUILTIN_TOOLS)} or a dotted path "
                         "to a Tool subclass (pkg.module.Class)")
    where = f"{where} ({class_name})"
    cls = resolve_tool_class(class_name, where)
    raw_config = entry.get("config") or {}
    if not isinstance(raw_config, dict):
        raise ValueError(f"{where}.config must be a mapping of settings, got {type(raw_config).__name__}")
    config = build_config(cls.Config, raw_config, f"{where}.config") if cls.Config is not None else raw_config
    schema = entry.get("tool_schema")
    if schema is not None:
        schema = check_schema(schema, f"{where}.tool_schema")
        params = schema["function"].get("parameters") or {}
        missing = [a for a in cls.required_arguments if a not in (params.get("properties") or {})]
        if missing:
            raise ValueError(f"{where}.tool_schema.function.parameters.properties lacks {missing}: the "
                             f"{class_name} tool reads these arguments, so its schema must declare them")
    elif cls.default_schema is None:
        raise ValueError(f"{where}.tool_schema is missing: {class_name} has no default schema, so give "
                         "`tool_schema: {type: function, function: {name, description, parameters}}`")
    try:
        return cls(config, schema)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    except (OSError, ImportError) as e:
        raise ValueError(f"{where}: cannot be created: {e}") from None


def resolve_tool_class(class_name: str, where: str) -> type[Tool]:
    """A built-in short name or a dotted path to a `Tool` subclass."""
    dotted = BUILTIN_TOOLS.get(class_name, class_name)
    module_name, _, attr = dotted.rpartition(".")
    if not module_name:
        raise ValueError(f"{where}: unknown tool class {class_name!r}: use one of {', '.join(BUILTIN_TOOLS)} "
                         "or a dotted path to a Tool subclass (pkg.module.Class)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{where}: cannot import {module_name} for class_name {class_name!r}: {e}") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(f"{where}: {dotted} is not a subclass of areal_like.tools.Tool "
                         f"(found {type(cls).__name__ if cls is not None else 'nothing'})")
    return cls


def check_schema(schema: Any, where: str) -> dict:
    """An OpenAI function schema: {type: function, function: {name, description, parameters: {type:
    object, properties, required}}}."""
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"), dict):
        raise ValueError(f"{where} must be {{type: function, function: {{name, description, parameters}}}}")
    fn = schema["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}")
    if not isinstance(fn.get("description", ""), str):
        raise ValueError(f"{where}.function.description must be a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ValueError(f"{where}.function.parameters must be a JSON schema with type: object")
    props = params.get("properties", {})
    if not isinstance(props, dict):
        raise ValueError(f"{where}.function.parameters.properties must be a mapping of argument → schema")
    required = params.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        raise ValueError(f"{where}.function.parameters.required must list argument names found in properties "
                         f"({', '.join(props) or 'none'}), got {required!r}")
    return schema


def build_config(cls: type, raw: dict, where: str) -> Any:
    """An instance of the dataclass `cls` from a YAML mapping: unknown keys, missing required keys and
    wrong types are errors naming the key; ints are accepted where floats are expected."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys: {', '.join(fields)} "
                         "(fix the spelling or remove it)")
    missing = [n for n, f in fields.items() if n not in raw and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where}: missing required key(s) {missing}")
    values = {}
    for key, value in raw.items():
        ok, converted = _coerce(value, hints[key])
        if not ok:
            raise ValueError(f"{where}.{key} must be {_type_name(hints[key])}, got {value!r}")
        values[key] = converted
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        for arg in typing.get_args(tp):
            ok, v = _coerce(value, arg)
            if ok:
                return True, v
        return False, None
    if tp is type(None):
        return value is None, None
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else None
    if tp is str:
        return isinstance(value, str), value
    origin = typing.get_origin(tp) or tp
    if origin in (list, dict):
        return isinstance(value, origin), value
    return True, value  # a type we do not check


def _type_name(tp: Any) -> str:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))
