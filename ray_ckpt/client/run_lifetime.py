"""Starting and stopping a run's coordinator, from the engine that owns the run.

``CheckpointEngine.create()`` and ``shutdown()`` are short in what they promise (get-or-create the
coordinator and its writers, owned by this job; stop it with nothing of the run still running) and
long in how: the writable-tier checks, the owner record (``storage/ownership.py``, ``coordinator/lease.py``), Ray's
start-up errors turned into ours, a coordinator of the same name with other tiers, and on the way
out the bounded waits for in-flight work and for the actor to be gone. That "how" is here, in the
order it happens, so the engine module keeps to the API.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import ray

from ..writers import pools as writers
from ..writers.replicas import stop_holders
from ..config import EngineConfig
from ..protocol import NAMESPACE, actor_name
from .coordinator_client import coordinator_placement, open_coordinator
from ..errors import CheckpointError, InvalidArgumentError, one_line
from ..coordinator.live_options import check as check_options, shown
from ..coordinator.lease import OwnerLease, ray_identity, read_owner, write_owner
from ..ray_internals import actor_ready, job_alive
from ..storage.ownership import OwnerRecord, claim
from ..storage.tier import Tier

log = logging.getLogger("ray_ckpt")
STOP_WAIT_S = 30.0  # how long shutdown() waits for a killed coordinator to be gone
_PRELOAD = ray.remote(num_cpus=0, max_retries=0)(writers.preload)  # see prestart_writer_processes


@dataclass
class StartedRun:
    """A coordinator that answers, with its writers started, and this job's claim on the run."""

    coordinator: Any
    config: EngineConfig  # the configuration the coordinator runs with
    record: OwnerRecord   # the owner record this job wrote (its fencing token)
    tiers: List[Tier]     # where the owner record lives (renewed by the engine's OwnerLease)
    reconfigured: List[str] = field(default_factory=list)  # options create(reconfigure=True) changed


def start_run(config: EngineConfig, *, takeover: bool, owner_lease_s: float, startup_timeout: float,
              passed: Sequence[str] = (), reconfigure: bool = False) -> StartedRun:
    """Check the tiers, claim the run for this job, get-or-create its coordinator and wait for it
    and its writers. On a coordinator that was running already, the options in ``passed`` must
    equal its own, or (``reconfigure``) be ones that change live: ``live_options.check``.
    Raises InvalidArgumentError / OwnershipError / CheckpointError naming why."""
    run = config.run
    # fail fast, in the caller, on tiers that cannot be written (bad path, wrong credentials)
    config.local_tier().check_writable()
    if config.remote_uri:
        config.remote_tier().check_writable()
    if not isinstance(owner_lease_s, (int, float)) or isinstance(owner_lease_s, bool) or owner_lease_s <= 0:
        raise InvalidArgumentError(f"owner_lease_s must be a number of seconds > 0, got {owner_lease_s!r}")
    if not ray.is_initialized():
        ray.init()
    tiers = [config.local_tier()] + ([config.remote_tier()] if config.remote_uri else [])
    cluster, job = ray_identity()
    record = claim(read_owner(tiers), cluster, job, takeover=bool(takeover), run=run,
                   lease_s=float(owner_lease_s), job_alive=job_alive)
    write_owner(tiers, record)
    prestart_writer_processes(config)
    try:
        coord, existing = open_coordinator(config, startup_timeout)
    except ray.exceptions.GetTimeoutError:
        raise CheckpointError(f"the coordinator of run {run!r} or its writers did not start within "
                              f"{startup_timeout}s (are there enough CPUs for critical_cpus / "
                              f"best_effort_cpus?)") from None
    except ray.exceptions.RayActorError as exc:
        raise CheckpointError(f"the coordinator of run {run!r} could not start: "
                              f"{one_line(exc)[:500]}") from None
    # a live run's options: those the caller passed must match, or change live (coordinator/live_options.py)
    changes = check_options(run, existing, config, passed, reconfigure)
    if changes:
        try:
            existing = ray.get(coord.reconfigure.remote(changes), timeout=60)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            raise (cause if isinstance(cause, CheckpointError) else CheckpointError(
                f"reconfiguring run {run!r} failed: {one_line(cause or exc)[:300]}")) from None
        log.warning("run %r: create(reconfigure=True) applied %s", run, ", ".join(shown(changes)))
    return StartedRun(coord, existing, record, tiers, sorted(changes))


def prestart_writer_processes(config: EngineConfig) -> None:
    """Start the worker processes a new coordinator's writers will take, while the coordinator's
    own process starts: one no-op task per writer (``writers.preload``), placed like the
    coordinator, each leaving an idle worker process that has imported the writers' modules.

    Why: the coordinator creates its writers (it owns them: they live and die with it) only once
    its own process is up, so their process starts would queue behind it and a create() would
    spend most of its time starting processes one after the other (``benchmarks/create_cost.py``). Nothing
    depends on these tasks: if Ray gives the writers other processes, or none of these is needed
    (the coordinator exists already: nothing is started then), only their start-up was spent."""
    try:
        ray.get_actor(actor_name(config.run), namespace=NAMESPACE)
        return  # get-or-create will get it: its writers are running
    except ValueError:
        pass
    preload = _PRELOAD.options(**coordinator_placement())
    for _ in range(config.critical_writers + config.best_effort_writers):
        preload.remote()  # fire and forget: its result, None, is never read


def stop_run(coordinator: Any, run: str, in_flight: List[Any], timeout: float,
             lease: Optional[OwnerLease], holders: bool = False) -> None:
    """Wait (at most ``timeout``) for the engine's saves (``in_flight``: their refs) and the
    coordinator's work in progress, kill it, free the run, and wait (bounded) until it is gone."""
    deadline = time.monotonic() + timeout
    # this engine's saves first: the coordinator may not have started one that was just called
    # (it runs concurrent calls in any order), so quiesce() alone could miss it
    if in_flight:
        ray.wait(in_flight, num_returns=len(in_flight), timeout=timeout)
    try:
        left = max(0.0, deadline - time.monotonic())
        unfinished = ray.get(coordinator.quiesce.remote(left), timeout=left + 30)
    except ray.exceptions.RayError as exc:  # already gone, or stuck (GetTimeoutError)
        unfinished = [f"the coordinator did not answer ({one_line(exc)[:200]})"]
    if unfinished:
        log.warning("shutting down run %r with work unfinished after %.0fs: %s", run, timeout,
                    "; ".join(unfinished))
    ray.kill(coordinator, no_restart=True)
    if holders:  # detached from the coordinator (they outlive its restarts): stopped by name
        stop_holders(run)
    if lease is not None:  # the run is free for another job at once
        lease.stop(release_record=True)
    # ray.kill only asks: wait (bounded) until the coordinator is gone, so that nothing of this
    # run still runs when shutdown() returns and a new engine of the same run starts afresh
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        try:
            ray.get(actor_ready(coordinator), timeout=max(0.1, deadline - time.monotonic()))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            return
        except ray.exceptions.GetTimeoutError:
            break
        time.sleep(0.05)
    log.warning("the coordinator of run %r had not stopped 30s after shutdown()", run)
