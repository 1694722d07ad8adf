import os
import subprocess
import uuid

import pytest
import ray


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (2-core machines: fractional CPUs).

    Every worker runs with OMP_NUM_THREADS=1: set in the environment the local Ray processes inherit
    (for the ``ray.init`` call only; this process keeps its own), not as a job ``runtime_env``, with
    which every worker start went through the runtime-env agent (~0.3 s more per actor, measured) and
    the workers Ray prestarts at init were not used."""
    if not ray.is_initialized():
        before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        finally:
            if before is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = before
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def _provider_pool(ray_session):
    """The session's pooled provider actors, by (class, slot); see ``provider``."""
    made = {}
    yield made
    for actor in made.values():
        try:
            ray.kill(actor)
        except Exception:
            pass


@pytest.fixture
def provider(_provider_pool):
    """``provider(FreshLearner, seed=3)``: the session's actor of that class (tests/actors.py's
    ``Fresh*``, or any class with a ``reset(*args, **kwargs)`` that runs ``__init__`` again), as
    constructed with those arguments. Started at its first use without waiting (it imports torch
    while the test's engine starts), reset in place after: a Learner process is ~6 CPU-s to start
    on 2 cores, most of a short test's time. ``_slot=1`` gives a second actor of the same class.

    Ray restarts one a test kills (max_restarts=-1; with the arguments of its first start); one that
    is dead for good, or does not answer its reset within 60 s (a call a test left running), is
    killed and started again, so a test that breaks it does not fail the next one."""
    from actors import remote

    def get(cls, *args, _slot=0, **kwargs):
        key = (cls, _slot)
        actor = _provider_pool.get(key)
        if actor is not None:
            try:
                ray.get(actor.reset.remote(*args, **kwargs), timeout=60)
                return actor
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.kill(actor)
        actor = _provider_pool[key] = remote(cls, max_restarts=-1).remote(*args, **kwargs)
        return actor

    return get


@pytest.fixture
def run_name():
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def engine_factory(ray_session, tmp_path, run_name):
    """Create engines on tmp dirs and shut every coordinator down afterwards."""
    import ray_ckpt as rc

    made = []

    def make(**kw):
        kw.setdefault("local_dir", str(tmp_path / "local"))
        kw.setdefault("remote_uri", f"file://{tmp_path / 'remote'}")
        eng = rc.CheckpointEngine.create(kw.pop("run", run_name), **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        try:
            eng.shutdown()
        except Exception:
            pass


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS ``weed mini``, credentials enforced) for the whole
    session, with its bucket created. Yields the tests.s3server.S3Server: ``endpoint``,
    ``access_key``, ``secret_key``, ``bucket``, ``options`` (remote_options), ``uri(prefix)``,
    ``filesystem()``, and ``stop()`` / ``start()`` (same ports and data) for outage tests."""
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:  # tests/ is not a package; pytest's default import mode adds it anyway
        sys.path.insert(0, here)
    from s3server import S3Server

    srv = S3Server(str(tmp_path_factory.mktemp("s3server")))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(mb)`` mounts a real filesystem of ``mb`` MiB (tmpfs) and returns its path, to be
    filled up; unmounted afterwards. Skipped where this process may not mount (not root)."""
    mounted = []

    def mount(mb: int):
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a small filesystem here: {r.stderr.strip() or r.returncode}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(scope="module", autouse=True)
def _stop_runs_left_by_the_module():
    """Stop the ray_ckpt actors (coordinators, with the writers they own; mailboxes; replica holders)
    that a module's tests started and left running: a run created inside a rank actor (verl,
    OpenRLHF) has a coordinator that outlives the actor, and its writers' CPUs would be missing from
    the session's 4 for every later module."""
    if not ray.is_initialized():
        yield
        return
    from ray_ckpt.protocol import NAMESPACE

    def ours():
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == NAMESPACE}

    before = ours()
    yield
    for name in ours() - before:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except (ValueError, ray.exceptions.RayError):
            pass
