import os
import uuid

import pytest
import ray


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (2-core machines: fractional CPUs)."""
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


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
