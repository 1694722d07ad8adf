"""Matching a target state against a stored one for ``load_into``: keys, shapes, dtypes, scalars.

Every key, shape and dtype is compared before the first byte of the target changes, so a mismatch
leaves the target as it was; these helpers say what differs in words a user can act on, and put
the non-tensor leaves (an optimizer's ``param_groups``) in place once the tensors are filled.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ..errors import RestoreError
from ..formats.nodes import leaf_key


def merge_scalars(target: Any, src: Any) -> None:
    """Put the non-tensor leaves of ``src`` (scalars, strings, tuples of them: an optimizer's
    param_groups) into ``target`` where both have them; tensors are left to the tensor pass."""
    import torch

    def has_tensor(x: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return True
        if isinstance(x, dict):
            return any(has_tensor(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return any(has_tensor(v) for v in x)
        return False

    def merge(t: Any, s: Any) -> None:
        if isinstance(t, dict) and isinstance(s, dict):
            keys = [k for k in t if k in s]
        elif isinstance(t, list) and isinstance(s, (list, tuple)) and len(t) == len(s):
            keys = range(len(t))
        else:
            return
        for k in keys:
            tv, sv = t[k], s[k]
            if isinstance(tv, (dict, list)):
                merge(tv, sv)
            elif isinstance(tv, torch.Tensor) or has_tensor(tv) or sv is None and tv is not None:
                continue
            elif not has_tensor(sv):
                t[k] = sv

    merge(target, src)


def tensor_keys(state: Any) -> Dict[str, Any]:
    """Leaf key -> tensor of every tensor leaf of ``state``."""
    from ..formats.shards import iter_tensor_leaves

    return {leaf_key(p): t for p, t in iter_tensor_leaves(state)}


def mismatch(key: str, t: Any, shape: Sequence[int], dtype: str) -> Optional[str]:
    tdt = str(t.dtype).replace("torch.", "")
    if tuple(t.shape) != tuple(shape) or tdt != dtype:
        return f"{key}: the target is shape {list(t.shape)} {tdt} but the checkpoint holds shape {list(shape)} {dtype}"
    return None


def match_tensor(key: str, t: Any, src: Any, jobs: List[Any], missing: List[str], bad: List[str]) -> None:
    """One target tensor against the saved tensor ``src`` (None: the checkpoint lacks ``key``): the
    key goes to ``missing``, a shape or dtype mismatch (in words) to ``bad``, else ``(t, src)`` to
    ``jobs``, the copies made once every key matched."""
    if src is None:
        missing.append(key)
        return
    why = mismatch(key, t, src.shape, str(src.dtype).replace("torch.", ""))
    bad.append(why) if why else jobs.append((t, src))


def refuse_mismatches(name: str, bad: List[str]) -> None:
    """A RestoreError naming the first mismatches, before anything of the target changed."""
    if bad:
        raise RestoreError(f"state {name!r}: " + "; ".join(bad[:8]) + "; nothing was loaded")


def check_keys(name: str, missing: List[str], unexpected: List[str], strict: bool) -> str:
    def few(keys: List[str]) -> str:
        return ", ".join(keys[:8]) + (f" (+{len(keys) - 8} more)" if len(keys) > 8 else "")

    parts = []
    if missing:
        parts.append(f"not in the checkpoint: {few(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the target: {few(unexpected)}")
    if strict and parts:
        raise RestoreError(f"state {name!r}: keys do not match ({'; '.join(parts)}); nothing was loaded "
                           f"(strict=False skips them)")
    return ("skipped keys " + "; ".join(parts)) if parts else ""
