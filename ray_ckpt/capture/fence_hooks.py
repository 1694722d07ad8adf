"""The torch hooks that fence overlapped copies by themselves: an optimizer's step, a BatchNorm forward.

A registered state may only change in place after a fence (``overlap.py``). Most in-place changes
of a learner's state come from two places torch lets us hook without the learner's help: an
optimizer's ``step`` (its parameters and moments) and the forward of a module whose buffers change
in forward (running statistics). :func:`install_hooks` puts a fence in front of each, found among
the objects :func:`candidates` walks from the provider; no Ray here, and torch only if imported.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List


@dataclass
class HookSet:
    """The hooks installed in this process, by object id (weakly: an object gone drops its hook)."""

    handles: Dict[int, Any] = field(default_factory=dict)
    refs: Dict[int, Any] = field(default_factory=dict)

    def add(self, obj: Any, handle: Any) -> None:
        key = id(obj)
        self.handles[key] = handle
        self.refs[key] = weakref.ref(obj, lambda _r, k=key: (self.handles.pop(k, None), self.refs.pop(k, None)))

    def __contains__(self, obj: Any) -> bool:
        r = self.refs.get(id(obj))
        return r is not None and r() is obj

    def remove_all(self) -> None:
        for h in list(self.handles.values()):
            try:
                h.remove()
            except Exception:
                pass
        self.handles.clear()
        self.refs.clear()


def _optimizer_tensors(opt: Any) -> List[Any]:
    out = [p for g in opt.param_groups for p in g["params"]]
    for st in opt.state.values():
        if isinstance(st, dict):
            out.extend(v for v in st.values() if hasattr(v, "data_ptr"))
    return out


def candidates(root: Any, depth: int = 2) -> List[Any]:
    """Objects that may hold a registered state's tensors: ``root`` itself, its attributes, and the
    items of dict/list/tuple attributes (two levels) — where a learner keeps its model and optimizer."""
    out, seen = [], set()

    def visit(obj: Any, d: int) -> None:
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            return
        seen.add(id(obj))
        out.append(obj)
        if d <= 0:
            return
        if isinstance(obj, dict):
            children = list(obj.values())
        elif isinstance(obj, (list, tuple)):
            children = list(obj)
        elif hasattr(obj, "__dict__") and not _is_torch_leaf(obj):
            children = list(vars(obj).values())
        else:
            children = []
        for c in children[:1000]:
            visit(c, d - 1)

    visit(root, depth)
    return out


def _is_torch_leaf(obj: Any) -> bool:
    """Modules and optimizers are found as they are; their own attributes are not walked."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor))


def install_hooks(copier: Any, objects: Iterable[Any], hooks: HookSet) -> int:
    """Fence ``copier``'s copies (an :class:`~ray_ckpt.capture.overlap.OverlapCopier`: its ``busy``
    and ``fence(tensors=...)``) from torch's own hooks on the optimizers and modules among
    ``objects``: a step pre-hook on each optimizer, a forward pre-hook on each module whose buffers
    change in forward (BatchNorm-style running statistics). Idempotent; returns hooks added."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    added = 0
    norm_base = getattr(torch.nn.modules.batchnorm, "_NormBase", ())
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer) and obj not in hooks:
            def step_pre_hook(opt, args, kwargs, _c=copier):
                if _c.busy:
                    _c.fence(tensors=_optimizer_tensors(opt))
            hooks.add(obj, obj.register_step_pre_hook(step_pre_hook))
            added += 1
        elif isinstance(obj, torch.nn.Module):
            for m in obj.modules():
                if isinstance(m, norm_base) and getattr(m, "track_running_stats", False) and m not in hooks:
                    def forward_pre_hook(mod, args, _c=copier):
                        if _c.busy and mod.training:
                            _c.fence(tensors=[b for b in mod.buffers(recurse=False) if b is not None])
                    hooks.add(m, m.register_forward_pre_hook(forward_pre_hook))
                    added += 1
    return added
