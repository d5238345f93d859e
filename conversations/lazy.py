"""Re-exports loaded on first use (PEP 562), for packages whose light modules must stay
importable alone: importing ``conversations.providers.billing`` or
``conversations.importers.pi`` runs the package's ``__init__`` first, which must not pull
in the SDK clients or Django with a name it merely re-exports."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(
    package: str, namespace: dict[str, Any], table: Mapping[str, str]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``table[name]`` on first use and keeps the
    value in ``namespace`` (the package's globals), so the next lookup is a plain one."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
