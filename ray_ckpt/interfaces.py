"""The extension points, written down: what others implement (a state provider, a storage tier) and
what the framework integrations plug into (the engine's save/load seam). Each docstring spells the
call sequence, in the order the engine makes the calls, as torch DCP's ``StorageWriter`` does.

Nothing here is new behaviour: the classes that implement these already existed and declare it
(:class:`~ray_ckpt.storage.tier.Tier` subclasses :class:`StorageTier`; ``CheckpointEngine``, the
test suite's actors and torch's stateful objects are checked against the Protocols in
``tests/test_interfaces.py``). This module imports nothing of the package: every layer may name it.
"""
from __future__ import annotations

import abc
from typing import Any, Dict, Iterator, List, Optional, Protocol, Tuple, runtime_checkable

__all__ = ["StateProvider", "Stateful", "StorageTier", "CheckpointSeam"]


@runtime_checkable
class StateProvider(Protocol):
    """A Ray actor whose state the engine saves and restores: ``engine.register(name, handle)``.

    Call sequence, for each state name the actor was registered under:

    1. ``engine.register(name, handle)`` (driver): nothing is called on the actor yet.
    2. ``engine.save(step)`` (driver): the driver submits ``ckpt_get_state(name)`` to the actor
       itself, so Ray's per-caller ordering runs it right after the actor's training call for that
       step; the returned state (a nested dict / list / tuple of tensors, numpy arrays, Arrow tables
       and JSON scalars) is copied into host memory and handed to the object store inside the actor
       (the driver never touches its bytes). The actor must not change the returned objects until
       the call returns (with ``overlap=True``: until the fences of ``rc.fence`` let it).
    3. ``engine.restore()`` (driver): every part of the version is read and verified first, then
       ``ckpt_set_state(name, state)`` is called once per state, with the structure and types
       ``ckpt_get_state`` returned (integer keys stay integers, tuples stay tuples, exact dtypes).

    ``rc.actor_provider(handle, get=..., set=...)`` names other methods with these signatures;
    ``rc.actor_method(handle, "attr")`` uses an attribute that is :class:`Stateful` instead.
    """

    def ckpt_get_state(self, name: str) -> Any:
        """The state registered as ``name``, as it is at this step."""

    def ckpt_set_state(self, name: str, state: Any) -> None:
        """Load ``state`` (what ``ckpt_get_state(name)`` returned at the restored step)."""


@runtime_checkable
class Stateful(Protocol):
    """An in-process object registered as it is (``engine.register("model", model)``): torch's
    ``Stateful`` protocol, which modules, optimizers, LR schedulers and ``StatefulDataLoader`` follow.

    Call sequence: at ``engine.save(step)``, ``state_dict()`` in the calling process, its tensors
    copied into host memory before ``save`` returns; at ``engine.restore()``, after the version was
    read and verified, ``load_state_dict(state)`` once. (RLlib's ``get_state()`` / ``set_state()``
    are taken the same way.)
    """

    def state_dict(self) -> Dict[str, Any]:
        """The object's state now."""

    def load_state_dict(self, state_dict: Dict[str, Any]) -> Any:
        """Become ``state_dict``."""


class StorageTier(abc.ABC):
    """One run root on one storage (a node's disk, an object store): where writers put a version's
    files and readers verify them. Paths given to methods are relative to the run root
    (``v000000000100/policy/rank0.safetensors``).

    Call sequence of one version, ``v``:

    1. ``check_writable()`` once, when the engine is created: a tier that cannot be written fails
       there, not at the first save.
    2. Writers, for each file of each part: ``open_atomic(rel)`` (a sink that hashes what is written;
       the file appears under ``rel`` only if the block succeeds) or ``put_bytes(rel, data)``;
       each returns or records the file's size and checksum for the manifest.
    3. The coordinator, when every critical part is durable: ``put_bytes(manifest_rel, data)`` last.
       That one atomic write commits ``v``; a version without it is never listed nor restored.
    4. The catalogue (at start, after a restart): ``version_dirs()`` (version -> has a manifest),
       then ``read_bytes`` of each manifest.
    5. Restore: ``read_verified(rel, size, checksum)`` per file, or ``read_range`` for a part of one
       (each read checked against the manifest's digests by its caller); ``exists(rel)`` to choose
       a tier before reading.
    6. Retention and gc: ``list_files(rel)`` of a version directory, ``delete_file(rel)`` of each file
       no kept version references, manifest first, so a half-deleted version is not listed.

    Every method raises ``FileNotFoundError`` for a missing file, ``IntegrityError`` for one that does
    not match (or, on a local disk, is a link or special file: nothing outside the root is read,
    written or deleted), or the filesystem's own ``OSError``; none hangs on odd storage.
    """

    name: str  # "local" or "remote": what reports and errors call the tier
    uri: str   # the run root's URI (``display`` redacts its secrets)

    @abc.abstractmethod
    def check_writable(self) -> None:
        """Fail at once, with a clear error, on a tier that cannot be written."""

    @abc.abstractmethod
    def open_atomic(self, rel: str) -> Iterator[Any]:
        """A context manager yielding a hashing sink; ``rel`` appears only if the block succeeds."""

    @abc.abstractmethod
    def put_bytes(self, rel: str, data: bytes) -> Tuple[int, str]:
        """Write ``data`` to ``rel`` atomically; returns (size, checksum)."""

    @abc.abstractmethod
    def version_dirs(self) -> Dict[int, bool]:
        """version -> whether it has a manifest (committed); a missing root: empty."""

    @abc.abstractmethod
    def read_bytes(self, rel: str) -> Any:
        """The whole file ``rel`` in fresh writable memory."""

    @abc.abstractmethod
    def read_range(self, rel: str, begin: int, end: int) -> Any:
        """Bytes ``[begin, end)`` of ``rel`` in fresh writable memory."""

    @abc.abstractmethod
    def read_verified(self, rel: str, size: int, checksum: str) -> Any:
        """The file ``rel``, checked against the manifest's size and checksum (else IntegrityError)."""

    @abc.abstractmethod
    def exists(self, rel: str) -> bool:
        """Whether ``rel`` is there."""

    @abc.abstractmethod
    def list_files(self, rel: str) -> List[str]:
        """Every file under ``rel``, relative to the root."""

    @abc.abstractmethod
    def delete_file(self, rel: str) -> bool:
        """Delete ``rel`` if it is there; True if something was deleted."""


@runtime_checkable
class CheckpointSeam(Protocol):
    """What every framework integration calls: the engine's save / load seam
    (``CheckpointEngine`` implements it). A framework's own save and load calls are kept, and each
    runs this sequence underneath:

    - RLlib, ``RayCkptCallback``: 1-2 in ``on_algorithm_init``; 3 in ``on_train_result`` (its
      ``save``), 4 in ``flush`` / ``close``; 5 in ``restore_algorithm``.
    - verl, ``RayCkptCheckpointManager``: 1-2 when built; 3 in ``save_checkpoint``, 4 in
      ``wait_until_finished``; 5 in ``load_checkpoint``.
    - OpenRLHF, ``RayCkptDeepspeedStrategy``: 1-2 at the first ``save_ckpt`` / ``load_ckpt`` of a
      folder; 3 in ``save_ckpt``, 4 in ``wait_until_finished``; 5 in ``load_ckpt``.
    - torch DCP, ``rc.dcp.writer(engine, step)``: 2 by the driver (``register(name, world_size=N)``),
      checked in ``set_up_storage_writer``; 3 and 4 in ``write_data`` (``submit``, then the handle's
      wait); ``finish`` checks the step is listed (``all_steps``). ``rc.dcp.reader(run, step)`` reads a
      committed version in ``read_metadata`` / ``read_data`` from the tiers themselves (no engine).

    1. ``CheckpointEngine.create(run, ...)`` (the driver, or rank 0) or ``connect(run)`` (any other
       process of the cluster).
    2. ``register(name, provider)`` for states the engine captures itself, or
       ``register(name, world_size=N)`` for a state N ranks push (once; again after a relaunch with
       ``replace=True``).
    3. Each checkpoint, at one training step: ``save(step)`` (captured states), or ``submit(step,
       name, state, rank=r)`` from every rank (inside ``push_group()`` for several at once). Both
       return a ``SaveHandle`` at once; nothing waits for storage. ``preemption_save_due()`` at each
       step says whether a preemption notice asks for one more save now.
    4. Commit: the handle completes when every critical part of the version is durable and its
       manifest written; the framework's markers (verl's and OpenRLHF's ``ray_ckpt.json`` and
       "latest" files) are written only then, so a framework never names an uncommitted version. Before the
       process exits, every handle is waited on: ``wait_until_finished`` / the callback's ``flush``
       raise a failed save's error (the callback's ``close``, called by ``algorithm.stop()``, logs
       it as an error), never drop it.
    5. Load: ``all_steps()`` / ``latest_step()`` to choose the newest committed step at or before the
       one asked for, then ``load(name, step, rank)`` (a copy) or ``load_into(name, state, step,
       rank)`` (in place; sharded state resharded to this world size).
    6. ``shutdown()`` when the run is done (the coordinator keeps running for other processes
       unless it is stopped).
    """

    run: str  # the run's name: what errors, pointers and DCP's ``checkpoint_id`` name

    def register(self, name: str, provider: Any = None, **options: Any) -> None:
        """Capture (or, with ``world_size``, receive) the state ``name`` at every save."""

    def save(self, step: Optional[int] = None, **options: Any) -> Any:
        """Start the version of ``step``; returns its ``SaveHandle`` at once."""

    def submit(self, step: int, name: str, state: Any, rank: int = 0, **options: Any) -> Any:
        """Push this rank's part of ``name`` at ``step``; returns the version's ``SaveHandle``."""

    def preemption_save_due(self) -> Any:
        """The preemption notice in force when a save is due for it (the first step after it, then
        each step after the newest save got off the drained node), else None."""

    def all_steps(self) -> List[int]:
        """Every committed step, oldest first."""

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None."""

    def load(self, name: Any = None, step: Any = -1, rank: Optional[int] = 0, **options: Any) -> Any:
        """One state of a committed version, read and verified; ``with_report=True``: ``(state,
        StateReport)``, the tier it came from."""

    def load_into(self, name: str, state: Any, step: int = -1, rank: int = 0, **options: Any) -> Any:
        """One state of a committed version, copied into ``state`` in place."""

    def shutdown(self, timeout: float = 60.0, **options: Any) -> None:
        """Wait for this process's saves, then let go of the run."""
