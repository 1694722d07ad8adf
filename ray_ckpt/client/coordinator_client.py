"""Starting and calling the run's named coordinator actor from an engine: where it is placed,
get-or-create by name (with the retries a just-died name needs), Ray's errors turned into ours, and
``CoordinatorLink``, the engine's calls that bring a coordinator gone for good back."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Optional, Tuple

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ..config import EngineConfig
from ..coordinator.actor import CoordinatorActor
from ..protocol import NAMESPACE, actor_name
from ..errors import CheckpointError, one_line

log = logging.getLogger("ray_ckpt")
_HEAD_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node


def outside_placement_group() -> Dict[str, Any]:
    """``.options(...)`` that place a task or actor outside the caller's placement group.

    Ray schedules what a process starts inside that process's placement group when the group
    captures child tasks -- a Tune trial's does -- and the engine's coordinator and its start-up
    tasks do not fit a trial's bundles (nor belong to the trial: the coordinator is detached).
    ``PlacementGroupSchedulingStrategy(placement_group=None)`` is Ray's documented escape; the
    engine's writers need none, as the coordinator that starts them is outside any group. Only
    given inside a group: Ray warns about a restartable detached actor given a placement-group
    strategy, even this one, and a driver belongs to none."""
    if get_current_placement_group() is None:
        return {}
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=None)}


def coordinator_placement() -> Dict[str, Any]:
    """Where the coordinator runs: on the head node where Ray marks it — worker nodes are the
    preemptible ones, and a coordinator that dies with one fails the saves in flight — else next
    to this process. (A soft node-affinity request alone was not honoured for this num_cpus=0
    detached actor: on a 3-node ``Cluster`` it landed on a worker.) Either way outside the
    caller's placement group (a Tune trial's): :func:`outside_placement_group`."""
    if _HEAD_RESOURCE in ray.cluster_resources():
        return {"resources": {_HEAD_RESOURCE: 0.001}, **outside_placement_group()}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                  soft=True)}


def _start_coordinator(config: EngineConfig) -> Any:
    return CoordinatorActor.options(
        name=actor_name(config.run), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        # max_concurrency: every call is a coroutine on one event loop and none holds a slot while
        # it waits for a commit (submit() only accepts; handles share one wait() per version and
        # process), but thousands of ranks' pushes and waits arrive at once: Ray's default of 1,000
        # slots would queue the parts that complete a version behind calls waiting for it.
        # A slot costs a coroutine, not a thread, so the ceiling is set far above any world size.
        max_restarts=-1, num_cpus=0, max_concurrency=100_000, **coordinator_placement(),
    ).remote(config)


def open_coordinator(config: EngineConfig, timeout: float) -> Tuple[Any, EngineConfig]:
    """Get-or-create the coordinator of ``config.run``, wait until it and its writers answer, and
    return it with the configuration it runs with. Right after a coordinator died, Ray may resolve
    the name to the dead actor for a moment: that is retried (bounded); a coordinator that fails to
    start (its constructor raised) is not."""
    deadline = time.monotonic() + 30
    while True:
        coord = _start_coordinator(config)
        try:
            existing = ray.get(coord.config.remote(), timeout=timeout)
            ray.get(coord.ready.remote(), timeout=timeout)
            return coord, existing
        except ray.exceptions.ActorDiedError as exc:
            if exc.actor_init_failed or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def ask_coordinator(run: str, ref: Any, what: str, timeout: float = 60.0, error: type = CheckpointError) -> Any:
    """``ray.get`` of a coordinator call; Ray's errors become ours, naming the run and the call."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise error(f"the coordinator of run {run!r} did not answer {what} within {timeout:.0f}s") from None
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
        err = error(f"the coordinator of run {run!r} is not reachable ({what}): {one_line(exc)[:200]}; "
                    f"a restarted coordinator answers again once Ray has recreated it")
        err.actor_died = isinstance(exc, ray.exceptions.ActorDiedError)  # for CheckpointEngine._call
        raise err from None
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, CheckpointError):
            raise cause from None
        raise error(f"{what} failed in the coordinator of run {run!r}: {one_line(cause or exc)[:300]}") from None


class CoordinatorLink:
    """A mixin of :class:`~ray_ckpt.client.engine.CheckpointEngine`: its calls to the coordinator
    (the state it uses -- ``_coordinator``, ``run``, ``config``, ``_owner``, ``_closed``, ``_token``
    -- is set up by the engine)."""

    _coordinator: Any
    run: str
    config: EngineConfig
    _owner: bool
    _closed: bool
    _token: Optional[int]

    def _call(self, method: Callable[[Any], Any], what: str, timeout: float = 60.0,
              error: type = CheckpointError) -> Any:
        """Call the coordinator (``method(handle)`` returns the ref); if it died for good, the
        owning engine creates it again and asks once more."""
        self._check_open()
        try:
            return ask_coordinator(self.run, method(self._coordinator), what, timeout, error)
        except CheckpointError as exc:
            if not getattr(exc, "actor_died", False) or not self._revive():
                raise
        return ask_coordinator(self.run, method(self._coordinator), what, timeout, error)

    def _revive(self) -> bool:
        """The coordinator died for good (``ray.kill`` without restart, or its restarts exhausted):
        the engine that created it creates it again by name; the new one rebuilds its catalogue
        from storage. Engines from ``connect()`` (ranks) leave that to the driver, and nothing
        revives a coordinator after ``shutdown()``. Returns whether a new coordinator answers."""
        if not self._owner or self._closed:
            return False
        log.warning("the coordinator of run %r is gone; creating it again from storage", self.run)
        try:
            self._coordinator, _ = open_coordinator(self.config, 120.0)
            if self._token is not None:
                ray.get(self._coordinator.set_owner.remote(self._token), timeout=60)
        except ray.exceptions.RayError as exc:
            log.error("the coordinator of run %r could not be created again: %s", self.run, one_line(exc)[:300])
            return False
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this engine of run {self.run!r} was shut down; CheckpointEngine.create() "
                                  f"or connect() gives a new one (committed checkpoints are still in storage)")
