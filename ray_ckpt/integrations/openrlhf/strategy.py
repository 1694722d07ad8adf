"""``RayCkptDeepspeedStrategy``: OpenRLHF's ``DeepspeedStrategy`` with ``save_ckpt`` / ``load_ckpt``
on ray_ckpt.

OpenRLHF's actors call ``strategy.save_ckpt(model, <ckpt.path>/_actor, "global_stepN", max_num,
max_mem, client_states)`` on every rank and resume with ``strategy.load_ckpt(model,
<ckpt.path>/_actor)``; this class keeps both signatures and their meaning. What a version of step
N holds, by state name (run ``<args.ray_ckpt.run>-<basename of save_dir>``):

======== ================================== ===================================================
state    pushed by                          holds
======== ================================== ===================================================
optim    every rank (``TensorChunk`` boxes) fp32 masters and Adam moments of the rank's ZeRO range
                                            of every trainable parameter, placed in the flattened
                                            parameter; under ``frozen``, the rank's range of every
                                            frozen parameter's 16-bit values
module   rank 0's copy (replicated)         the module's persistent buffers
extra    rank 0's copy (replicated)         client_state, LR scheduler, optimizer step and lrs,
                                            engine counters, world size, stage, tag, layout
rng      every rank (rank-local)            ``rc.rng_state()`` (restored at the same world size)
======== ================================== ===================================================

The 16-bit weights of trainable parameters are not stored: DeepSpeed's step sets them to the cast
of their fp32 masters, so a load casts them again (ZeRO-1/2: ``update_lp_params``; ZeRO-3: each
rank its ``ds_tensor`` range), bit-equal. Versions of layout 1 (no ``layout`` in extra) stored
ZeRO-1/2's full 16-bit module state in ``module`` and nothing of ZeRO-3's frozen parameters; they
still load.

``save_ckpt`` pushes and returns, no file written by the call; only the first call for a save_dir is
collective (rank 0 gets or creates the run and declares its states while the others wait: ``_run``,
``_declare``), later ones wait for no other rank. With ``overlap`` (the
default) the ``optim`` state is views of the live partition, flattened once and reused while the
partition's buffers stay (``partition.py``); its copy into the object store runs on a background thread while the rank trains on, and the inner
torch optimizer's ``step`` (which changes the fp32 masters and moments in place, before DeepSpeed
casts them into the 16-bit weights) waits for that copy first; ``load_ckpt`` waits for it too. A
background thread per run waits for the commit, then rank 0 writes the pointer, OpenRLHF's
``metric.json`` and DeepSpeed's ``latest`` (``tracker.py``). Retention is the run's ``keep_last`` (``max_num`` by
default), applied by the engine after a commit, so a failed save never leaves fewer than
``max_num`` committed versions."""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import deepspeed
import torch
import torch.distributed as dist
from openrlhf.utils.deepspeed import DeepspeedStrategy

import ray_ckpt as rc
from ray_ckpt import InvalidArgumentError, RestoreError, SaveError

from . import zero
from .partition import PartitionCache
from .settings import OpenRLHFSettings, read_settings
from ..committed import (broadcast_error, drop_lost_pointer, error_line, newest_committed_pointer, rank0_decides,
                         read_pointer, step_lost, wait_committed, wait_done, watch_saves, write_pointer)
from .runs import Run as _Run, Save as _Save
from .tracker import advance_latest, read_latest, step_of_tag

log = logging.getLogger("ray_ckpt.openrlhf")

OPTIM, MODULE, EXTRA, RNG = "optim", "module", "extra", "rng"
# what a version holds (extra["layout"]): 2 stores no 16-bit weight of a trainable parameter, and
# the frozen parameters in optim["frozen"]; 1 (no layout key) stored ZeRO-1/2's whole module state
LAYOUT = 2


class RayCkptDeepspeedStrategy(DeepspeedStrategy):
    """OpenRLHF's ``DeepspeedStrategy`` whose checkpoints are ray_ckpt versions: ``save_ckpt``
    returns once this rank's ZeRO partition is in Ray's object store; ``load_ckpt`` reads a version
    saved on any data-parallel size and ZeRO stage (1, 2, 3). Needs ``args.ray_ckpt.run`` (see
    ``settings.py``: ``--ray_ckpt.*`` flags); with ``args.ray_ckpt.local_dir`` rank 0 creates the
    run, without it every rank connects to a run the driver created."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        settings = read_settings(self.args)
        if settings is None:
            raise InvalidArgumentError("RayCkptDeepspeedStrategy needs args.ray_ckpt.run (--ray_ckpt.run) and, on "
                                       "the ranks that create the run, --ray_ckpt.local_dir; see docs/openrlhf.md")
        if self.stage not in (1, 2, 3):
            raise InvalidArgumentError(f"RayCkptDeepspeedStrategy saves ZeRO stages 1, 2 and 3 (--ds.zero_stage "
                                       f"{self.stage})")
        if self.ring_attn_size != 1 or self.ds_tensor_parallel_size != 1:
            raise InvalidArgumentError("RayCkptDeepspeedStrategy saves data-parallel ZeRO only (--ds.ring_attn_size "
                                       "and --ds.tensor_parallel_size must be 1)")
        self.ray_ckpt: OpenRLHFSettings = settings
        self._runs: Dict[str, _Run] = {}
        self._loaded: Dict[str, Tuple[str, int]] = {}  # load_dir -> (run, step) loaded before its run's first save
        self._lock = threading.Lock()
        self._partitions = PartitionCache()
        self.last_block_s: Optional[float] = None  # how long the last save_ckpt blocked this rank
        self.last_load_wait_s: Optional[float] = None

    def _ds_init_train_model(self, model: Any, cfg: dict) -> Any:
        """OpenRLHF's training set-up, then a check that this module can save the optimizer
        DeepSpeed chose (``zero.check_engine``): an unsupported one is refused here, not at the
        first save."""
        out = super()._ds_init_train_model(model, cfg)
        wrapped = out[0]
        engine = wrapped if isinstance(wrapped, deepspeed.DeepSpeedEngine) else getattr(wrapped, "model", None)
        if isinstance(engine, deepspeed.DeepSpeedEngine):
            zero.check_engine(engine)
        return out

    # ------------------------------------------------------------------ set-up (collective once per run)
    def _world(self) -> Tuple[int, int]:
        if dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _collective_error(self, error: Optional[str]) -> None:
        broadcast_error(error, self._world()[1])

    def _run(self, save_dir: str, max_num: Optional[int] = None) -> _Run:
        """This rank's engine of ``save_dir``'s run: rank 0 creates it (get-or-create, with
        ``max_num`` as its ``keep_last``) or connects, then the others connect (a collective, on
        the first save only)."""
        key = os.path.abspath(save_dir)
        run = self._runs.get(key)
        if run is not None:
            return run
        s, name = self.ray_ckpt, self.ray_ckpt.run_of(save_dir)
        keep = self._keep_last(max_num)
        engine, error = None, None
        if self._world()[0] == 0:
            try:
                if s.creates and keep is not None:
                    engine = rc.CheckpointEngine.create(name, **dict(s.create, keep_last=keep), reconfigure=True)
                elif s.creates:
                    engine = rc.CheckpointEngine.create(name, **s.create)
                else:
                    engine = rc.CheckpointEngine.connect(name, timeout=s.connect_timeout_s)
            except Exception as exc:
                error = f"ray_ckpt run {name!r} could not be {'created' if s.creates else 'connected'} on rank 0: " \
                        f"{error_line(exc)}"
        self._collective_error(error)
        if engine is None:
            engine = rc.CheckpointEngine.connect(name, timeout=s.connect_timeout_s)
        run = self._runs[key] = _Run(name, engine, self._world()[0])
        run.kept = keep
        if self._loaded.get(key, ("", 0))[0] == name:  # loaded before this first save (a resume)
            run.used.resumed(engine, self._loaded[key][1])
        threading.Thread(target=self._watch, args=(run,), name=f"ray_ckpt-{name}", daemon=True).start()
        return run

    def preemption_save_due(self, save_dir: str) -> bool:
        """Whether to save this step for a preemption notice (Ray drains a node of the run with a
        deadline; the run copies that node's only copies away meanwhile): rank 0 asks the run (the
        first step after the notice, then each step after rank 0's newest push is off the drained
        nodes: ``CheckpointEngine.preemption_save_due``), and every rank gets its answer, so all of
        them save the same step. Collective:
        call it on every rank at each step boundary, e.g.
        ``if step % args.save_steps == 0 or strategy.preemption_save_due(args.ckpt_path): strategy.save_ckpt(...)``.
        The first call sets the run up (as the first ``save_ckpt`` does)."""
        run = self._run(save_dir)
        rank, world = self._world()
        due = run.engine.preemption_save_due() is not None if rank == 0 else False
        return bool(rank0_decides(due, world))

    # (name, replicated) of every version, whatever the stage: a run's declarations outlive a
    # change of stage
    STATES = ((OPTIM, False), (MODULE, True), (EXTRA, True), (RNG, False))

    def _declare(self, run: _Run, states: tuple) -> None:
        """First save of this run (or of another stage): rank 0 declares the states, then every
        rank goes on; OpenRLHF calls save_ckpt on every rank, so this collective is matched."""
        rank, world = self._world()
        error = None
        if rank == 0:
            try:
                for name, replicated in states:
                    run.engine.register(name, world_size=world, replicated=replicated, replace=True)
            except Exception as exc:
                error = f"ray_ckpt run {run.name!r}: declaring the states failed: {error_line(exc)}"
        self._collective_error(error)
        run.declared = (states, world)

    def _keep_last(self, max_num: Optional[int]) -> Optional[int]:
        """The ``keep_last`` that ``max_num`` asks for, or None when the run's own applies (an
        explicit ``--ray_ckpt.keep_last``, a run this strategy only connects to, or no max_num)."""
        s = self.ray_ckpt
        if not max_num or "keep_last" in s.create or not s.creates or not s.apply_max_num:
            return None
        return int(max_num)

    def _keep_newest(self, run: _Run, max_num: Optional[int]) -> None:
        """``max_num`` as the run's ``keep_last`` (rank 0, only when it changes); the engine prunes
        after a commit, so the versions kept never drop below ``max_num`` committed ones (OpenRLHF's
        own rotation deletes before it saves)."""
        keep = self._keep_last(max_num)
        if keep is None or keep == run.kept:
            return
        run.engine = rc.CheckpointEngine.create(run.name, **dict(self.ray_ckpt.create, keep_last=keep),
                                                reconfigure=True)
        run.kept = keep

    # ------------------------------------------------------------------ save
    def save_ckpt(self, model, save_dir, tag=None, max_num=3, max_mem=1000, client_state=None, save_latest=True,
                  metric_value=None, metric_key=None):
        """Push this rank's share of version ``tag`` (``global_step<N>``: step N; another tag: the
        engine's ``global_steps``) and return. ``<save_dir>/<tag>/ray_ckpt.json``, ``metric.json``
        and ``<save_dir>/latest`` are written by rank 0 once the version commits. ``max_mem`` is
        not applied (the run's retention counts versions). A save of this run that failed in the
        background is raised here (``rc.SaveError`` naming its step) before anything is pushed."""
        t0 = time.perf_counter()
        assert isinstance(model, deepspeed.DeepSpeedEngine)
        rank, world = self._world()
        zero.check_engine(model)  # an engine prepared elsewhere: refused before anything is pushed
        tag = tag or f"global_step{model.global_steps}"
        step = step_of_tag(tag)
        step = int(model.global_steps) if step is None else step
        run = self._run(save_dir, max_num)
        self._raise_failures(run)
        # a step the run used for a version lost with a node (a resume from the one before it redoes
        # it) is not saved again (``committed.UsedSteps``); each rank decides alone, as each pushes alone
        # (no collective: a rank that died before its save must not stall the others here)
        if not run.used.free(run.engine, step):
            if rank == 0:  # the lost version's pointer: a load of the tag says the step never committed
                drop_lost_pointer(os.path.join(os.path.abspath(save_dir), tag), run.engine, step)
            self.last_block_s = time.perf_counter() - t0
            return None
        if rank == 0:
            self._keep_newest(run, max_num)
        if run.declared != (self.STATES, world):
            self._declare(run, self.STATES)
        eng = run.engine
        partition, frozen = self._partitions.get(model)
        if rank == 0:  # first: a client_state ray_ckpt cannot store fails here, before any part is pushed
            sched = model.lr_scheduler.state_dict() if model.lr_scheduler is not None else None
            extra = {"client_state": dict(client_state or {}), "lr_scheduler": sched, "tag": tag,
                     "optimizer": zero.optimizer_scalars(model), "moments": zero.moment_keys(model),
                     "zero_stage": zero.stage_of(model), "world_size": world, "layout": LAYOUT, "frozen": frozen,
                     "global_steps": int(model.global_steps), "global_samples": int(model.global_samples),
                     "skipped_steps": int(model.skipped_steps)}
        else:
            extra = {}  # a replicated state: rank 0's copy is stored
        # the overlapped push last: its copy starts at once and would take the cores (and the GIL)
        # from the small pushes after it
        with eng.push_group():  # the copy begins, and the parts leave, once all four are captured
            handles = [eng.submit(step, EXTRA, extra, rank=rank),
                       eng.submit(step, MODULE, zero.buffers(model) if rank == 0 else {}, rank=rank),
                       eng.submit(step, RNG, rc.rng_state(), rank=rank),
                       eng.submit(step, OPTIM, partition, rank=rank, overlap_with=self._fenced(model))]
        metric = (metric_value, metric_key) if metric_value is not None or metric_key is not None else None
        save = _Save(step, tag, os.path.join(os.path.abspath(save_dir), tag), handles, bool(save_latest), metric)
        with self._lock:
            run.saves.append(save)
        run.jobs.put(save)
        self.last_block_s = time.perf_counter() - t0
        return None

    def _fenced(self, model: Any) -> Optional[Tuple[Any, ...]]:
        """What an overlapped push of the partition fences: the torch optimizer DeepSpeed's ZeRO
        optimizer wraps (its params are the fp32 partitions, its state the moments; its ``step``
        is the only in-place change of them in training). None (a synchronous copy) without
        ``overlap`` or where that inner optimizer is no ``torch.optim.Optimizer`` (no step hook)."""
        if not self.ray_ckpt.overlap:
            return None
        inner = getattr(model.optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            return (inner,)
        if not getattr(self, "_warned_sync", False):
            self._warned_sync = True
            log.warning("ray_ckpt: the ZeRO optimizer wraps %s, not a torch.optim.Optimizer: its step cannot be "
                        "fenced, so save_ckpt copies the partition before it returns", type(inner).__name__)
        return None

    def _watch(self, run: _Run) -> None:
        """Background: wait for each save's commit (in order); rank 0 then writes the files
        OpenRLHF's resume reads."""
        watch_saves(run.jobs, lambda save, results: self._committed(run, save, results),
                    lambda save: f"{save.tag} (step {save.step}, run {run.name!r})",
                    lambda text: run.failures.append(text), self._lock, log)  # run.failures is replaced when raised

    def _committed(self, run: _Run, save: _Save, results: List[Any]) -> None:
        if self._world()[0] != 0:
            return
        version = results[0].version if results else save.step
        write_pointer(save.tag_dir, {"run": run.name, "step": save.step, "version": version, "tag": save.tag,
                                     "world_size": self._world()[1], "format": "ray_ckpt",
                                     "committed_at": time.time()})
        if save.metric is not None:
            self._write_ckpt_metric(save.tag_dir, save.metric[0], metric_key=save.metric[1])
        if save.save_latest:
            advance_latest(os.path.dirname(save.tag_dir), save.tag, save.step)

    def _raise_failures(self, run: _Run) -> None:
        with self._lock:
            failures, run.failures = run.failures, []
            run.saves = [s for s in run.saves if not s.done.is_set()]
        if failures:
            raise SaveError("ray_ckpt: " + "; ".join(failures))

    def wait_until_finished(self, timeout: Optional[float] = None) -> None:
        """Return once every save this rank issued has committed (rank 0: its files written);
        raise the first failure (``rc.SaveError``), or ``rc.SaveTimeoutError`` after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for run in list(self._runs.values()):
            with self._lock:
                saves = list(run.saves)
            for save in saves:
                wait_done(save, deadline, timeout, save.tag)
            self._raise_failures(run)

    # ------------------------------------------------------------------ load
    def _wait_committed(self, engine: "rc.CheckpointEngine", run: str, step: int) -> None:
        """Return once ``step`` is committed (``committed.wait_committed``, up to ``load_wait_s``)."""
        self.last_load_wait_s = wait_committed(engine, run, step, self.ray_ckpt.load_wait_s)

    def _locate(self, load_dir: str, tag: Optional[str]) -> Optional[Tuple[str, str, int]]:
        """(tag_dir, run, step) of what ``load_ckpt(load_dir, tag)`` names, or None (nothing there)."""
        tag = tag or read_latest(load_dir)
        if tag is None:
            return None
        tag_dir = os.path.join(os.path.abspath(load_dir), tag)
        pointer = read_pointer(tag_dir)
        if pointer is not None:
            return tag_dir, str(pointer["run"]), int(pointer["step"])
        step = step_of_tag(tag)  # a version still in flight has no pointer yet
        return (tag_dir, self.ray_ckpt.run_of(load_dir), step) if step is not None else None

    def _before_lost(self, load_dir: str, run_name: str, engine: "rc.CheckpointEngine", lost: int) -> Tuple[str, int]:
        """(tag_dir, step) to resume from when ``<load_dir>/latest`` names a version lost with its node
        (a preemption whose deadline it missed): the newest committed version with a tag folder here.
        The run redoes the steps after it; the lost step is not saved again (``save_ckpt``)."""
        root = os.path.abspath(load_dir)
        found = newest_committed_pointer((os.path.join(root, d) for d in sorted(os.listdir(root))), run_name,
                                         engine.all_steps())
        if found is None:
            raise RestoreError(f"{root}/latest names step {lost} of ray_ckpt run {run_name!r}, a version that is gone "
                               f"(lost with a node, or rolled back), and no committed version of the run has a tag "
                               f"folder in {root}; committed steps: {engine.all_steps()[-8:] or 'none'}")
        log.warning("ray_ckpt: %s/latest names step %d of run %r, a version lost with a node (or rolled back): "
                    "resuming from step %d, the newest committed version", root, lost, run_name, found[1])
        return found

    def load_ckpt(self, model, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                  load_lr_scheduler_states=True, load_module_only=False):
        """Fill this rank's ZeRO partition, 16-bit weights, scheduler, engine counters (and RNG,
        at the same world size) from the version ``tag`` of ``load_dir`` (default: the tag in
        ``<load_dir>/latest``, or the newest committed version when that one was lost with its
        node), saved on any data-parallel size and ZeRO stage. Returns
        ``(path, client_state)``, or ``(None, {})`` when ``load_dir`` holds no checkpoint."""
        assert isinstance(model, deepspeed.DeepSpeedEngine)
        rc.fence()  # a save's overlapped copy still reading the partition this load overwrites ends first
        where = self._locate(load_dir, tag)
        if where is None:
            self.print(f"Warning: [ray_ckpt] No checkpoint found at {load_dir}, skipping checkpoint loading.")
            return None, {}
        tag_dir, run_name, step = where
        known = self._runs.get(os.path.abspath(load_dir))
        engine = known.engine if known is not None and known.name == run_name else \
            rc.CheckpointEngine.connect(run_name, timeout=self.ray_ckpt.connect_timeout_s)
        if tag is None and read_pointer(tag_dir) is not None and step_lost(engine, step):
            tag_dir, step = self._before_lost(load_dir, run_name, engine, step)
        self._wait_committed(engine, run_name, step)
        extra = engine.load(EXTRA, step=step, rank=0)
        module = engine.load(MODULE, step=step, rank=0)  # layout 2: the buffers (see the module)
        if load_module_only or not load_optimizer_states:
            self._load_module(model, engine, step, extra, module)
        else:
            self._load_partition(model, engine, step, extra, module)
        if not load_module_only:
            if load_lr_scheduler_states and model.lr_scheduler is not None and extra.get("lr_scheduler") is not None:
                model.lr_scheduler.load_state_dict(extra["lr_scheduler"])
            model.global_steps = int(extra["global_steps"])
            model.global_samples = int(extra["global_samples"])
            model.skipped_steps = int(extra["skipped_steps"])
        # committed steps after the one loaded: their redo is not saved again (``committed.UsedSteps``)
        if known is not None and known.name == run_name:
            known.used.resumed(engine, step)
        else:
            self._loaded[os.path.abspath(load_dir)] = (run_name, step)
        rank, world = self._world()
        if int(extra["world_size"]) == world:
            rc.set_rng_state(engine.load(RNG, step=step, rank=rank))
        elif rank == 0:
            log.warning("ray_ckpt: %s was saved by %s ranks and is loaded on %s: the RNG states were not restored "
                        "(they are per rank); the ZeRO partitions were resharded", tag_dir, extra["world_size"], world)
        return tag_dir, dict(extra.get("client_state") or {})

    def _full_fp32(self, engine: "rc.CheckpointEngine", step: int):
        """name -> the full fp32 parameter (read once, on first use: only a ZeRO-1/2 load that
        cannot cast its 16-bit weights from the fp32 ranges -- a layout-1 version saved by ZeRO-3,
        a DeepSpeed without ``update_lp_params`` -- needs it)."""
        cache: Dict[str, Any] = {}

        def full(name: str) -> Any:
            if not cache:
                cache.update(engine.load(OPTIM, step=step, rank=None)[zero.FP32])
            return cache[name]
        return full

    def _agree(self, error: Optional[BaseException], what: str) -> None:
        """Every rank learns whether every rank got this far (a collective follows: a rank that
        failed must not leave the others waiting in it); this rank's own error is raised as it is."""
        rank, world = self._world()
        errors: List[Optional[str]] = [None] * world
        if world > 1:
            dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            raise RestoreError(f"ray_ckpt: {what} failed on rank {bad[0][0]}: {bad[0][1]}")

    def _read_ranges(self, model, engine, step: int, extra: Dict[str, Any], keys: List[str]) -> List[Any]:
        """Read this rank's fp32 ranges (and moments ``keys``; ``[]``: the fp32 masters alone) and
        frozen parameters into the live partition; returns the slots."""
        rank = self._world()[0]
        target, ss, in_place = zero.target_state(model, keys)
        frozen = list(extra.get("frozen") or [])
        put_back = lambda: None  # noqa: E731
        error = None
        try:
            if frozen:
                target[zero.FROZEN], put_back = zero.frozen_targets(model, frozen)
            engine.load_into(OPTIM, target, step=step, rank=rank, strict=bool(keys))
        except Exception as exc:
            error = exc
        if self._casts_lp(model, extra):
            self._agree(error, f"reading step {step}'s ZeRO partition")
        elif error is not None:
            raise error
        if not in_place:
            zero.set_ranges(target, ss, keys)
        put_back()
        return ss

    @staticmethod
    def _casts_lp(model, extra: Dict[str, Any]) -> bool:
        """ZeRO-1/2 loading a layout-2 version: the 16-bit weights are cast from the fp32 ranges
        (a collective)."""
        return zero.stage_of(model) in (1, 2) and int(extra.get("layout", 1)) >= 2

    def _set_lp(self, model, engine, step: int, extra: Dict[str, Any], ss: List[Any], module: Dict[str, Any]) -> None:
        """The 16-bit weights from the loaded fp32 masters (see the module), then the buffers."""
        if not (self._casts_lp(model, extra) and zero.update_lp(model)):
            zero.refresh_lp(model, ss, module, self._full_fp32(engine, step))
        zero.load_module_entries(model, module)

    def _load_partition(self, model, engine, step: int, extra: Dict[str, Any], module) -> None:
        keys = list(extra.get("moments") or [])
        if keys:
            zero.ensure_optimizer_state(model)
        ss = self._read_ranges(model, engine, step, extra, keys)
        zero.set_optimizer_scalars(model, extra.get("optimizer") or {})
        self._set_lp(model, engine, step, extra, ss, module)

    def _load_module(self, model, engine, step: int, extra: Dict[str, Any], module) -> None:
        """``load_module_only`` / no optimizer states: the 16-bit weights (the cast of the stored
        fp32 masters, or a layout-1 version's stored ones), then the fp32 masters refreshed from
        them (what DeepSpeed's ``refresh_fp32_params`` does after such a load); moments untouched."""
        ss = self._read_ranges(model, engine, step, extra, [])
        self._set_lp(model, engine, step, extra, ss, module)
        refresh = getattr(model.optimizer, "refresh_fp32_params", None)
        if refresh is not None:
            refresh()
