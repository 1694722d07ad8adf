"""Trainable values a learner keeps outside its RLModule: SAC's entropy temperature ``log_alpha``.

Why: RLlib's ``Learner.get_state`` holds the RLModule's parameters and each optimizer's state
(moments, steps, param groups), not the values of parameters a learner trains with an optimizer
without making them module parameters. SAC's ``curr_log_alpha`` (trained by its "alpha" optimizer)
is one: through ``get_state`` / ``set_state`` alone (RLlib's own checkpoints too) its Adam moments
come back but alpha returns to ``initial_alpha``, and the restored learner is not the saved one.

How: each such value is stored with the optimizer that trains it, under :data:`OUTSIDE_MODULE` in
that optimizer's entry of the ``optimizer`` state (in the order of its param groups); RLlib's
``set_state`` ignores the key and :func:`set_outside_params` writes the values back in place. A
version saved without the key restores as before.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from ....errors import RestoreError

__all__ = ["OUTSIDE_MODULE", "registered_optimizers", "with_outside_params", "set_outside_params"]

OUTSIDE_MODULE = "params_outside_module"


def registered_optimizers(learner: Any) -> List[Tuple[str, str, Any]]:
    """(module id, optimizer name, optimizer) of every optimizer the learner registered (per module
    or for all modules), through RLlib's public ``get_optimizers_for_module``."""
    from ray.rllib.core import ALL_MODULES

    return [(mid, name, opt) for mid in [*learner.module.keys(), ALL_MODULES]
            for name, opt in learner.get_optimizers_for_module(mid)]


def _outside(learner: Any) -> Dict[str, List[Any]]:
    """{optimizer's registration name: the parameters of its param groups that no module holds}."""
    in_modules = {id(p) for mid in learner.module.keys() for p in learner.module[mid].parameters()}
    out: Dict[str, List[Any]] = {}
    for mid, name, opt in registered_optimizers(learner):
        params = [p for g in opt.param_groups for p in g["params"] if id(p) not in in_modules]
        if params:
            out[f"{mid}_{name}"] = params  # the key of its entry in Learner.get_state's optimizer state
    return out


def with_outside_params(learner: Any, optimizer_state: Dict[str, Any],
                        only: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """``optimizer_state`` (RLlib's ``get_state`` of ``learner``'s optimizers, a fresh dict) with
    each optimizer's outside-module parameter values added (copies); ``only``: just those optimizers."""
    keep = None if only is None else set(only)
    for name, params in _outside(learner).items():
        if name in optimizer_state and (keep is None or name in keep):
            optimizer_state[name] = {**optimizer_state[name],
                                     OUTSIDE_MODULE: [p.detach().cpu().numpy().copy() for p in params]}
    return optimizer_state


def set_outside_params(learner: Any, optimizer_state: Dict[str, Any]) -> None:
    """Write the stored outside-module values of ``optimizer_state`` into ``learner``'s parameters."""
    import torch

    outside = _outside(learner)
    for name, saved in optimizer_state.items():
        values = saved.get(OUTSIDE_MODULE) if isinstance(saved, dict) else None
        if values is None:
            continue
        params = outside.get(name, [])
        if len(params) != len(values):
            raise RestoreError(f"optimizer {name!r}: the version holds {len(values)} parameter(s) outside the "
                               f"RLModule, the learner trains {len(params)}")
        with torch.no_grad():
            for p, v in zip(params, values):
                t = torch.as_tensor(np.asarray(v))
                if tuple(t.shape) != tuple(p.shape):
                    raise RestoreError(f"optimizer {name!r}: a parameter outside the RLModule has shape "
                                       f"{tuple(p.shape)}, the version holds {tuple(t.shape)}")
                p.copy_(t.to(p.dtype))
