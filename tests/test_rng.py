"""rc.rng_state() / rc.set_rng_state(): every random stream of a process continues exactly where
the checkpoint was taken, through the real format (no pickle) and through a real save/restore."""
import random

import numpy as np
import pytest
import ray
import torch

import ray_ckpt as rc
from actors import Sampler
from test_formats import roundtrip


def _draws(gens):
    """A few numbers from every stream: python, numpy global, torch global, and each generator."""
    out = [random.random(), random.getrandbits(64), float(np.random.rand()), float(np.random.normal()),
           torch.rand(3).tolist(), torch.randn(2).tolist()]
    out.append(float(gens["np"].random()))
    out.append(float(gens["legacy"].rand()))
    out.append(torch.rand(2, generator=gens["torch"]).tolist())
    return out


def _gens(seed):
    return {"np": np.random.default_rng(seed), "legacy": np.random.RandomState(seed),
            "torch": torch.Generator().manual_seed(seed)}


def test_every_stream_continues_exactly_after_a_roundtrip_through_the_format(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    gens = _gens(4)
    np.random.normal()  # numpy's global state now holds a cached gaussian: it must come back too
    _draws(gens)
    stored = roundtrip(rc.rng_state(generators=gens), tmp_path, name="rng")
    expected = _draws(gens)
    fresh = _gens(99)  # a relaunched process: other seeds everywhere
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    rc.set_rng_state(stored, generators=fresh)
    assert _draws(fresh) == expected


def test_wrong_input_is_a_clear_error():
    with pytest.raises(rc.RestoreError, match="what rc.rng_state"):
        rc.set_rng_state({"python": 1})
    with pytest.raises(rc.RestoreError, match=r"no saved RNG state for generator\(s\) \['env'\]"):
        rc.set_rng_state(rc.rng_state(), generators={"env": np.random.default_rng(0)})
    with pytest.raises(rc.InvalidArgumentError, match="generator 'env'.*got int"):
        rc.rng_state(generators={"env": 7})
    saved = rc.rng_state(generators={"g": np.random.default_rng(0)})
    with pytest.raises(rc.RestoreError, match="generator 'g': the saved state does not fit"):
        rc.set_rng_state(saved, generators={"g": torch.Generator()})


def test_an_actors_random_streams_resume_exactly_after_restore(engine_factory):
    actor = ray.remote(num_cpus=0.1)(Sampler).remote()
    eng = engine_factory(remote_uri=None, critical_writers=1, best_effort_writers=0)  # one writer process: one state
    eng.register("rng", actor)
    ray.get(actor.draw.remote())
    eng.save(1).wait(timeout=60)
    expected = [ray.get(actor.draw.remote()) for _ in range(3)]
    report = eng.restore()
    assert report.states["rng"].status == "restored" and report.states["rng"].verified
    assert [ray.get(actor.draw.remote()) for _ in range(3)] == expected
