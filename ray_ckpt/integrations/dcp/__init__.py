"""torch.distributed.checkpoint (DCP) interop: ``rc.dcp.reader`` and ``rc.dcp.writer``.

* ``dcp.load(state_dict, storage_reader=rc.dcp.reader(run, step))`` reads a committed sharded
  ray_ckpt version, on any world size or mesh (resharding by DCP's planner), every byte verified
  (``storage_reader.py``);
* ``dcp.save(state_dict, storage_writer=rc.dcp.writer(engine, step))`` (or ``dcp.async_save``)
  stores one ray_ckpt version through the engine's rank push path: checksummed, committed when
  every rank's part is durable, retained and listed like any other (``storage_writer.py``).

Imported on first use of ``rc.dcp`` (``import ray_ckpt`` does not import torch.distributed.checkpoint).
See docs/dcp.md.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

from ...errors import InvalidArgumentError, InvalidSaveError
from ...storage.layout import validate_name
from .storage_reader import RayCkptStorageReader, dcp_states, find_version
from .saves_in_flight import wait_for_earlier_saves
from .storage_writer import RayCkptStorageWriter, declared_world_size

__all__ = ["reader", "writer", "RayCkptStorageReader", "RayCkptStorageWriter"]

DEFAULT_STATE = "dcp"


def _key_ring(key: Any) -> Any:
    """``signing_key`` as ``read_manifest`` takes it (a key or a ring, as bytes); None: the
    environment's ring (``RAY_CKPT_SIGNING_KEY`` + ``RAY_CKPT_VERIFY_KEYS``), as every command reads it."""
    from ...config import signing_key_from_env

    if key is None:
        try:
            return signing_key_from_env()
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
    items = list(key) if isinstance(key, (list, tuple)) else [key]
    ring = tuple(k.encode() if isinstance(k, str) else k for k in items)
    if not ring or any(not isinstance(k, (bytes, bytearray)) or not k for k in ring):
        raise InvalidArgumentError("rc.dcp.reader: signing_key must be non-empty bytes or str, or a list of them "
                                   "(a key ring)")
    return ring


def _tiers(run: Any, local_dir: Optional[str], remote_uri: Optional[str],
           remote_options: Optional[Dict[str, Any]], signing_key: Any) -> Tuple[str, List[Any], Any]:
    """(run name, tiers local first, signing key) for ``run``: an engine, or a run name with the
    same ``local_dir`` / ``remote_uri`` given to ``CheckpointEngine.create`` (either or both), or a
    run name alone inside a Ray job where the run's coordinator runs (its configuration is asked)."""
    from ...capture.restored import tiers_of
    from ...config import EngineConfig
    from ...storage.layout import join_uri
    from ...storage.tier import Tier

    if hasattr(run, "config") and hasattr(run, "submit"):  # a CheckpointEngine
        if local_dir is not None or remote_uri is not None:
            raise InvalidArgumentError("rc.dcp.reader(engine, ...): the engine names its tiers; pass local_dir / "
                                       "remote_uri only with a run name")
        return run.run, tiers_of(run.config), run.config.signing_key
    if not isinstance(run, str):
        raise InvalidArgumentError(f"rc.dcp.reader: run must be a run name or a CheckpointEngine, got {run!r}")
    validate_name(run, "run name")
    if local_dir is None and remote_uri is None:
        import ray

        if not ray.is_initialized():
            raise InvalidArgumentError(
                f"rc.dcp.reader({run!r}): give local_dir= and/or remote_uri= (as given to CheckpointEngine.create), "
                f"or call it inside a Ray job where the run's coordinator runs")
        from ...client.engine import CheckpointEngine

        eng = CheckpointEngine.connect(run)
        eng.shutdown()  # only its configuration was wanted: a connected engine detaches, the run goes on
        return run, tiers_of(eng.config), eng.config.signing_key
    key = _key_ring(signing_key)
    try:
        if local_dir is not None:
            cfg = EngineConfig(run=run, local_dir=local_dir, remote_uri=remote_uri, remote_options=remote_options,
                               signing_key=key)
            return run, tiers_of(cfg), cfg.signing_key
        return run, [Tier(join_uri(remote_uri, run), "remote", remote_options)], key
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"rc.dcp.reader({run!r}): {exc}") from None


def reader(run: Any, step: Optional[int] = None, *, state: Optional[str] = None, local_dir: Optional[str] = None,
           remote_uri: Optional[str] = None, remote_options: Optional[Dict[str, Any]] = None,
           signing_key: Any = None) -> RayCkptStorageReader:
    """A DCP ``StorageReader`` of the committed version at ``step`` (None or -1: the newest) of ``run``.

    ``run``: a ``CheckpointEngine`` (its tiers), or a run name with ``local_dir`` and/or
    ``remote_uri`` (+ ``remote_options``) as given to ``CheckpointEngine.create`` -- no Ray needed,
    e.g. from a plain ``torchrun`` process group -- or a run name alone inside the Ray job that runs
    it. The local tier is read first, the remote one when a local copy is missing or corrupt.

    ``state=None``: DCP sees ``{state name: state}`` of every sharded state of the version (keys
    "model.0.weight", "optim.state.0.exp_avg"); ``state=NAME``: that state's tree alone (what
    ``rc.dcp.writer`` stored under NAME: the keys ``dcp.save`` saved), which may also be a
    single-copy state (pushed ``replicated=True``, or saved by the driver): every rank reads it
    whole. An unknown step, a state of rank-local plain parts or a version without a sharded state
    (with ``state=None``) is a RestoreError here, before DCP reads anything.
    ``signing_key`` (a key or a ring; default the environment's, ``RAY_CKPT_SIGNING_KEY`` and
    ``RAY_CKPT_VERIFY_KEYS``, as every ``ray-ckpt`` command): the manifests must verify under it."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < -1):
        raise InvalidArgumentError(f"rc.dcp.reader: step must be a step number, -1 or None (the newest), got {step!r}")
    if state is not None:
        validate_name(state, "state name")
    name, tiers, key = _tiers(run, local_dir, remote_uri, remote_options, signing_key)
    m = find_version(tiers, name, None if step in (None, -1) else step, key)
    names = list(dcp_states(m, state))
    return RayCkptStorageReader(tiers, m, names, prefixed=state is None)


def writer(engine: Any, step: int, *, state: str = DEFAULT_STATE, timeout: float = 600.0) -> RayCkptStorageWriter:
    """A DCP ``StorageWriter`` that stores ``dcp.save``'s state dict as state ``state`` of version
    ``step`` of ``engine``'s run (``engine``: ``CheckpointEngine.connect(run)`` in each rank).

    The driver declares the state once, like any state its ranks push:
    ``engine.register(state, world_size=N)`` with N the number of ranks that call ``dcp.save``.
    ``write_data`` on every rank pushes its part and waits up to ``timeout`` seconds for the
    commit; ``dcp.save`` raises (DCP's CheckpointException naming the ray_ckpt error) when the
    version did not commit. One save at a time in a process: a writer made while an earlier
    ``dcp.async_save`` of this process still runs waits for it to end (two saves at once
    interleave their collectives and hang), at most ``timeout`` seconds, then raises a
    SaveTimeoutError naming the step still running. Bad input (an undeclared state, a step already committed, a world
    size other than the declared one, a dtype the shard index cannot record) raises before any
    byte is written. Read it back with ``rc.dcp.reader(run, step, state=state)`` or
    ``engine.load(state, step=step, rank=None)`` (full tensors)."""
    if not (hasattr(engine, "submit") and hasattr(engine, "config")):
        raise InvalidArgumentError(f"rc.dcp.writer: engine must be a CheckpointEngine "
                                   f"(rc.CheckpointEngine.connect(run) in a rank), got {engine!r}")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise InvalidSaveError(f"rc.dcp.writer: step must be a non-negative integer, got {step!r}")
    validate_name(state, "state name")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise InvalidArgumentError(f"rc.dcp.writer: timeout must be a positive number of seconds, got {timeout!r}")
    world = declared_world_size(engine, state)
    wait_for_earlier_saves(float(timeout), step)  # one save at a time: two interleave their collectives and hang
    latest = engine.latest_step()
    if latest is not None and step <= latest:
        raise InvalidSaveError(f"rc.dcp.writer: step {step} is not after the run's newest committed step {latest} "
                               f"of run {engine.run!r}; steps must increase; nothing was written")
    return RayCkptStorageWriter(engine, step, state, world, float(timeout))
