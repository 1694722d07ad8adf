"""Every private, experimental or undocumented Ray API the package relies on -- the one place to look
when a Ray upgrade breaks it. Everything else uses Ray's public API (``ray.get`` / ``wait`` / ``put``
/ ``kill`` / ``nodes``, scheduling strategies, ``get_runtime_context().get_node_id()`` /
``get_job_id()`` / ``gcs_address``, ``ray.util.metrics``) and ``ActorHandle.__ray_call__``, a
DeveloperAPI that Ray documents (run a callable in the actor; checked below all the same: the engine's
actor protocol runs on it).

========================================================= =================================================
internal                                                  why there is no public way
========================================================= =================================================
``ray._private.worker.global_worker.node.cluster_id``     Which Ray cluster owns a run (the owner record on
(``Node.cluster_id``)                                     the tiers): a job id alone repeats across
                                                          clusters, and the GCS address repeats on one host
                                                          (same port). Ray has no public cluster id.
``ray._private.state.jobs()``                             Whether the job that owns a run still runs, so a
                                                          new driver takes over a dead driver's run at once
                                                          instead of waiting out its lease. The public
                                                          ways (``ray.util.state.list_jobs``, the job
                                                          submission client) go through the dashboard,
                                                          which a cluster started with
                                                          ``include_dashboard=False`` does not have.
``ray.experimental.get_object_locations``                 Which node holds a snapshot in its object store,
                                                          so the writer on that node writes it (no copy of
                                                          the bytes across nodes). Experimental, with no
                                                          stable equivalent.
``ActorHandle._actor_id``                                 One key per coordinator for the handles' shared
                                                          wait calls: copies of a handle are distinct
                                                          Python objects, and keying on the handle itself
                                                          would keep the actor referenced from a cache.
                                                          A handle exposes no public id.
``ray._private.state.state``                              Which nodes Ray drains and by when (preemption
(``GlobalState.get_draining_nodes``)                      notices): the node table (``ray.nodes()``) does not
                                                          say that a live node is being drained. What Ray
                                                          Train's preemption watcher and Serve's node cache
                                                          read; no public API yet.
``ray.train.v2._internal.execution.context``              The Train run's ``RunConfig`` inside a worker, so
(``get_train_context().train_run_context.run_config``)    its ``CheckpointConfig`` (how many checkpoints to
                                                          keep, by which metric) becomes the ray_ckpt run's
                                                          retention without the user saying it twice. The
                                                          public ``ray.train.get_context()`` does not give
                                                          the run config to a worker.
``__ray_ready__`` (every actor's built-in method)         Wait until an actor has started (its constructor
                                                          ran) without a method of our own on every actor
                                                          class (writers, coordinator, mailbox).
                                                          Undocumented.
========================================================= =================================================

:func:`missing_internals` checks each against the installed Ray without starting it (a test runs
it, and one that exercises every accessor on a running Ray) and names the one that moved. Only the
accessors below touch them; no other module of the package does (a test greps for that). This
module imports nothing of the package, so any layer may use it.
"""
from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence


@dataclass(frozen=True)
class Internal:
    """One internal: ``attribute`` of ``owner`` ("package.module:Class" or "package.module").
    ``kind``: "instance" (assigned to ``self`` in the class's source), "property", "attribute" (of a
    module), "field" (of a dataclass) or "actor_method" (a method Ray adds to every actor class: defined in ``ray.actor``)."""

    owner: str
    attribute: str
    kind: str
    why: str


INTERNALS = (
    Internal("ray._private.worker", "global_worker", "attribute", "the connected worker (its node's cluster id)"),
    Internal("ray._private.worker:Worker", "node", "instance", "the worker's node (its cluster id)"),
    Internal("ray._private.node:Node", "cluster_id", "instance",
             "telling Ray clusters apart in a run's owner record"),
    Internal("ray._private.state", "jobs", "attribute", "whether the job that owns a run still runs"),
    Internal("ray.experimental", "get_object_locations", "attribute",
             "which node holds a snapshot (its writer writes it there)"),
    Internal("ray._private.state", "state", "attribute", "the GCS state accessor (draining nodes)"),
    Internal("ray._private.state:GlobalState", "get_draining_nodes", "attribute",
             "preemption notices: which nodes Ray drains, with their deadlines"),
    Internal("ray.train.v2._internal.execution.context", "get_train_context", "attribute",
             "a Train worker's run config (its CheckpointConfig becomes the run's retention)"),
    Internal("ray.train.v2._internal.execution.context:TrainContext", "train_run_context", "field",
             "a Train worker's run config (its CheckpointConfig becomes the run's retention)"),
    Internal("ray.train.v2._internal.execution.context:TrainRunContext", "run_config", "field",
             "a Train worker's run config (its CheckpointConfig becomes the run's retention)"),
    Internal("ray.actor:ActorHandle", "_actor_id", "property", "one wait call per coordinator, shared by handles"),
    Internal("ray.actor", "__ray_ready__", "actor_method", "waiting until an actor has started"),
    Internal("ray.actor", "__ray_call__", "actor_method", "the engine's actor protocol (snapshot, restore)"),
)


def resolve_owner(owner: str) -> Any:
    """The module or class an :class:`Internal` names ("package.module:Class.Inner")."""
    module, _, qualname = owner.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def assigned_in_source(cls: Any, attribute: str) -> bool:
    """Whether ``cls``'s source assigns ``self.<attribute>`` (an instance attribute that exists only
    once an object is built, which cannot be checked without building one)."""
    assignment = rf"\bself\.{re.escape(attribute)}\s*(:[^=\n]*)?=(?!=)"
    return re.search(assignment, inspect.getsource(cls)) is not None


def missing_among(items: Sequence[Any], present: Callable[[Any, Any], bool], used_for: str) -> List[str]:
    """One line per item of ``items`` (each with ``owner``, ``attribute``, ``kind``, ``why``, like
    :class:`Internal`) that ``present(owner, item)`` does not find, or whose owner moved: what moved
    and, with ``used_for`` (formatted with ``why``), what it was used for. The RLlib integration's
    own list of internals is checked the same way."""
    missing = []
    for item in items:
        note = ""
        try:
            ok = present(resolve_owner(item.owner), item)
        except Exception as exc:  # the owner itself moved
            ok, note = False, f" ({type(exc).__name__}: {exc})"
        if not ok:
            missing.append(f"{item.owner} has no {item.kind} {item.attribute!r}{note}: "
                           + used_for.format(why=item.why))
    return missing


def _present(obj: Any, item: Internal) -> bool:
    if item.kind == "instance":
        return assigned_in_source(obj, item.attribute)
    if item.kind == "property":
        return isinstance(inspect.getattr_static(obj, item.attribute, None), property)
    if item.kind == "attribute":
        return getattr(obj, item.attribute, None) is not None
    if item.kind == "field":
        return item.attribute in getattr(obj, "__dataclass_fields__", {})
    if item.kind == "actor_method":
        return re.search(rf"\bdef {re.escape(item.attribute)}\(", inspect.getsource(obj)) is not None
    raise ValueError(f"unknown kind {item.kind!r}")


def missing_internals() -> List[str]:
    """One line per internal that the installed Ray no longer has (empty: all there)."""
    return missing_among(INTERNALS, _present, "ray_ckpt uses it for {why} (ray_ckpt/ray_internals.py)")


# ---------------------------------------------------------------------- the accessors
def cluster_id() -> str:
    """The hex id of the Ray cluster this process is connected to ('' where Ray moved it)."""
    try:
        from ray._private import worker

        node = getattr(worker.global_worker, "node", None)
        cid = getattr(node, "cluster_id", None)
        return cid.hex() if cid is not None else ""
    except Exception:  # moved: the caller tells clusters apart by their GCS address instead
        return ""


def job_alive(job: str) -> Optional[bool]:
    """Whether job ``job`` (hex id) of this Ray cluster still runs (None: cannot tell)."""
    try:
        from ray._private import state

        for j in state.jobs():
            if str(j.get("JobID")) == job:
                return not j.get("IsDead", False)
        return False
    except Exception:
        return None


def object_locations(refs: Sequence[Any]) -> Dict[Any, Dict[str, Any]]:
    """{ref: {"node_ids": [...], "object_size": n}} for the refs Ray could locate (see
    ``ray.experimental.get_object_locations``: objects under 100 KiB live in their owner's memory,
    with no node)."""
    import ray.experimental

    return ray.experimental.get_object_locations(list(refs))


def draining_nodes() -> Dict[str, float]:
    """{node id (hex): deadline as unix time} of the nodes Ray is draining (``ray drain-node``, the
    autoscaler's preemption and idle drains); ``inf`` for a drain without a deadline. Raises where
    Ray cannot be asked (the caller reports it and asks again)."""
    from ray._private import state

    return {node: (ms / 1000.0 if ms else float("inf")) for node, ms in state.state.get_draining_nodes().items()}


def train_checkpoint_config() -> Any:
    """The ``CheckpointConfig`` of the Ray Train run this worker belongs to (Train v2), or None
    outside a Train worker."""
    from ray.train.v2._internal.execution import context

    try:
        run_context = context.get_train_context().train_run_context
    except RuntimeError:  # not inside a Train worker
        return None
    return run_context.run_config.checkpoint_config


def actor_id_hex(handle: Any) -> str:
    """The hex id of the actor behind ``handle`` (the same for every copy of the handle)."""
    return handle._actor_id.hex()


def actor_ready(handle: Any) -> Any:
    """An ObjectRef that resolves (to True) once the actor behind ``handle`` has started."""
    return handle.__ray_ready__.remote()
