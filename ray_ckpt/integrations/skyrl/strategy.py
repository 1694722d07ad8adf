"""``RayCkptFSDPStrategy``: SkyRL's ``FSDPStrategy`` (FSDP2) with ``save_checkpoint`` /
``load_checkpoint`` on ray_ckpt.

SkyRL's workers call ``strategy.save_checkpoint(model, ckpt_dir, node_local_rank, optimizer,
scheduler, client_state, tag, tokenizer)`` on every rank of a model's worker group, with
``ckpt_dir = <ckpt_path>/global_step_N/<role>``, and resume with ``strategy.load_checkpoint(model,
ckpt_dir, optimizer, scheduler, ...)``; this class keeps both signatures and their meaning (load
returns ``(ckpt_dir, states)`` with the same keys). What a version of step N holds (run
``<run>-<role>``), by state name:

========= ============================== ====================================================
state     pushed by                      holds
========= ============================== ====================================================
model     every rank (DTensor shards)    ``model.state_dict()`` of the FSDP2 module
optimizer every rank (DTensor shards)    ``optimizer.state_dict()`` (AdamW moments, steps, groups)
extra     rank 0's copy (replicated)     client_state, the LR scheduler, tag, world size, step
rng       every rank (rank-local)        ``rc.rng_state()`` (restored at the same world size)
========= ============================== ====================================================

``save_checkpoint`` pushes and returns, no file written by the call except the folder; only the
first call for a role is collective (rank 0 gets or creates the run and declares its states). With
``overlap`` (the default) the model and optimizer tensors are copied into Ray's object store on a
background thread while the rank trains on; the optimizer's ``step`` and ``load_checkpoint`` wait
for that copy first. A background thread per run waits for the commit, then rank 0 writes the
pointer, the model's Hugging Face config (and tokenizer) into ``<ckpt_dir>/huggingface`` as SkyRL
does, and SkyRL's tracker once the step is complete (``tracker.py``). ``finalize_pending_saves``
(which SkyRL's workers call before teardown) waits for every commit. Loading reshards the model and
optimizer onto any number of ranks."""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from skyrl.backends.skyrl_train.distributed.fsdp_strategy import FSDPStrategy
from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper

import ray_ckpt as rc
from ray_ckpt import InvalidArgumentError, RestoreError, SaveError

from ..committed import (broadcast_error, drop_lost_pointer, error_line, read_pointer, step_lost, wait_committed,
                         wait_done, watch_saves, write_pointer)
from ..openrlhf.runs import Run as _Run
from ..optimizers import init_optimizer_state
from .settings import SkyRLSettings, read_settings
from .tracker import TRACKER, advance_if_complete, newest_complete_step, rewind_tracker, step_folders, step_of_path

log = logging.getLogger("ray_ckpt.skyrl")

MODEL, OPTIMIZER, EXTRA, RNG = "model", "optimizer", "extra", "rng"
STATES = ((MODEL, False), (OPTIMIZER, False), (EXTRA, True), (RNG, False))  # (name, replicated)


@dataclass
class _Save:
    """One save_checkpoint call of this rank: its handles and what rank 0 writes at the commit."""
    step: int
    ckpt_dir: str
    handles: List[Any]
    config: Any = None  # the model's PretrainedConfig (rank 0)
    tokenizer: Any = None
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[str] = None


def _world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RayCkptFSDPStrategy(FSDPStrategy):
    """SkyRL's ``FSDPStrategy`` whose checkpoints are ray_ckpt versions: ``save_checkpoint``
    returns once this rank's shards are captured; ``load_checkpoint`` reads a version saved on any
    number of ranks. Takes SkyRL's arguments, plus ``ray_ckpt=`` (a mapping; default: the JSON of
    ``$RAY_CKPT_SKYRL``, see ``settings.py``) that must name a ``run``; with ``local_dir`` rank 0
    creates the run, without it every rank connects to a run the driver created."""

    def __init__(self, *args: Any, ray_ckpt: Optional[Mapping[str, Any]] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        settings = read_settings(ray_ckpt)
        if settings is None:
            raise InvalidArgumentError("RayCkptFSDPStrategy needs ray_ckpt settings naming a run: ray_ckpt={'run': "
                                       "..., 'local_dir': ...} or $RAY_CKPT_SKYRL; see docs/skyrl.md")
        self.ray_ckpt: SkyRLSettings = settings
        self._runs: Dict[str, _Run] = {}
        self._lock = threading.Lock()
        self.last_block_s: Optional[float] = None  # how long the last save_checkpoint blocked this rank
        self.last_load_wait_s: Optional[float] = None  # how long the last load waited for its step to commit

    # ------------------------------------------------------------------ set-up (collective once per role)
    def _run(self, role: str) -> _Run:
        """This rank's engine of ``role``'s run: rank 0 creates it (get-or-create) or connects, then
        the others connect (a collective, on the first save or load of the role only)."""
        run = self._runs.get(role)
        if run is not None:
            return run
        s, name = self.ray_ckpt, self.ray_ckpt.run_of(role)
        rank, world = _world()
        engine, error = None, None
        if rank == 0:
            try:
                engine = rc.CheckpointEngine.create(name, **s.create) if s.creates else \
                    rc.CheckpointEngine.connect(name, timeout=s.connect_timeout_s)
            except Exception as exc:
                error = f"ray_ckpt run {name!r} could not be {'created' if s.creates else 'connected'} on rank 0: " \
                        f"{error_line(exc)}"
        broadcast_error(error, world)
        if engine is None:
            engine = rc.CheckpointEngine.connect(name, timeout=s.connect_timeout_s)
        run = self._runs[role] = _Run(name, engine, rank)
        threading.Thread(target=self._watch, args=(run,), name=f"ray_ckpt-{name}", daemon=True).start()
        return run

    def _declare(self, run: _Run) -> None:
        """First save of this role at this world size: rank 0 declares the states, then every rank
        goes on (SkyRL calls save_checkpoint on every rank, so this collective is matched)."""
        rank, world = _world()
        error = None
        if rank == 0:
            try:
                for name, replicated in STATES:
                    run.engine.register(name, world_size=world, replicated=replicated, replace=True)
            except Exception as exc:
                error = f"ray_ckpt run {run.name!r}: declaring the states failed: {error_line(exc)}"
        broadcast_error(error, world)
        run.declared = world

    @staticmethod
    def _module(model: Any) -> torch.nn.Module:
        """The FSDP2 module inside SkyRL's ``HFModelWrapper`` (or the module itself), as SkyRL's own
        save and load take it."""
        return model.model if isinstance(model, HFModelWrapper) else model

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, model, ckpt_dir, node_local_rank, optimizer=None, scheduler=None, client_state={},
                        tag=None, tokenizer=None):
        """Push this rank's share of the version of step N (``ckpt_dir`` is
        ``.../global_step_N/<role>``) and return. ``<ckpt_dir>/ray_ckpt.json``, ``huggingface/`` and
        SkyRL's tracker are written by rank 0 once the version commits. A save of this role that
        failed in the background is raised here (``rc.SaveError`` naming its step) before anything
        is pushed; so is a client_state ray_ckpt cannot store (``rc.UnsupportedTypeError``)."""
        t0 = time.perf_counter()
        step = step_of_path(ckpt_dir)
        if step is None:
            raise InvalidArgumentError(f"RayCkptFSDPStrategy saves into SkyRL's layout <ckpt_path>/global_step_N/<role>; "
                                       f"got ckpt_dir={ckpt_dir!r}")
        ckpt_dir = os.path.abspath(ckpt_dir)
        role = os.path.basename(ckpt_dir)
        rank, world = _world()
        run = self._run(role)
        self._raise_failures(run)
        # a step the run used for a version lost with a node (a resume from the one before it redoes
        # it) is not saved again (``committed.UsedSteps``); each rank decides alone, as each pushes
        # alone; rank 0 removes the lost version's pointer, so the step is never complete again
        if not run.used.free(run.engine, step):
            if rank == 0:
                drop_lost_pointer(ckpt_dir, run.engine, step)
            self.last_block_s = time.perf_counter() - t0
            return None
        if run.declared != world:
            self._declare(run)
        if node_local_rank == 0:
            os.makedirs(ckpt_dir, exist_ok=True)
        module, eng = self._module(model), run.engine
        fenced = tuple(o for o in (module, optimizer) if o is not None) if self.ray_ckpt.overlap else None
        handles = []
        with eng.push_group():  # the copies begin, and the parts leave, once all four are captured
            # first: a client_state ray_ckpt cannot store fails here, before any part is pushed
            extra = {"client_state": dict(client_state or {}), "tag": tag, "fsdp_strategy": self.fsdp_strategy,
                     "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
                     "world_size": world, "step": step} if rank == 0 else {}
            handles.append(eng.submit(step, EXTRA, extra, rank=rank))
            handles.append(eng.submit(step, MODEL, module.state_dict(), rank=rank, overlap_with=fenced))
            handles.append(eng.submit(step, OPTIMIZER, optimizer.state_dict() if optimizer is not None else {},
                                      rank=rank, overlap_with=fenced))
            handles.append(eng.submit(step, RNG, rc.rng_state(), rank=rank))
        save = _Save(step, ckpt_dir, handles)
        if rank == 0:
            save.config, save.tokenizer = getattr(self._unwrap_model(model), "config", None), tokenizer
        with self._lock:
            run.saves.append(save)
        run.jobs.put(save)
        self.last_block_s = time.perf_counter() - t0

    def _watch(self, run: _Run) -> None:
        """Background: wait for each save's commit (in order), then rank 0 writes its files."""
        watch_saves(run.jobs, lambda save, results: self._committed(run, save, results),
                    lambda save: f"step {save.step} (run {run.name!r}, {save.ckpt_dir})",
                    lambda text: run.failures.append(text), self._lock, log)  # run.failures is replaced when raised

    def _committed(self, run: _Run, save: _Save, results: List[Any]) -> None:
        rank, world = _world()
        if rank != 0:
            return
        if save.config is not None:  # what SkyRL's own save writes beside the shards
            self.save_hf_configs(self._fix_fsdp_config(save.config), os.path.join(save.ckpt_dir, "huggingface"),
                                 save.tokenizer)
        version = results[0].version if results else save.step
        write_pointer(save.ckpt_dir, {"run": run.name, "step": save.step, "version": version, "world_size": world,
                                      "states": [n for n, _ in STATES], "format": "ray_ckpt",
                                      "committed_at": time.time()})
        if self.ray_ckpt.tracker:
            advance_if_complete(os.path.dirname(save.ckpt_dir), save.step)

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
                wait_done(save, deadline, timeout, f"step {save.step} ({save.ckpt_dir})")
            self._raise_failures(run)

    def finalize_pending_saves(self) -> None:
        """SkyRL's hook (``Worker.finalize_pending_saves``, called before teardown): every save of
        this rank committed, or its failure raised."""
        self.wait_until_finished()

    # ------------------------------------------------------------------ load
    def _locate(self, ckpt_dir: str) -> Tuple[str, int]:
        """(run, step) of ``ckpt_dir``: its pointer, or ``global_step_N`` for a step still in flight."""
        pointer = read_pointer(ckpt_dir)
        if pointer is not None:
            return str(pointer["run"]), int(pointer["step"])
        step = step_of_path(ckpt_dir)
        if step is None:
            raise RestoreError(f"{ckpt_dir}: no ray_ckpt pointer (ray_ckpt.json) and no global_step_N above it")
        return self.ray_ckpt.run_of(os.path.basename(os.path.abspath(ckpt_dir))), step

    def _lost(self, engine: "rc.CheckpointEngine", run: str, step: int, ckpt_dir: str) -> Optional[str]:
        """Rank 0: why ``step`` cannot be loaded when its version, committed once (``ckpt_dir``'s
        pointer names it), was lost with a node (a preemption whose deadline it missed), else None.
        SkyRL's trainer has already taken its step count and data position from
        ``global_step_<step>``, so a silent load of an older version would skip training unseen: the
        tracker is moved back to the newest complete step this role still has, and the load fails
        saying so; SkyRL's next start resumes from that step and redoes the rest."""
        if not step_lost(engine, step):
            return None
        if any(s > step for s in engine.all_steps()):  # not the newest: nothing to move the tracker back to
            return (f"step {step} of ray_ckpt run {run!r} ({ckpt_dir}) is no longer listed (lost with a node, or "
                    f"rolled back); newer steps are: {engine.all_steps()[-8:]}")
        ckpt_path = os.path.dirname(os.path.dirname(os.path.abspath(ckpt_dir)))
        back = newest_complete_step(ckpt_path, below=step, committed=engine.all_steps())
        what = (f"step {step} of ray_ckpt run {run!r} ({ckpt_dir}) was used by a version that is gone (lost with a "
                f"node, or rolled back)")
        if back is None:
            return f"{what}, and no older complete step is left in {ckpt_path}; committed steps: " \
                   f"{engine.all_steps()[-8:]}"
        rewind_tracker(ckpt_path, back)
        newer = sorted(n for n in step_folders(ckpt_path) if back < n != step)
        return (f"{what}; the newest complete step before it is {back}: SkyRL's tracker "
                f"({os.path.join(ckpt_path, TRACKER)}) now names it, start the run again to resume from it"
                + (f" (SkyRL refuses a tracker more than trainer.ckpt_interval steps behind its newest global_step "
                   f"folder: move {', '.join(f'global_step_{n}' for n in newer + [step])} aside if that is the "
                   f"case here)"
                   if newer else ""))

    def load_checkpoint(self, model, ckpt_dir, optimizer=None, scheduler=None, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True):
        """Fill this rank's model shards, optimizer, scheduler (and RNG, at the same world size) from
        the version ``ckpt_dir`` names, saved on any number of ranks; returns ``(ckpt_dir, states)``
        as SkyRL's does (``client_state``, ``tag``, ``fsdp_strategy``, ``world_size`` of the save,
        ``rank``). A step still in flight is waited for (``load_wait_s``); one that failed is a
        ``RestoreError`` naming it."""
        if ckpt_dir is None:
            raise ValueError("ckpt_dir cannot be None")
        if not os.path.isdir(ckpt_dir):
            raise FileNotFoundError(f"Checkpoint directory not found: {ckpt_dir}")
        rc.fence()  # a save's overlapped copy still reading the tensors this load overwrites finishes first
        name, step = self._locate(ckpt_dir)
        role = os.path.basename(os.path.abspath(ckpt_dir))
        run = self._run(role)
        engine = run.engine if run.name == name else \
            rc.CheckpointEngine.connect(name, timeout=self.ray_ckpt.connect_timeout_s)
        rank, world = _world()
        lost = self._lost(engine, name, step, ckpt_dir) if rank == 0 and read_pointer(ckpt_dir) else None
        broadcast_error(lost, world, RestoreError)
        self.last_load_wait_s = wait_committed(engine, name, step, self.ray_ckpt.load_wait_s)
        extra = engine.load(EXTRA, step=step, rank=0)
        engine.load_into(MODEL, self._module(model).state_dict(), step=step, rank=rank, strict=load_module_strict)
        if optimizer is not None and load_optimizer_states:
            init_optimizer_state(optimizer)
            osd = optimizer.state_dict()
            engine.load_into(OPTIMIZER, osd, step=step, rank=rank)
            optimizer.load_state_dict(osd)
        if scheduler is not None and load_lr_scheduler_states and extra.get("lr_scheduler") is not None:
            scheduler.load_state_dict(extra["lr_scheduler"])
        saved_world = int(extra["world_size"])
        if saved_world == world:
            rc.set_rng_state(engine.load(RNG, step=step, rank=rank))
        elif rank == 0:
            log.warning("ray_ckpt: %s was saved by %s ranks and is loaded on %s: the RNG states were not restored "
                        "(they are per rank); model and optimizer were resharded", ckpt_dir, saved_world, world)
        if run.name == name:  # committed steps of this role after the one loaded: their redo is not saved again
            run.used.resumed(engine, step)
        if world > 1:
            dist.barrier()
        states = {"client_state": dict(extra.get("client_state") or {}), "tag": extra.get("tag", tag),
                  "fsdp_strategy": extra.get("fsdp_strategy", self.fsdp_strategy), "world_size": saved_world,
                  "rank": rank}
        return ckpt_dir, states

