"""Starting and calling the run's named coordinator actor from an engine: where it is placed,
get-or-create by name (with the retries a just-died name needs), and Ray's errors turned into ours."""
from __future__ import annotations

import time
from typing import Any, Dict, Tuple

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ..config import EngineConfig
from ..coordinator.actor import CoordinatorActor
from ..protocol import NAMESPACE, actor_name
from ..errors import CheckpointError, one_line

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


def _coordinator_placement() -> Dict[str, Any]:
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
        max_restarts=-1, num_cpus=0, max_concurrency=100_000, **_coordinator_placement(),
    ).remote(config)


def _open_coordinator(config: EngineConfig, timeout: float) -> Tuple[Any, EngineConfig]:
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


def _ask(run: str, ref: Any, what: str, timeout: float = 60.0, error: type = CheckpointError) -> Any:
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
