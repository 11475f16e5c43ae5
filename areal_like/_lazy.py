"""PEP 562 lazy exports for a package's `__init__`: a name is imported from its submodule on first use, so
a process that imports one light submodule (a reward worker, an SGLang server importing the delta loader)
does not pay for the package's other imports. Standard library only."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`: `exports` maps each name to its submodule; a resolved name is
    stored in `namespace` (the package's globals), so later look-ups skip the hook."""
    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
