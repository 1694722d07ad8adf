"""The classes that implement ``ray_ckpt.interfaces`` do (no Ray cluster: classes and signatures).

A Protocol's ``isinstance`` checks only that the names exist; these tests also check that every
parameter the interface passes is accepted by name, and that an implementation's extra parameters
have defaults, so a call written against the interface works against the class."""
import inspect

import pytest
import torch

from ray_ckpt.interfaces import CheckpointSeam, StateProvider, Stateful, StorageTier
from ray_ckpt.storage.tier import Tier

import actors


def _mismatches(cls, proto) -> list:
    """What of ``proto``'s methods ``cls`` lacks, or cannot be called with as ``proto`` says."""
    wrong = []
    for name, member in vars(proto).items():
        if name.startswith("_") or not callable(member):
            continue
        impl = getattr(cls, name, None)
        if not callable(impl):
            wrong.append(f"{name}: missing")
            continue
        want = inspect.signature(member).parameters
        have = inspect.signature(impl).parameters
        varkw = any(p.kind is p.VAR_KEYWORD for p in have.values())
        for p in want.values():
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            if p.name not in have and not varkw:
                wrong.append(f"{name}: no parameter {p.name!r}")
            elif p.name in have and p.default is not p.empty and have[p.name].default is p.empty:
                wrong.append(f"{name}: {p.name!r} has no default")
        for p in have.values():
            if p.name not in want and p.name != "self" and p.default is p.empty \
                    and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                wrong.append(f"{name}: extra parameter {p.name!r} without a default")
    return wrong


def test_the_check_finds_a_class_that_does_not_conform():
    class Wrong:
        def ckpt_get_state(self, name, rank):  # an extra required parameter
            return {}

    assert _mismatches(Wrong, StateProvider) == ["ckpt_get_state: extra parameter 'rank' without a default",
                                                 "ckpt_set_state: missing"]


def test_tier_is_a_storage_tier(tmp_path):
    assert issubclass(Tier, StorageTier) and not _mismatches(Tier, StorageTier)
    tier = Tier(f"file://{tmp_path}", "local")  # instantiable: every abstract method is there
    tier.put_bytes("v000000000001/x.bin", b"abc")
    assert tier.list_files("v000000000001") == ["v000000000001/x.bin"] and tier.exists("v000000000001/x.bin")
    with pytest.raises(TypeError, match="abstract"):
        type("Half", (StorageTier,), {"exists": lambda self, rel: True})()


def test_checkpoint_engine_is_the_seam_integrations_call():
    from ray_ckpt.client.engine import CheckpointEngine
    assert not _mismatches(CheckpointEngine, CheckpointSeam)


@pytest.mark.parametrize("cls", [actors.Learner, actors.BigState, actors.Frozen, actors.Replay, actors.Flaky,
                                 actors.Weird, actors.Sampler])
def test_the_suites_actors_are_state_providers(cls):
    assert not _mismatches(cls, StateProvider)


def test_torch_objects_are_stateful():
    from torchdata.stateful_dataloader import StatefulDataLoader

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    for obj in (model, opt, torch.optim.lr_scheduler.StepLR(opt, 2), StatefulDataLoader(list(range(4)))):
        assert isinstance(obj, Stateful), type(obj)
    assert not isinstance(object(), Stateful)


def test_the_seam_names_each_integrations_entry_points():
    """The entry points ``CheckpointSeam``'s docstring names are those of the integrations' classes."""
    doc = CheckpointSeam.__doc__
    pytest.importorskip("ray.rllib")
    from ray_ckpt.integrations.rllib.callback import RayCkptCallback
    entries = {RayCkptCallback: ("on_algorithm_init", "on_train_result", "save", "flush", "close")}
    try:
        from ray_ckpt.integrations.verl.manager import RayCkptCheckpointManager
        entries[RayCkptCheckpointManager] = ("save_checkpoint", "wait_until_finished", "load_checkpoint")
    except ImportError:  # pragma: no cover - verl is installed with the test extras
        pass
    try:
        from ray_ckpt.integrations.openrlhf.strategy import RayCkptDeepspeedStrategy
        entries[RayCkptDeepspeedStrategy] = ("save_ckpt", "wait_until_finished", "load_ckpt")
    except ImportError:  # pragma: no cover
        pass
    from ray_ckpt.integrations.dcp.storage_reader import RayCkptStorageReader
    from ray_ckpt.integrations.dcp.storage_writer import RayCkptStorageWriter
    entries[RayCkptStorageWriter] = ("set_up_storage_writer", "write_data", "finish")
    entries[RayCkptStorageReader] = ("read_metadata", "read_data")
    for cls, names in entries.items():
        assert f"``{cls.__name__}``" in doc or cls.__name__.startswith("RayCkptStorage"), cls
        for name in names:
            assert callable(getattr(cls, name, None)) and f"``{name}``" in doc, (cls.__name__, name)
