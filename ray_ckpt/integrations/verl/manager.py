"""``RayCkptCheckpointManager``: verl's ``BaseCheckpointManager`` on ray_ckpt.

Every rank of a verl worker group builds one, in its own process, exactly as verl builds its
``FSDPCheckpointManager`` (``model=, optimizer=, lr_scheduler=, processing_class=,
checkpoint_config=``); the ray_ckpt settings come from ``checkpoint_config.ray_ckpt``
(``settings.py``). What a version of step N holds, by state name:

========== ============================== ====================================================
state      pushed by                      holds
========== ============================== ====================================================
model      every rank (DTensor shards)    ``model.state_dict()`` of the FSDP2 module
optimizer  every rank (DTensor shards)    ``optimizer.state_dict()`` (AdamW moments, steps, groups)
extra      every rank, stored once        the LR scheduler's state, the world size, the step
rng        every rank (rank-local)        ``rc.rng_state()`` of the rank's process
========== ============================== ====================================================

``save_checkpoint`` pushes and returns (with ``overlap``, the default, the pause is flattening the
state into views: the four parts are captured inside one ``engine.push_group()``, and their copies
into Ray's object store begin after it); a background thread per manager waits for the commit, then
rank 0 writes the pointer file and verl's tracker (``tracker.py``) and starts the ``hf_model`` export
(``hf_export.py``). Only the public API of ray_ckpt is used."""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
import torch.distributed as dist

import ray_ckpt as rc
from ray_ckpt import InvalidArgumentError, RestoreError, SaveError

from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

from .settings import VerlSettings, read_settings
from ..committed import (POINTER, UsedSteps, broadcast_error, drop_lost_pointer, error_line, read_pointer, time_left,
                         wait_committed, wait_done, watch_saves, write_pointer)
from ..optimizers import init_optimizer_state
from .tracker import advance_tracker, fall_back, step_of_path

log = logging.getLogger("ray_ckpt.verl")

MODEL, OPTIMIZER, EXTRA, RNG = "model", "optimizer", "extra", "rng"


@dataclass
class _Save:
    """One save_checkpoint call of this rank: its handles and what happens once they end."""
    step: int
    local_path: str
    handles: List[Any]
    hf: bool
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[str] = None
    hf_ref: Any = None  # the export task (rank 0, hf_model)


def _world() -> tuple:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RayCkptCheckpointManager(BaseCheckpointManager):
    """A drop-in for verl's ``FSDPCheckpointManager`` (FSDP2 models) that saves through ray_ckpt.

    ``checkpoint_config.ray_ckpt`` must name a ``run``; with ``local_dir`` (and optionally
    ``remote_uri``, ``remote_options``, ``keep_last``, ``keep_every``, ``critical_writers``,
    ``best_effort_writers``, ``engine_options``) rank 0 creates the run (get-or-create: a running
    run must have the same options) and the other ranks connect; without ``local_dir`` every rank
    connects to a run created elsewhere. ``load_wait_s`` bounds how long a load waits for a step
    still in flight; ``tracker: false`` leaves verl's tracker alone."""

    def __init__(self, model, optimizer: Optional[torch.optim.Optimizer] = None,
                 lr_scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None,
                 processing_class: Any = None, checkpoint_config: Any = None,
                 trust_remote_code: bool = False, **kwargs: Any):
        if processing_class is None and "tokenizer" in kwargs:  # as FSDPCheckpointManager
            processing_class = kwargs.pop("tokenizer")
        settings = read_settings(checkpoint_config)
        if settings is None:
            raise InvalidArgumentError("RayCkptCheckpointManager needs checkpoint_config.ray_ckpt.run (and "
                                       "local_dir on the first worker group that uses the run); see docs/verl.md")
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(model, FullyShardedDataParallel):
            raise InvalidArgumentError("RayCkptCheckpointManager supports FSDP2 models (actor.strategy=fsdp2), "
                                       "not FSDP1's FullyShardedDataParallel wrapper")
        super().__init__(model, optimizer, lr_scheduler=lr_scheduler, processing_class=processing_class,
                         checkpoint_config=checkpoint_config)
        self.trust_remote_code = trust_remote_code
        self.settings: VerlSettings = settings
        self.rank, self.world_size = _world()
        self._saves: List[_Save] = []
        self._failures: List[str] = []  # saves that failed, not yet raised by save_checkpoint
        self._lock = threading.Lock()
        self._declared = False
        self._jobs: "queue.Queue[_Save]" = queue.Queue()
        self._worker = threading.Thread(target=self._watch, name="ray_ckpt-verl-commits", daemon=True)
        self._worker.start()
        self.engine = self._open_engine()
        self._kept: Optional[int] = None  # the max_ckpt_to_keep applied as retention (rank 0)
        self._used = UsedSteps(self.settings.run, log, self.rank)  # a step of a lost version is not saved again
        self.last_block_s: Optional[float] = None  # how long the last save_checkpoint blocked this rank
        self.last_load_wait_s: Optional[float] = None  # how long the last load waited for its step to commit

    # ------------------------------------------------------------------ set-up (collective)
    def _collective_error(self, error: Optional[str]) -> None:
        broadcast_error(error, self.world_size)

    def _open_engine(self) -> "rc.CheckpointEngine":
        s = self.settings
        engine, error = None, None
        if self.rank == 0:
            try:
                engine = rc.CheckpointEngine.create(s.run, **s.create) if s.creates else \
                    rc.CheckpointEngine.connect(s.run, timeout=s.connect_timeout_s)
            except Exception as exc:
                error = f"ray_ckpt run {s.run!r} could not be {'created' if s.creates else 'connected'} " \
                        f"on rank 0: {error_line(exc)}"
        self._collective_error(error)
        if engine is None:
            engine = rc.CheckpointEngine.connect(s.run, timeout=s.connect_timeout_s)
        return engine

    def _states(self) -> List[tuple]:
        """(name, replicated) of what a save of this manager pushes, from ``save_contents``."""
        out = []
        if self.should_save_model or self.should_save_hf_model:
            out.append((MODEL, False))
        if self.should_save_optimizer:
            out.append((OPTIMIZER, False))
        if self.should_save_extra:
            out += [(EXTRA, True), (RNG, False)]
        return out

    def _declare(self) -> None:
        """First save: rank 0 declares the states for this world size, then every rank goes on (a
        collective once, as verl calls save_checkpoint on every rank)."""
        error = None
        if self.rank == 0:
            try:
                for name, replicated in self._states():
                    self.engine.register(name, world_size=self.world_size, replicated=replicated, replace=True)
            except Exception as exc:
                error = f"ray_ckpt run {self.settings.run!r}: declaring the states failed: {error_line(exc)}"
        self._collective_error(error)
        self._declared = True

    # ------------------------------------------------------------------ save
    def _keep_newest(self, n: int) -> None:
        """verl's ``max_ckpt_to_keep`` as the run's retention (``keep_last``), changed on the live
        run when it differs (rank 0). The engine prunes only after a commit, so the versions kept
        never drop below ``n`` committed ones (verl's own manager deletes before it saves). A
        ``keep_last`` in the ray_ckpt block wins; a run this manager only connects to keeps its own."""
        s = self.settings
        if n == self._kept or "keep_last" in s.create or not s.creates:
            if n != self._kept and self._kept is None:
                log.warning("ray_ckpt: max_ckpt_to_keep=%s is not applied; retention is the run's keep_last "
                            "(checkpoint_config.ray_ckpt.keep_last, or the creator's)", n)
            self._kept = n
            return
        self.engine = rc.CheckpointEngine.create(s.run, **dict(s.create, keep_last=n), reconfigure=True)
        self._kept = n
        log.info("ray_ckpt: run %r keeps its newest %d versions (max_ckpt_to_keep)", s.run, n)

    def save_checkpoint(self, local_path: str, hdfs_path: str = None, global_step: int = 0,
                        max_ckpt_to_keep: int = None):
        """Push this rank's state as version ``global_step`` and return; the pointer file in
        ``local_path`` and verl's tracker follow when the version commits. A save of this rank that
        failed in the background is raised here (``rc.SaveError`` naming its step), before anything
        of this one is pushed."""
        if local_path is None:
            return
        t0 = time.perf_counter()
        self._raise_failures()
        if self.should_save_model or self.should_save_hf_model:
            assert self.model is not None, "model must be provided when checkpoint_contents.save includes ['model']"
        if self.should_save_optimizer:
            assert self.optimizer is not None, \
                "optimizer must be provided when checkpoint_contents.save includes ['optimizer']"
        if hdfs_path is not None and self.rank == 0:
            log.info("ray_ckpt: hdfs_path %s is not used; the run's remote_uri is its remote copy", hdfs_path)
        if max_ckpt_to_keep and self.rank == 0:
            self._keep_newest(int(max_ckpt_to_keep))
        if not self._declared:
            self._declare()
        self.previous_global_step = global_step
        step, eng, r = int(global_step), self.engine, self.rank
        # a step the run used for a version lost with a node (a resume from the one before it redoes
        # it) is not saved again (``committed.UsedSteps``); each rank decides alone, as each pushes alone
        # (no collective: a rank that died before its save must not stall the others here)
        if not self._used.free(eng, step):
            if r == 0:
                drop_lost_pointer(local_path, eng, step)  # the lost version's: a load of the folder says so
            self.last_block_s = time.perf_counter() - t0
            return None
        handles = []
        # overlapped: the copy runs while the rank goes on; the optimizer's step (and load_checkpoint)
        # wait for it before they change a tensor being copied
        fenced = tuple(o for o in (self.model, self.optimizer) if o is not None) if self.settings.overlap else None
        with eng.push_group():  # the copies begin, and the parts leave, once all four are captured
            if self.should_save_model or self.should_save_hf_model:
                handles.append(eng.submit(step, MODEL, self.model.state_dict(), rank=r, overlap_with=fenced))
            if self.should_save_optimizer:
                handles.append(eng.submit(step, OPTIMIZER, self.optimizer.state_dict(), rank=r,
                                          overlap_with=fenced))
            if self.should_save_extra:
                sched = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
                handles.append(eng.submit(step, EXTRA, {"lr_scheduler": sched, "world_size": self.world_size,
                                                        "global_step": step}, rank=r))
                handles.append(eng.submit(step, RNG, rc.rng_state(), rank=r))
        save = _Save(step, os.path.abspath(local_path), handles, hf=self.should_save_hf_model and r == 0)
        with self._lock:
            self._saves.append(save)
        self._jobs.put(save)
        self.last_block_s = time.perf_counter() - t0
        return None

    def _watch(self) -> None:
        """Background: wait for each save's commit (in order), then rank 0 writes the pointer and
        the tracker and starts the hf_model export."""
        watch_saves(self._jobs, self._committed,
                    lambda save: f"step {save.step} (run {self.settings.run!r}, {save.local_path})",
                    lambda text: self._failures.append(text), self._lock, log)  # _failures is replaced when raised

    def _committed(self, save: _Save, results: List[Any]) -> None:
        if self.rank != 0:
            return
        version = results[0].version if results else save.step
        write_pointer(save.local_path, {"run": self.settings.run, "step": save.step, "version": version,
                                        "world_size": self.world_size,
                                        "states": [n for n, _ in self._states()],
                                        "format": "ray_ckpt", "committed_at": time.time()})
        if self.settings.tracker:
            advance_tracker(save.local_path, save.step)
        if save.hf:
            from .hf_export import start_export

            config = getattr(self.model, "config", None)
            save.hf_ref = start_export(self.settings.run, save.step, os.path.join(save.local_path, "huggingface"),
                                       config, self.processing_class, self.settings.hf_export_cpus)

    def _raise_failures(self) -> None:
        with self._lock:
            failures, self._failures = self._failures, []
            self._saves = [s for s in self._saves if not s.done.is_set() or s.hf_ref is not None]
        if failures:
            raise SaveError("ray_ckpt: " + "; ".join(failures))

    def wait_until_finished(self, timeout: Optional[float] = None) -> None:
        """Return once every save this rank issued has committed (rank 0: its pointer, tracker and
        hf_model export written too); raise the first failure (``rc.SaveError``), or ``rc.SaveTimeoutError``
        after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            saves = list(self._saves)
        for save in saves:
            wait_done(save, deadline, timeout, f"step {save.step}")
            if save.hf_ref is not None:
                import ray

                try:
                    ray.get(save.hf_ref, timeout=time_left(deadline))
                except ray.exceptions.GetTimeoutError:
                    raise rc.SaveTimeoutError(f"ray_ckpt: the hf_model export of step {save.step} has not finished "
                                       f"after {timeout}s") from None
                except Exception as exc:
                    with self._lock:
                        self._failures.append(f"the hf_model export of step {save.step} failed: {error_line(exc)}")
                save.hf_ref = None
        self._raise_failures()

    # ------------------------------------------------------------------ load
    def _wait_committed(self, engine: "rc.CheckpointEngine", run: str, step: int) -> None:
        """Return once ``step`` is committed (``committed.wait_committed``, up to ``load_wait_s``)."""
        self.last_load_wait_s = wait_committed(engine, run, step, self.settings.load_wait_s)

    def _lost(self, engine: "rc.CheckpointEngine", run: str, step: int, local_path: str) -> Optional[str]:
        """Rank 0: why ``step`` cannot be loaded when its version, committed once (``local_path``'s
        pointer names it), was lost with a node (a preemption whose deadline it missed), else None.
        verl's trainer has already taken its step count and data position from
        ``global_step_<step>``, so a silent load of an older version would skip training unseen: the
        tracker is moved back to the newest committed version instead (``tracker.fall_back``), and
        the load fails saying so; verl's next start resumes from that version and redoes the rest
        (the lost step itself is not saved again: ``save_checkpoint``). A driver where
        :func:`~ray_ckpt.integrations.verl.install` ran (its ``find_latest_ckpt_path``), or that calls
        :func:`~ray_ckpt.integrations.verl.rewind_lost_tracker` before ``fit()``, never gets here."""
        back = fall_back(engine, run, step, local_path)
        if back is None:
            return None
        return back[1] + (", start the run again to resume from it (or run ray_ckpt.integrations.verl.install() in "
                          "the driver, or call rewind_lost_tracker() there before fit())" if back[0] is not None else "")

    def load_checkpoint(self, local_path: str, hdfs_path: str = None, del_local_after_load: bool = False):
        """Fill this rank's model, optimizer, scheduler (and RNG, at the same world size) from the
        version ``local_path`` names: its pointer file, or ``global_step_N`` in the path for a step
        still in flight. Any world size: each rank reads only its own shards' byte ranges."""
        if local_path is None:
            return
        rc.fence()  # a save's copy still reading the tensors this load overwrites finishes first
        pointer = read_pointer(local_path)
        run = pointer["run"] if pointer else self.settings.run
        step = int(pointer["step"]) if pointer else step_of_path(local_path)
        if step is None:
            raise RestoreError(f"{local_path}: no ray_ckpt pointer ({POINTER}) and no global_step_N in the path")
        engine = self.engine if run == self.settings.run else rc.CheckpointEngine.connect(run)
        broadcast_error(self._lost(engine, run, step, local_path) if self.rank == 0 else None,
                        self.world_size, RestoreError)
        self._wait_committed(engine, run, step)
        r = self.rank
        extra = engine.load(EXTRA, step=step, rank=0) if self.should_load_extra else None
        if self.should_load_model:
            assert self.model is not None, "model must be provided when checkpoint_contents.load includes ['model']"
            engine.load_into(MODEL, self.model.state_dict(), step=step, rank=r)
        if self.should_load_optimizer:
            assert self.optimizer is not None, \
                "optimizer must be provided when checkpoint_contents.load includes ['optimizer']"
            init_optimizer_state(self.optimizer)
            osd = self.optimizer.state_dict()
            engine.load_into(OPTIMIZER, osd, step=step, rank=r)
            self.optimizer.load_state_dict(osd)
        if extra is not None:
            if self.lr_scheduler is not None and extra.get("lr_scheduler") is not None:
                self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
            saved_world = int(extra["world_size"])
            if saved_world == self.world_size:
                rc.set_rng_state(engine.load(RNG, step=step, rank=r))
            elif r == 0:
                log.warning("ray_ckpt: step %s was saved by %s ranks and is loaded on %s: the RNG states were "
                            "not restored (they are per rank); model, optimizer and scheduler were resharded",
                            step, saved_world, self.world_size)
        if run == self.settings.run:  # committed steps after the one loaded: their redo is not saved again
            self._used.resumed(engine, step)
        log.info("ray_ckpt: rank %s loaded step %s of run %r", r, step, run)
