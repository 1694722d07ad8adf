"""The private / experimental Ray APIs the package relies on (all listed in ray_ckpt/ray_internals.py)
still exist on the installed Ray, and answer as the package expects on a running one: a Ray upgrade
that moves one fails here, naming it."""
import io
import time
import tokenize
from pathlib import Path

import ray

from ray_ckpt import ray_internals as internals

PACKAGE = Path(internals.__file__).parent
# the names only ray_internals.py may use (its INTERNALS, and the modules they live in)
PRIVATE = {"_private", "_raylet", "experimental", "_actor_id", "__ray_ready__", "get_object_locations"}


def test_every_ray_internal_still_exists():
    missing = internals.missing_internals()
    assert not missing, (f"Ray {ray.__version__} moved internals ray_ckpt relies on -- update "
                         "ray_ckpt/ray_internals.py:\n  " + "\n  ".join(missing))


def test_a_moved_internal_is_named(monkeypatch):
    fake = (internals.Internal("ray._private.node:Node", "_moved_cluster_id", "instance", "w"),
            internals.Internal("ray.actor:ActorHandle", "_gone_id", "property", "x"),
            internals.Internal("ray.experimental", "no_such_function", "attribute", "y"),
            internals.Internal("ray._private.no_such_module", "jobs", "attribute", "z"),
            internals.Internal("ray.actor", "__ray_gone__", "actor_method", "v"))
    monkeypatch.setattr(internals, "INTERNALS", internals.INTERNALS + fake)
    missing = internals.missing_internals()
    assert len(missing) == len(fake), missing
    for item, line in zip(fake, missing):
        assert repr(item.attribute) in line and item.owner in line, line
    assert "ModuleNotFoundError" in missing[3]


def _code_names(path: Path) -> set:
    """The identifiers a module's code uses (strings and comments left out)."""
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in toks if t.type == tokenize.NAME}


def test_only_the_internals_module_touches_ray_internals():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "ray_internals.py":
            continue
        used = _code_names(path) & PRIVATE
        if used:
            offenders[str(path.relative_to(PACKAGE))] = sorted(used)
    assert not offenders, f"private Ray APIs used outside ray_ckpt/ray_internals.py (add an accessor): {offenders}"


@ray.remote(num_cpus=0)
class _Idle:
    pass


def test_the_accessors_answer_on_a_running_ray(ray_session):
    cluster = internals.cluster_id()
    assert len(cluster) >= 16 and int(cluster, 16) >= 0, cluster

    job = ray.get_runtime_context().get_job_id()
    assert internals.job_alive(job) is True
    assert internals.job_alive("ffffffff") is False

    # nothing is drained on a fresh local cluster (tests/preemption_scenario.py drains a node for real)
    assert internals.draining_nodes() == {}

    # an object too big to be inlined lives in this node's object store
    ref = ray.put(b"x" * (1 << 20))
    node = ray.get_runtime_context().get_node_id()
    deadline, nodes = time.monotonic() + 10.0, []
    while not nodes and time.monotonic() < deadline:
        nodes = (internals.object_locations([ref]).get(ref) or {}).get("node_ids") or []
        if not nodes:
            time.sleep(0.05)
    assert nodes == [node]

    name = f"ray_internals_{time.monotonic_ns()}"
    actor, other = _Idle.options(name=name).remote(), _Idle.remote()
    try:
        assert ray.get(internals.actor_ready(actor), timeout=120) is True
        # a second handle on the same actor (a distinct Python object) gives the same id; another actor not
        assert internals.actor_id_hex(ray.get_actor(name)) == internals.actor_id_hex(actor)
        assert internals.actor_id_hex(other) != internals.actor_id_hex(actor)
        int(internals.actor_id_hex(actor), 16)
    finally:
        ray.kill(actor)
        ray.kill(other)
