"""A rank's DeepSpeed ZeRO partition as boxes of each flattened parameter, and back.

ZeRO keeps, per rank, the fp32 master copy and the Adam moments of a slice of the parameters:

* ZeRO-1/2 (``DeepSpeedZeroOptimizer``; and ``BF16_Optimizer``, which DeepSpeed builds instead on
  ZeRO-1 for bf16 parameters with fp32 gradient accumulation, partitioned the same way): the
  parameters of a group are flattened one after another into one buffer, cut into
  equal partitions; rank r's partition covers a range of that buffer, so a range (possibly empty)
  of each parameter it touches, starting and ending anywhere (``param._hp_mapping``:
  ``lp_fragment_address`` is the range within the parameter, ``hp_fragment`` the fp32 view);
* ZeRO-3: every parameter is flattened and padded to a multiple of the world size, rank r holds
  elements ``[r * n, (r + 1) * n)`` (``safe_get_local_fp32_param`` /
  ``safe_get_local_optimizer_state``).

Either way a rank's share of parameter ``name`` is one contiguous range of the flattened
parameter, so it is pushed as a :class:`~ray_ckpt.formats.sharded_leaf.TensorChunk`: the range and its
place in a 1-D tensor of ``numel`` elements. The stored version then does not depend on the world
size or the stage; loading reads, for each range the new layout gives this rank, only the bytes
of the stored ranges it overlaps, and sets them (``safe_set_local_fp32_param`` /
``safe_set_local_optimizer_state`` on ZeRO-3; the fragment views on ZeRO-1/2, for which DeepSpeed
has no local setter)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ray_ckpt import InvalidArgumentError, RestoreError
from ray_ckpt.formats.sharded_leaf import TensorChunk

FP32 = "fp32"
FROZEN = "frozen"  # optim["frozen"]: the 16-bit values of the parameters the optimizer does not own


@dataclass
class Slot:
    """This rank's range of one trainable parameter, and how to reach its fp32 / moment views."""
    name: str
    param: Any
    numel: int
    start: int   # in the flattened parameter
    count: int   # elements this rank holds (0: none)
    view: Callable[[Optional[str]], Any]  # key None: the fp32 master range; else that moment's range
    set: Callable[[Optional[str], Any], None]  # writes a range of ``count`` elements


def stage_of(engine: Any) -> int:
    return int(engine.zero_optimization_stage())


def _moment_keys(state: Dict[str, Any], flat: Any) -> List[str]:
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == flat.shape)


# where each ZeRO optimizer keeps the fp32 flat partitions its inner optimizer steps: ZeRO-3's
# DeepSpeedZeroOptimizer_Stage3, ZeRO-1/2's DeepSpeedZeroOptimizer, and the BF16_Optimizer that
# DeepSpeed builds instead on ZeRO-1 with bf16 parameters and fp32 gradient accumulation (without
# an offloaded optimizer); the last two partition alike (``_hp_mapping`` fragments, ``update_lp_params``)
FLAT_GROUPS = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")


def flat_groups(engine: Any) -> List[Any]:
    """The fp32 flat partitions the base optimizer steps (its ``state`` is keyed by them)."""
    opt = engine.optimizer
    for name in FLAT_GROUPS:
        groups = getattr(opt, name, None)
        if groups is not None:
            return list(groups)
    raise InvalidArgumentError(f"RayCkptDeepspeedStrategy saves DeepSpeed's ZeRO optimizers (DeepSpeedZeroOptimizer, "
                               f"DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer); this engine's optimizer is "
                               f"{type(opt).__name__}, which keeps no fp32 partition it knows")


def check_engine(engine: Any) -> None:
    """Refuse an engine whose optimizer state this module cannot save (before any byte of it is
    pushed): a stage other than 1-3, an optimizer without known fp32 partitions."""
    stage = stage_of(engine)
    if stage not in (1, 2, 3):
        raise InvalidArgumentError(f"RayCkptDeepspeedStrategy saves ZeRO stages 1, 2 and 3 (zero_stage={stage})")
    flat_groups(engine)


def slots(engine: Any) -> List[Slot]:
    """This rank's range of every trainable parameter of a ZeRO-1/2/3 DeepSpeedEngine, in
    ``named_parameters`` order. ZeRO-0 (no partition) is refused (:func:`check_engine`)."""
    check_engine(engine)
    stage = stage_of(engine)
    opt = engine.optimizer
    base_state = opt.optimizer.state
    out = []
    if stage == 3:
        from deepspeed.utils import (safe_get_local_fp32_param, safe_get_local_optimizer_state,
                                     safe_set_local_fp32_param, safe_set_local_optimizer_state)

        rank = dist.get_rank(group=opt.dp_process_group)
        for name, p in engine.module.named_parameters():
            if not p.requires_grad:
                continue
            numel, part = int(p.ds_numel), int(p.ds_tensor.ds_numel)
            start = min(rank * part, numel)
            count = max(0, min(part, numel - start))

            def view(key, p=p, count=count):
                t = safe_get_local_fp32_param(p) if key is None else safe_get_local_optimizer_state(p, key)
                return t.reshape(-1).narrow(0, 0, count)

            def put(key, value, p=p, count=count):
                full = (safe_get_local_fp32_param(p) if key is None else
                        safe_get_local_optimizer_state(p, key)).reshape(-1).clone()  # keeps the padding
                full[:count].copy_(value.reshape(-1))
                if key is None:
                    safe_set_local_fp32_param(p, full)
                else:
                    safe_set_local_optimizer_state(p, full, key)

            out.append(Slot(name, p, numel, start, count, view, put))
        return out
    flats = flat_groups(engine)
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        m = getattr(p, "_hp_mapping", None)
        if m is None:
            out.append(Slot(name, p, p.numel(), 0, 0, lambda key: torch.empty(0), lambda key, v: None))
            continue

        def view(key, m=m):
            if key is None:
                return m.hp_fragment
            a = m.hp_fragment_address
            return base_state[flats[m.param_group_index]][key].narrow(0, a.start, a.numel)

        def put(key, value, view=view):
            view(key).copy_(value.reshape(-1))

        out.append(Slot(name, p, p.numel(), m.lp_fragment_address.start, m.lp_fragment_address.numel, view, put))
    return out


def moment_keys(engine: Any) -> List[str]:
    """The optimizer's per-element states (Adam: exp_avg, exp_avg_sq); [] before its first step."""
    flats = flat_groups(engine)
    state = engine.optimizer.optimizer.state
    return _moment_keys(state[flats[0]], flats[0]) if flats and flats[0] in state else []


def optimizer_scalars(engine: Any) -> Dict[str, Any]:
    """What is the same on every rank: each group's ``step`` and learning rate."""
    flats = flat_groups(engine)
    state = engine.optimizer.optimizer.state
    steps = []
    for f in flats:
        s = state.get(f, {}).get("step")
        steps.append(None if s is None else (s.item() if torch.is_tensor(s) else s))
    return {"steps": steps, "lrs": [g["lr"] for g in engine.optimizer.param_groups]}


def partition_state(engine: Any) -> Dict[str, Dict[str, TensorChunk]]:
    """This rank's partition: ``{"fp32": {name: chunk}, "<moment>": {name: chunk}}`` (views, no
    copy: the push copies them into the object store; ``partition.py`` keeps them across saves)."""
    keys = moment_keys(engine)
    out: Dict[str, Dict[str, TensorChunk]] = {FP32: {}}
    out.update({k: {} for k in keys})
    for s in slots(engine):
        for key in [None] + keys:
            out[key or FP32][s.name] = TensorChunk(s.view(key), (s.numel,), (s.start,))
    return out


def _frozen_range(engine: Any, p: Any) -> tuple:
    """(flat 16-bit view of this rank's range, numel, start) of frozen parameter ``p``: ZeRO-3's
    ``ds_tensor`` range (a partition like any other); on ZeRO-1/2, which replicate it, the rank's
    equal share of it, so that every rank copies a part of the frozen bytes, none all of them."""
    if stage_of(engine) == 3:
        rank = dist.get_rank(group=engine.optimizer.dp_process_group)
        numel, part = int(p.ds_numel), int(p.ds_tensor.ds_numel)
        start = min(rank * part, numel)
        return p.ds_tensor.data.reshape(-1).narrow(0, 0, max(0, min(part, numel - start))), numel, start
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    numel = p.numel()
    share = -(-numel // world)
    start = min(rank * share, numel)
    return p.data.reshape(-1).narrow(0, start, max(0, min(share, numel - start))), numel, start


def frozen_state(engine: Any) -> Dict[str, TensorChunk]:
    """This rank's range of every frozen parameter, as views (see :func:`_frozen_range`)."""
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            local, numel, start = _frozen_range(engine, p)
            out[name] = TensorChunk(local, (numel,), (start,))
    return out


def frozen_targets(engine: Any, names: List[str]) -> tuple:
    """``load_into`` targets of the frozen parameters ``names`` and a function that puts what was
    read in place: ZeRO-3 reads its ``ds_tensor`` range in place; ZeRO-1/2 read the whole
    parameter (every rank holds it all)."""
    params = dict(engine.module.named_parameters())
    missing = [n for n in names if n not in params or params[n].requires_grad]
    if missing:
        raise RestoreError(f"the checkpoint's frozen parameters {missing[:4]} are not frozen parameters of this "
                           f"model (requires_grad=False)")
    out, copies = {}, []
    for name in names:
        p = params[name]
        if stage_of(engine) == 3:
            local, numel, start = _frozen_range(engine, p)
        else:
            local, numel, start = p.data.reshape(-1), p.numel(), 0
            if not p.data.is_contiguous():  # reshape copied: read into it, then write it back
                copies.append((p, local))
        out[name] = TensorChunk(local, (numel,), (start,))

    def put_back() -> None:
        with torch.no_grad():
            for p, flat in copies:
                p.data.copy_(flat.reshape(p.shape))
    return out, put_back


def buffers(engine: Any) -> Dict[str, Any]:
    """The module's persistent buffers, by state_dict name: stored as they are, from rank 0 (no
    ZeRO stage partitions buffers; no parameter is gathered to find them)."""
    out = {}
    for prefix, m in engine.module.named_modules():
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def load_module_entries(engine: Any, stored: Dict[str, Any]) -> None:
    """The stored buffers into the module's buffers of the same name; and, from a layout-1 version
    (which stored ZeRO-1/2's whole 16-bit module state), its frozen parameters (ZeRO-3: the rank's
    ``ds_tensor`` range of each)."""
    with torch.no_grad():
        for name, b in engine.module.named_buffers():
            if name in stored and torch.is_tensor(b):
                b.copy_(stored[name])
        for name, p in engine.module.named_parameters():
            if p.requires_grad or name not in stored:
                continue
            if stage_of(engine) == 3:
                local, _, start = _frozen_range(engine, p)
                local.copy_(stored[name].reshape(-1).narrow(0, start, local.numel()))
            else:
                p.data.copy_(stored[name])


def update_lp(engine: Any) -> bool:
    """ZeRO-1/2: every rank casts its fp32 range into its 16-bit partition and the partitions are
    all-gathered (DeepSpeed's ``update_lp_params``, what its step does after the inner step; a
    collective). False where this DeepSpeed has no such call."""
    fn = getattr(engine.optimizer, "update_lp_params", None)
    if fn is None:
        return False
    fn()
    return True


def target_state(engine: Any, keys: List[str]) -> tuple:
    """This rank's partition as the ``load_into`` target, the slots, and whether the target is the
    live memory itself: ZeRO-1/2's fragment views are filled in place; ZeRO-3's ranges go through
    fresh buffers, then ``safe_set_local_*`` (:func:`set_ranges`)."""
    ss = slots(engine)
    in_place = stage_of(engine) in (1, 2)

    def local(s: Slot, key: Optional[str]) -> Any:
        if in_place and s.count:
            return s.view(key)
        return torch.empty(s.count, dtype=torch.float32)

    out = {key or FP32: {s.name: TensorChunk(local(s, key), (s.numel,), (s.start,)) for s in ss}
           for key in [None] + keys}
    return out, ss, in_place


def set_ranges(target: Dict[str, Dict[str, TensorChunk]], ss: List[Slot], keys: List[str]) -> None:
    """Hand each loaded range to DeepSpeed (a target that was not filled in place)."""
    with torch.no_grad():  # the fp32 partitions are leaves that require grad
        for s in ss:
            if s.count:
                for key in [None] + keys:
                    s.set(key, target[key or FP32][s.name].local)


def _step_value(engine: Any, step: float, old: Any) -> Any:
    """``step`` as the inner optimizer keeps it: torch's Adam a float32 tensor (or the dtype it
    had), DeepSpeedCPUAdam a Python int (its C++ update takes an integer)."""
    if torch.is_tensor(old):
        return torch.tensor(float(step), dtype=old.dtype)
    if isinstance(old, int) or not type(engine.optimizer.optimizer).__module__.startswith("torch."):
        return int(step)
    return torch.tensor(float(step))


def ensure_optimizer_state(engine: Any) -> None:
    """A fresh engine's base optimizer has no moments before its first step; give it zeroed ones
    (and ``step`` 0), as its own first step would create them, so that loaded ranges have a place."""
    state = engine.optimizer.optimizer.state
    for f in flat_groups(engine):
        st = state[f]
        if not st:
            st["step"] = _step_value(engine, 0, None)
            st["exp_avg"] = torch.zeros_like(f, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(f, memory_format=torch.preserve_format)


def set_optimizer_scalars(engine: Any, scalars: Dict[str, Any]) -> None:
    flats = flat_groups(engine)
    state = engine.optimizer.optimizer.state
    steps = [s for s in scalars.get("steps", []) if s is not None]
    if steps:
        if len(set(steps)) != 1:
            raise RestoreError(f"the saved optimizer groups disagree on their step: {steps}")
        for f in flats:
            state[f]["step"] = _step_value(engine, steps[0], state[f].get("step"))
    lrs = scalars.get("lrs") or []
    groups = engine.optimizer.param_groups
    if len(lrs) == len(groups):
        for g, lr in zip(groups, lrs):
            g["lr"] = lr


def refresh_lp(engine: Any, ss: List[Slot], module_weights: Dict[str, Any],
               full_fp32: Callable[[str], Any]) -> None:
    """Bring the 16-bit weights in line with the loaded fp32 masters (DeepSpeed's step writes
    ``lp = hp.to(lp dtype)`` too): ZeRO-3 casts this rank's range into ``ds_tensor``; ZeRO-1/2
    replicate every weight, so each takes the stored 16-bit weights (``module_weights``) or, for a
    version saved by ZeRO-3, casts the full fp32 parameter read from the checkpoint."""
    with torch.no_grad():
        if stage_of(engine) == 3:
            for s in ss:
                if s.count:
                    s.param.ds_tensor.data.reshape(-1)[:s.count].copy_(s.view(None))
            return
        for s in ss:
            if s.name in module_weights:
                s.param.data.copy_(module_weights[s.name])
            else:
                s.param.data.copy_(full_fp32(s.name).reshape(s.param.shape))
