"""A framework integration's names imported on first use (a package's module ``__getattr__``), so
``import ray_ckpt.integrations.<framework>`` works without the framework, and using a name that
needs it says which extra to install. No framework import here."""
from __future__ import annotations

import importlib
from typing import Any, Dict, Sequence


def lazy_attribute(package: str, namespace: Dict[str, Any], lazy: Dict[str, str], name: str,
                   needs: Sequence[str], what: str) -> Any:
    """``package.name`` from its module ``lazy[name]``, kept in the package's ``namespace`` once
    imported. An ImportError mentioning one of ``needs`` (the framework's modules) becomes one that
    says ``what`` is needed and the ``pip install "ray-ckpt[<package's last name>]"`` line."""
    if name not in lazy:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f".{lazy[name]}", package)
    except ImportError as exc:
        if not any(m in str(exc) for m in needs):
            raise
        extra = package.rsplit(".", 1)[-1]
        raise ImportError(f'{package}.{name} needs {what}: pip install "ray-ckpt[{extra}]" ({exc})') from None
    value = getattr(module, name)
    namespace[name] = value
    return value
