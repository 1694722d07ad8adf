"""ray_ckpt inside a Ray Train loop (``TorchTrainer``): non-blocking saves, and Ray Train's
checkpoint list naming only versions that have committed.

Ray Train's own checkpoints are directories each worker writes and uploads at
``ray.train.report(metrics, checkpoint=...)``, whole, before (SYNC) or while (ASYNC) the loop goes
on. With a :class:`Checkpointer`, ``report(metrics, step)`` pushes each rank's registered states to
the run (the copy into Ray's object store is the only pause; writer actors do the rest) and hands
Ray Train, at a later report, a *pointer* checkpoint (a directory holding ``ray_ckpt.json``: run and
step) for each version once it has committed. So ``ray.train.get_checkpoint()`` after a worker-group
restart never names a version that cannot be restored, and ``restore()`` brings every registered
object back from the version it names (or from the run's newest committed version).

Call sequence, in every worker of the group (the calls are collective where Ray Train's are)::

    ckpt = Checkpointer(run=None, local_dir=..., remote_uri=..., every=N, **create_options)
    ckpt.register("model", model); ckpt.register("optimizer", optimizer); ...   # state_dict objects
    start = ckpt.restore()                    # the step restored, or None on a fresh start
    for step in range((start or 0) + 1, total + 1):
        train_one_step()
        ckpt.report({"loss": loss}, step)     # every N steps (and on a preemption notice) a push
    ckpt.close()                              # waits for the pushes; reports the last commit

Rank 0 creates the run (named after the Train run unless ``run`` is given); the other ranks connect.
A preemption (``ray.train.get_preemption_info()``, or the run's own notice: a drained node that holds
its files) makes the next ``report`` push whatever the cadence, once per notice.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any, Dict, List, Optional

import ray
import ray.train

import torch

import ray_ckpt as rc
from ...errors import InvalidArgumentError
from ..committed import broadcast_error, error_line, rank0_decides, read_pointer, write_pointer
from ..optimizers import init_optimizer_state

log = logging.getLogger("ray_ckpt")

POINTER_DIR = "ray_ckpt-step{step:012d}"  # the directory name of a pointer checkpoint in Ray Train's storage


def _run_name(name: str) -> str:
    """A Train run's name as a ray_ckpt run name (letters, digits, ``._-``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", name).strip(".-")[:100] or "ray-train"


def _world() -> tuple:
    ctx = ray.train.get_context()
    return ctx.get_world_rank(), ctx.get_world_size()


class Checkpointer:
    """ray_ckpt as a ``TorchTrainer`` loop's checkpoint layer (see the module).

    ``run``: the ray_ckpt run (default: the Ray Train run's name). ``local_dir`` (with ``remote_uri``
    and any other ``CheckpointEngine.create`` option): rank 0 creates the run (get-or-create);
    without ``local_dir`` every rank connects to a run created elsewhere. ``every``: push every
    ``every``-th step given to :meth:`report`. ``connect_timeout_s`` bounds the other ranks' wait for
    rank 0's run."""

    def __init__(self, run: Optional[str] = None, local_dir: Optional[str] = None,
                 remote_uri: Optional[str] = None, *, every: int = 1, connect_timeout_s: float = 120.0,
                 **create_options: Any):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise InvalidArgumentError(f"every must be an integer >= 1, got {every!r}")
        self.rank, self.world_size = _world()
        self.run = run if run is not None else _run_name(ray.train.get_context().get_experiment_name())
        self.every = every
        self.states: Dict[str, Any] = {}
        self._declared = False
        self._handles: List[Any] = []  # this rank's pushes not yet seen committed
        self._pushed: List[int] = []  # steps this group pushed, oldest first (rank 0 reports their commits)
        self._reported = -1  # the newest step handed to Ray Train as a checkpoint
        self._preempted_saved = False
        self.last_report_s: Optional[float] = None  # how long the last report() blocked this rank
        engine, error = None, None
        if self.rank == 0:
            try:
                engine = rc.CheckpointEngine.create(self.run, local_dir, remote_uri, **create_options) \
                    if local_dir is not None else rc.CheckpointEngine.connect(self.run, timeout=connect_timeout_s)
            except Exception as exc:
                error = f"ray_ckpt run {self.run!r} could not be {'created' if local_dir else 'connected'} " \
                        f"on rank 0: {error_line(exc)}"
        broadcast_error(error, self.world_size)
        self.engine = engine if engine is not None else rc.CheckpointEngine.connect(self.run, timeout=connect_timeout_s)

    # ------------------------------------------------------------------ what is saved
    def register(self, name: str, obj: Any, *, replicated: bool = False) -> None:
        """Save ``obj`` (a model, optimizer, scheduler, ``StatefulDataLoader``: anything with
        ``state_dict()`` / ``load_state_dict()``) as state ``name``, one part per rank; FSDP2 / DTensor
        state is stored shard by shard. ``replicated=True``: every rank holds the same state (a DDP
        model): rank 0's copy is stored. Call it on every rank, in the same order, before the first
        ``report``."""
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise InvalidArgumentError(f"state {name!r}: {type(obj).__name__} has no state_dict() / load_state_dict()")
        if name in self.states:
            raise InvalidArgumentError(f"state {name!r} is registered already")
        if self._declared:
            raise InvalidArgumentError(f"state {name!r}: register every state before the first report()")
        self.states[name] = (obj, replicated)

    def _declare(self) -> None:
        error = None
        if self.rank == 0:
            try:
                for name, (_obj, replicated) in self.states.items():
                    self.engine.register(name, world_size=self.world_size, replicated=replicated, replace=True)
            except Exception as exc:
                error = f"ray_ckpt run {self.run!r}: declaring the states failed: {error_line(exc)}"
        broadcast_error(error, self.world_size)
        self._declared = True

    # ------------------------------------------------------------------ saving
    def report(self, metrics: Dict[str, Any], step: int) -> None:
        """``ray.train.report`` for this step, with a push of every registered state when the step is
        on the cadence (``every``) or a preemption notice came; the newest version that committed
        since the last report goes to Ray Train as a pointer checkpoint (rank 0). Returns once the
        states are captured: writing, checksumming and uploading go on in the run's writers.
        Collective: every rank calls it with the same step."""
        t0 = time.perf_counter()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative integer, got {step!r}")
        if not self.states:
            raise InvalidArgumentError("nothing to save: register at least one state before report()")
        self._raise_failures()
        preempted = ray.train.get_preemption_info() is not None  # collective in Ray Train
        push = rank0_decides(step % self.every == 0 or self._last_save_for_notice(preempted), self.world_size)
        if push:
            self._push(step)
        checkpoint, folder = self._pointer() if self.rank == 0 else (None, None)
        try:
            if checkpoint is not None:
                ray.train.report(dict(metrics, ray_ckpt_step=self._reported), checkpoint=checkpoint,
                                 checkpoint_dir_name=os.path.basename(folder))
            else:
                ray.train.report(metrics)
        finally:
            if folder is not None:
                shutil.rmtree(os.path.dirname(folder), ignore_errors=True)
        self.last_report_s = time.perf_counter() - t0

    def _last_save_for_notice(self, preempted: bool) -> bool:
        """Rank 0: a preemption (Ray Train's notice for a worker's node, or the run's own for a node
        that holds its files) not yet answered with a push."""
        if self.rank != 0:
            return False
        due = self.engine.preemption_save_due() is not None
        if preempted and not self._preempted_saved:
            self._preempted_saved = due = True
        return due

    def _push(self, step: int) -> None:
        if not self._declared:
            self._declare()
        with self.engine.push_group():
            for name, (obj, replicated) in self.states.items():
                if replicated and self.rank != 0:
                    continue
                self._handles.append(self.engine.submit(step, name, obj.state_dict(), rank=self.rank))
        self._pushed.append(step)

    def _pointer(self) -> tuple:
        """Rank 0: a pointer checkpoint for the newest pushed step that committed since the last
        report (and its folder), or (None, None)."""
        newer = [s for s in self._pushed if s > self._reported]
        if not newer:
            return None, None
        committed = set(self.engine.all_steps())
        done = [s for s in newer if s in committed]
        if not done:
            return None, None
        step = max(done)
        self._pushed = [s for s in self._pushed if s > step]
        self._reported = step
        folder = os.path.join(tempfile.mkdtemp(prefix="ray_ckpt_pointer_"), POINTER_DIR.format(step=step))
        write_pointer(folder, {"run": self.run, "step": step, "world_size": self.world_size,
                               "states": list(self.states), "format": "ray_ckpt", "committed_at": time.time()})
        return ray.train.Checkpoint.from_directory(folder), folder

    def _raise_failures(self) -> None:
        """A push of this rank that failed in the background is raised at the next report."""
        still = []
        for h in self._handles:
            if h.done():
                h.result(timeout=0)  # raises rc.SaveError naming the step
            else:
                still.append(h)
        self._handles = still

    def close(self, timeout: Optional[float] = 600.0) -> None:
        """Wait for this rank's pushes to commit (a failure raises), then report the newest one to
        Ray Train if it has not seen it (collective: one more ``ray.train.report`` on every rank)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in self._handles:
            h.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._handles = []
        if rank0_decides(self.rank == 0 and bool(self._pushed), self.world_size):
            checkpoint, folder = self._pointer() if self.rank == 0 else (None, None)
            try:
                if checkpoint is not None:
                    ray.train.report({"ray_ckpt_step": self._reported}, checkpoint=checkpoint,
                                     checkpoint_dir_name=os.path.basename(folder))
                else:
                    ray.train.report({})
            finally:
                if folder is not None:
                    shutil.rmtree(os.path.dirname(folder), ignore_errors=True)

    # ------------------------------------------------------------------ restoring
    def restore(self) -> Optional[int]:
        """Bring every registered object back from the run's newest committed version: the one
        ``ray.train.get_checkpoint()`` names after a worker-group restart, or a newer one that
        committed after the last report that could name it (versions are steps: the steps after it
        are saved again); returns its
        step (go on from the next one), or None on a fresh start. Every file is verified against
        the manifest. On another number of workers, DTensor (FSDP2) states are resharded; states of
        plain tensors are rank-local and refuse, naming both sizes. Collective."""
        step = None
        if self.rank == 0:
            ckpt = ray.train.get_checkpoint()
            if ckpt is not None:
                with ckpt.as_directory() as d:
                    pointer = read_pointer(d)
                if pointer is None or pointer.get("run") != self.run:
                    raise rc.RestoreError(f"Ray Train's checkpoint {ckpt.path} is not a ray_ckpt pointer of run "
                                          f"{self.run!r} (found {pointer})")
                step = int(pointer["step"])
            newest = self.engine.latest_step()
            if newest is not None and (step is None or newest > step):
                if step is not None:  # committed after the last report that could name it
                    log.info("ray_ckpt: Ray Train's checkpoint names step %d; run %r has step %d committed "
                             "since: restoring that", step, self.run, newest)
                step = newest
        step = rank0_decides(step, self.world_size)
        if step is None:
            return None
        for name, (obj, replicated) in self.states.items():
            if isinstance(obj, torch.optim.Optimizer):
                init_optimizer_state(obj)  # its state tensors exist (DTensors on this mesh) to be filled
            state = obj.state_dict()
            if _sharded(state):
                self.engine.load_into(name, state, step=step, rank=self.rank, world_size=self.world_size)
            else:
                state = self.engine.load(name, step=step, rank=0 if replicated else self.rank)
            obj.load_state_dict(state)
        self._reported = max(self._reported, step)
        log.info("ray_ckpt: rank %d restored step %d of run %r", self.rank, step, self.run)
        return step


def _sharded(state: Any) -> bool:
    """Whether a state holds DTensor leaves (FSDP2): loaded shard by shard, on any mesh."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return True
    if isinstance(state, dict):
        return any(_sharded(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(_sharded(v) for v in state)
    return False
