"""The RLlib internals the integration relies on (all listed in ray_ckpt/integrations/rllib/base/_rllib_internals.py)
still exist on the installed RLlib / gymnasium: an upgrade that moves one fails here, naming it. No Ray needed."""
import io
import tokenize
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")

from ray_ckpt.integrations.rllib.base import _rllib_internals as internals  # noqa: E402
from ray_ckpt.integrations.rllib.base.conversion import _decode_npy_b64, _encode_npy_b64  # noqa: E402

PACKAGE = Path(internals.__file__).parent  # rllib/base/


def test_every_rllib_internal_still_exists():
    missing = internals.missing_internals()
    assert not missing, ("RLlib / gymnasium moved internals ray_ckpt relies on -- update "
                         "ray_ckpt/integrations/rllib/base/_rllib_internals.py:\n  " + "\n  ".join(missing))


def test_a_moved_internal_is_named(monkeypatch):
    fake = (internals.Internal("ray.rllib.env.env_runner_group:EnvRunnerGroup", "_moved_manager", "instance", "w"),
            internals.Internal("ray.rllib.utils.actor_manager:FaultTolerantActorManager", "gone", "method", "x"),
            internals.Internal("gymnasium.core:Env", "_gone_rng", "class", "y"),
            internals.Internal("ray.rllib.no_such_module:Thing", "attr", "class", "z"),
            internals.Internal("ray.rllib.utils.filter:RunningStat", "no_such_key", "state_keys", "k"))
    monkeypatch.setattr(internals, "INTERNALS", internals.INTERNALS + fake)
    missing = internals.missing_internals()
    assert len(missing) == len(fake), missing
    for item, line in zip(fake, missing):
        assert repr(item.attribute) in line and item.owner in line, line
    assert "ModuleNotFoundError" in missing[3]


def test_running_stat_strings_are_what_the_conversion_decodes():
    from ray.rllib.utils.filter import RunningStat
    from ray.rllib.utils.serialization import _serialize_ndarray

    rs = RunningStat(shape=(3,))
    rs.push(np.array([1.0, -2.0, 0.5]))
    rs.push(np.array([3.0, 4.0, -0.25]))
    state = rs.to_state()
    assert internals.RUNNING_STAT_MARKER in state
    for key in internals.RUNNING_STAT_ARRAYS:
        arr = _decode_npy_b64(state[key])
        assert arr is not None, key
        assert np.array_equal(arr, getattr(rs, key)), key
        assert _encode_npy_b64(arr) == state[key] == _serialize_ndarray(getattr(rs, key)), key


def _code_names(path: Path) -> set:
    """The identifiers a module's code uses (strings and comments left out)."""
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in toks if t.type == tokenize.NAME}


def test_only_the_internals_module_touches_rllib_internals():
    private = {i.attribute for i in internals.INTERNALS if i.attribute.startswith("_")} | {"_weights_seq_no"}
    for path in sorted([*PACKAGE.glob("*.py"), *PACKAGE.parent.glob("*.py")]):  # base/ and the modules over it
        if path.name == "_rllib_internals.py":
            continue
        used = _code_names(path) & private
        assert not used, f"{path.name} reads RLlib internals {sorted(used)}: go through _rllib_internals"
