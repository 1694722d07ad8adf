"""Random-number-generator state of a process, as a state ray_ckpt stores without pickle.

A resumed RL run is only bit-identical if every stream of random numbers continues where it
stopped: Python's ``random`` (environment resets, sampling in user code), NumPy's global generator,
torch's CPU generator and each CUDA device's generator (dropout, ``torch.multinomial``), and the
explicit generators a trainer owns. ``rng_state()`` gathers them into a nested dict of tuples,
integers and arrays; ``set_rng_state()`` puts them back. Register them like any other state::

    engine.register("rng", lambda: rc.rng_state(generators={"env": env_rng}),
                    loader=lambda s: rc.set_rng_state(s, generators={"env": env_rng}))

or return ``rc.rng_state()`` from an actor's ``ckpt_get_state`` to capture the actor's own process.
"""
from __future__ import annotations

import logging
import random
from typing import Any, Dict, Mapping, Optional

import numpy as np
import torch

from ..errors import InvalidArgumentError, RestoreError

log = logging.getLogger("ray_ckpt.rng")

Generators = Mapping[str, Any]  # name -> numpy.random.Generator | numpy.random.RandomState | torch.Generator


def rng_state(generators: Optional[Generators] = None) -> Dict[str, Any]:
    """The state of this process's generators: ``python``, ``numpy``, ``torch``, ``cuda`` (one
    state per device, only when CUDA is initialised in this process: asking would initialise it)
    and ``generators`` (each of ``generators`` by its name)."""
    out: Dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                           "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    if generators:
        out["generators"] = {name: _generator_state(name, gen) for name, gen in generators.items()}
    return out


def set_rng_state(state: Mapping[str, Any], generators: Optional[Generators] = None) -> None:
    """Put back what ``rng_state()`` captured. Each named generator in ``generators`` gets its saved
    state; a name that was not saved raises ``RestoreError`` (its stream would silently restart)."""
    if not isinstance(state, Mapping) or not {"python", "numpy", "torch"} <= set(state):
        raise RestoreError("set_rng_state() takes what rc.rng_state() returned (a dict with python, numpy "
                           f"and torch entries), got {type(state).__name__}")
    saved = state.get("generators", {})
    missing = sorted(set(generators or {}) - set(saved))
    if missing:
        raise RestoreError(f"no saved RNG state for generator(s) {missing}; saved: {sorted(saved)}")
    random.setstate(_as_python_state(state["python"]))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(_as_byte_tensor(state["torch"]))
    if "cuda" in state:
        _set_cuda(list(state["cuda"]))
    for name, gen in (generators or {}).items():
        _set_generator_state(name, gen, saved[name])


def _generator_state(name: str, gen: Any) -> Any:
    if isinstance(gen, np.random.Generator):
        return gen.bit_generator.state
    if isinstance(gen, np.random.RandomState):
        return gen.get_state()
    if isinstance(gen, torch.Generator):
        return gen.get_state()
    raise InvalidArgumentError(f"generator {name!r}: expected a numpy.random.Generator, numpy.random.RandomState "
                               f"or torch.Generator, got {type(gen).__name__}")


def _set_generator_state(name: str, gen: Any, st: Any) -> None:
    try:
        if isinstance(gen, np.random.Generator):
            gen.bit_generator.state = dict(st)
        elif isinstance(gen, np.random.RandomState):
            gen.set_state(tuple(st))
        elif isinstance(gen, torch.Generator):
            gen.set_state(_as_byte_tensor(st))
        else:
            _generator_state(name, gen)  # raises the unsupported-type error
    except (TypeError, ValueError, KeyError, RuntimeError) as exc:
        raise RestoreError(f"generator {name!r}: the saved state does not fit it: {exc}") from None


def _as_python_state(st: Any) -> tuple:
    version, internal, gauss = st  # random.getstate(): (3, tuple of 625 ints, gauss_next)
    return (int(version), tuple(int(x) for x in internal), gauss)


def _as_byte_tensor(st: Any) -> torch.Tensor:
    t = st if isinstance(st, torch.Tensor) else torch.as_tensor(np.asarray(st))
    return t.to(torch.uint8).contiguous()


def _set_cuda(states: list) -> None:
    if not torch.cuda.is_available():
        log.warning("the checkpoint holds %d CUDA RNG state(s) but CUDA is not available here: not restored",
                    len(states))
        return
    n = torch.cuda.device_count()
    if n != len(states):
        log.warning("the checkpoint holds %d CUDA RNG state(s), this process sees %d device(s): restoring the "
                    "first %d", len(states), n, min(n, len(states)))
    for i, st in enumerate(states[:n]):
        torch.cuda.set_rng_state(_as_byte_tensor(st), device=i)
