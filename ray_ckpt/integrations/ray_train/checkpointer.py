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
        ckpt.report({"loss": loss}, step)     # every N steps (and during a preemption notice) a push
    ckpt.close()                              # waits for the pushes; reports the last commit

Rank 0 creates the run (named after the Train run unless ``run`` is given); the other ranks connect.
The Train run's ``CheckpointConfig`` becomes the run's retention (:func:`retention_options`): Ray
Train then keeps pointers and the run keeps versions by the same rule and the same metric values.
A preemption (``ray.train.get_preemption_info()``, or the run's own notice: a drained node that holds
its files) makes the next ``report`` push whatever the cadence, and the reports after it push again
each time the newest push is safe (off the drained nodes), until the deadline
(:meth:`Checkpointer._save_for_notice`).
"""
from __future__ import annotations

import logging
import math
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
# with the module (which a train loop imports at its top): every Checkpointer needs the engine
from ...client.engine import CheckpointEngine
from ...errors import InvalidArgumentError
from ...ray_internals import train_checkpoint_config
from ..committed import UsedSteps, broadcast_error, error_line, rank0_decides, read_pointer, write_pointer
from ..optimizers import init_optimizer_state

log = logging.getLogger("ray_ckpt")

POINTER_DIR = "ray_ckpt-step{step:012d}"  # the directory name of a pointer checkpoint in Ray Train's storage


def _run_name(name: str) -> str:
    """A Train run's name as a ray_ckpt run name (letters, digits, ``._-``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", name).strip(".-")[:100] or "ray-train"


RETENTION_OPTIONS = ("keep_last", "keep_every", "keep_best")
# what an overlapped copy can fence: an optimizer's step and a module's forward change their tensors in place
_FENCEABLE = (torch.nn.Module, torch.optim.Optimizer)


def retention_options(checkpoint_config: Any) -> Dict[str, Any]:
    """The run's retention for a Ray Train ``CheckpointConfig``: ``num_to_keep=N`` keeps the newest
    N versions (``keep_last``), with ``checkpoint_score_attribute`` the N best by that metric in
    ``checkpoint_score_order`` (``keep_best``); the newest committed version is always kept, as Ray
    Train keeps its latest checkpoint. No ``num_to_keep``: every version is kept (``{}``)."""
    if checkpoint_config is None or checkpoint_config.num_to_keep is None:
        return {}
    n, metric = checkpoint_config.num_to_keep, checkpoint_config.checkpoint_score_attribute
    if metric is None:
        return {"keep_last": n}
    order = checkpoint_config.checkpoint_score_order
    if order not in ("max", "min"):
        raise InvalidArgumentError(f"CheckpointConfig.checkpoint_score_order must be 'max' or 'min', got {order!r}")
    return {"keep_best": (metric, order, n)}


def _numbers(metrics: Dict[str, Any]) -> Dict[str, float]:
    """The finite numbers among a report's metrics (what a version's manifest can hold)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _train_preemption_notice() -> bool:
    """Whether Ray Train announces a preemption of a node of this worker group
    (``ray.train.get_preemption_info()``, Ray 2.60; a barrier every rank calls). Older Rays have no
    such notice: the run's own (a drained node that holds its files) still makes a report save."""
    notice = getattr(ray.train, "get_preemption_info", None)
    return notice is not None and notice() is not None


def _world() -> tuple:
    ctx = ray.train.get_context()
    return ctx.get_world_rank(), ctx.get_world_size()


class Checkpointer:
    """ray_ckpt as a ``TorchTrainer`` loop's checkpoint layer (see the module).

    ``run``: the ray_ckpt run (default: the Ray Train run's name). ``local_dir`` (with ``remote_uri``
    and any other ``CheckpointEngine.create`` option): rank 0 creates the run (get-or-create);
    without ``local_dir`` every rank connects to a run created elsewhere. ``every``: push every
    ``every``-th step given to :meth:`report`. ``connect_timeout_s`` bounds the other ranks' wait for
    rank 0's run. Retention comes from the Train run's ``CheckpointConfig`` (see
    :func:`retention_options`), or from ``keep_last`` / ``keep_every`` / ``keep_best`` given here:
    one or the other, both is refused."""

    def __init__(self, run: Optional[str] = None, local_dir: Optional[str] = None,
                 remote_uri: Optional[str] = None, *, every: int = 1, connect_timeout_s: float = 120.0,
                 **create_options: Any):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise InvalidArgumentError(f"every must be an integer >= 1, got {every!r}")
        self.rank, self.world_size = _world()
        retention = retention_options(train_checkpoint_config())
        given = sorted(k for k in RETENTION_OPTIONS if create_options.get(k) is not None)
        if retention and given:
            raise InvalidArgumentError(
                f"retention is set twice: the Train run's CheckpointConfig gives {retention} and the "
                f"Checkpointer {given}; set it in one place (CheckpointConfig: Ray Train's pointers and the "
                f"run's versions are then kept by the same rule)")
        if retention and local_dir is None:
            raise InvalidArgumentError(
                f"the Train run's CheckpointConfig asks for retention {retention}, but this Checkpointer connects "
                f"to a run created elsewhere (no local_dir): give that run the retention where it is created")
        create_options = dict(create_options, **retention)
        best = create_options.get("keep_best")
        self._score = best[0] if best else None  # the metric every pushed step's report must carry
        self._step_metrics: Dict[int, Dict[str, float]] = {}  # rank 0: each pushed step's numeric metrics
        self.run = run if run is not None else _run_name(ray.train.get_context().get_experiment_name())
        self.every = every
        self.states: Dict[str, Any] = {}
        self._declared = False
        self._handles: List[Any] = []  # this rank's pushes not yet seen committed
        self._pushed: List[int] = []  # steps this group pushed, oldest first (rank 0 reports their commits)
        self._reported = -1  # the newest step handed to Ray Train as a checkpoint
        self._notice_step: Optional[int] = None  # rank 0: the newest push during Ray Train's notice
        self._used = UsedSteps(self.run, log)  # rank 0: a step of a lost version is not saved again
        self.last_report_s: Optional[float] = None  # how long the last report() blocked this rank
        engine, error = None, None
        if self.rank == 0:
            try:
                engine = CheckpointEngine.create(self.run, local_dir, remote_uri, **create_options) \
                    if local_dir is not None else CheckpointEngine.connect(self.run, timeout=connect_timeout_s)
            except Exception as exc:
                error = f"ray_ckpt run {self.run!r} could not be {'created' if local_dir else 'connected'} " \
                        f"on rank 0: {error_line(exc)}"
        broadcast_error(error, self.world_size)
        self.engine = engine if engine is not None else CheckpointEngine.connect(self.run, timeout=connect_timeout_s)

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
        preempted = _train_preemption_notice()
        if not isinstance(metrics, dict):
            raise InvalidArgumentError(f"metrics must be a dict, got {type(metrics).__name__}")
        # a step the run used for a lost version is not saved, nor does it answer a notice
        free = self.rank == 0 and self._step_free(step)
        notice = free and self._save_for_notice(preempted)
        due = free and (step % self.every == 0 or notice)
        # rank 0 decides whether this step is saved, or why its report is refused (every rank raises)
        push = rank0_decides(self._missing_score(step, metrics) or due if due else False, self.world_size)
        if isinstance(push, str):
            raise InvalidArgumentError(push)
        if push:
            self._push(step, metrics)
            if preempted and self.rank == 0:
                self._notice_step = step  # Ray Train's notice: the next save waits for this one's commit
        checkpoint, folder = self._pointer() if self.rank == 0 else (None, None)
        try:
            if checkpoint is not None:
                ray.train.report(self._pointer_metrics(metrics), checkpoint=checkpoint,
                                 checkpoint_dir_name=os.path.basename(folder))
            else:
                ray.train.report(metrics)
        finally:
            if folder is not None:
                shutil.rmtree(os.path.dirname(folder), ignore_errors=True)
        self.last_report_s = time.perf_counter() - t0

    def _save_for_notice(self, preempted: bool) -> bool:
        """Rank 0: whether this report saves for a preemption notice. The run's own notice (a drained
        node holds its files, or rank 0's node is drained) follows the engine's rule
        (``preemption_save_due``): the first report after it, then again each time the newest push
        has a copy off the drained nodes. Ray Train's notice alone (a worker's node that holds none
        of the run's files): the first report after it, then again each time the newest push for it
        has committed (its copies are on nodes that stay). Saving on through the deadline keeps the
        steps made after the first save; one save moves at a time."""
        if self.rank != 0:
            return False
        if self.engine.preemption() is not None:
            self._notice_step = None
            return self.engine.preemption_save_due() is not None
        if not preempted:
            self._notice_step = None
            return False
        return self._notice_step is None or self._notice_step in set(self.engine.all_steps())

    def _step_free(self, step: int) -> bool:
        """Rank 0: whether ``step`` can still be saved (``committed.UsedSteps``): a group restored
        from the version before a lost one redoes that step unsaved, and saves again past it."""
        return self._used.free(self.engine, step)

    def _missing_score(self, step: int, metrics: Dict[str, Any]) -> Optional[str]:
        """Why a report that saves is refused: the run keeps its best versions by a metric that the
        report's metrics lack (a version without it could never be ranked)."""
        if self._score is None or self._score in _numbers(metrics):
            return None
        return (f"step {step}: the run keeps the best versions by {self._score!r} (keep_best / the Train run's "
                f"CheckpointConfig.checkpoint_score_attribute), but this report's metrics have no number under "
                f"it (got {sorted(metrics)}); give it in every report() that saves")

    def _push(self, step: int, metrics: Dict[str, Any]) -> None:
        numbers = _numbers(metrics) if self.rank == 0 else {}
        if not self._declared:
            self._declare()
        fenced = self._fenced()
        with self.engine.push_group():
            for i, (name, (obj, replicated)) in enumerate(self.states.items()):
                if replicated and self.rank != 0:
                    continue
                self._handles.append(self.engine.submit(
                    step, name, obj.state_dict(), rank=self.rank, metrics=numbers if i == 0 else None,
                    overlap_with=fenced if fenced and isinstance(obj, _FENCEABLE) else None))
        self._pushed.append(step)
        if self.rank == 0:
            self._step_metrics[step] = numbers

    def _fenced(self) -> Optional[tuple]:
        """With the run's ``overlap`` on: the registered modules and optimizers, whose tensors the
        copy into the object store reads after ``report()`` returned (the next ``optimizer.step()``
        waits for it before it changes one). None: the copy is made inside ``report()``."""
        if not self.engine.config.overlap:
            return None
        objs = tuple(o for o, _ in self.states.values() if isinstance(o, _FENCEABLE))
        return objs or None

    def _pointer_metrics(self, metrics: Dict[str, Any]) -> Dict[str, Any]:
        """The metrics of the report that carries the pointer to step ``_reported``: the report's
        own, ``ray_ckpt_step``, and the score metric's value *at the step saved* (so Ray Train ranks
        its pointers as the run ranks its versions, and keeps the same ones)."""
        out = dict(metrics, ray_ckpt_step=self._reported)
        saved = self._step_metrics.get(self._reported, {})
        if self._score is not None and self._score in saved:
            out[self._score] = saved[self._score]
        for s in [s for s in self._step_metrics if s <= self._reported]:
            del self._step_metrics[s]
        return out

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
                    ray.train.report(self._pointer_metrics({}), checkpoint=checkpoint,
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
            if _optimizer_of_dtensors(obj):
                init_optimizer_state(obj)  # its state tensors exist (DTensors on this mesh) to be filled
            # an optimizer of plain tensors takes the loaded state whole: no zero step to make its
            # state first (it cost a quarter of a second at 150 MB, benchmarks/ray_train_save.py)
            state = obj.state_dict()
            if _sharded(state):
                self.engine.load_into(name, state, step=step, rank=self.rank, world_size=self.world_size)
            else:
                state = self.engine.load(name, step=step, rank=0 if replicated else self.rank)
            obj.load_state_dict(state)
        self._reported = max(self._reported, step)
        log.info("ray_ckpt: rank %d restored step %d of run %r", self.rank, step, self.run)
        return step


def _optimizer_of_dtensors(obj: Any) -> bool:
    """Whether ``obj`` is an optimizer over DTensor (FSDP2) parameters: its state is loaded shard by
    shard into tensors it must have first (:func:`init_optimizer_state`)."""
    if not isinstance(obj, torch.optim.Optimizer):
        return False
    return any(_sharded(p) for group in obj.param_groups for p in group["params"])


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
