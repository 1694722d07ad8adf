"""Unit (no Ray): ``integrations.committed.UsedSteps``, the rule every framework integration asks
before it pushes a step: a step is never saved twice."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from ray_ckpt.integrations.committed import UsedSteps


def test_steps_committed_after_the_one_a_resume_loaded_are_not_saved_again(caplog):
    """A policy/critic job resumed from step 1, the newest step both roles have (the other role lost
    steps 2 and 3 with a node): this role's committed steps 2 and 3 stay listed, their redo is not
    pushed (the coordinator would refuse it: already committed), with one warning at the load that
    names them; step 4 is pushed. A resume from the newest step changes nothing."""
    engine = SimpleNamespace(last_saved_step=3, skipped_versions=lambda: {}, all_steps=lambda: [1, 2, 3])
    used = UsedSteps("job-critic", logging.getLogger("t"))
    assert used.free(engine, 2)  # before any load: a duplicate the coordinator names itself
    with caplog.at_level(logging.WARNING, logger="t"):
        used.resumed(engine, 1)
    assert "resumed from step 1" in caplog.text and "[2, 3]" in caplog.text
    assert not used.free(engine, 2) and not used.free(engine, 3)
    assert used.free(engine, 4)
    used.resumed(engine, 3)
    assert used.free(engine, 2)  # no committed step after 3: back to the coordinator's own checks


def test_only_rank_0_warns_and_every_rank_decides_alike(caplog):
    """A job of many ranks says it once: rank 0 warns, the others log the same line at debug
    level; each rank still decides alike which steps it pushes."""
    engine = SimpleNamespace(last_saved_step=3, skipped_versions=lambda: {}, all_steps=lambda: [1, 2, 3])
    ranks = [UsedSteps("job-critic", logging.getLogger("t"), rank) for rank in range(4)]
    with caplog.at_level(logging.DEBUG, logger="t"):
        for used in ranks:
            used.resumed(engine, 1)
    levels = [r.levelno for r in caplog.records if "resumed from step 1" in r.getMessage()]
    assert levels == [logging.WARNING] + [logging.DEBUG] * 3, levels
    assert all([used.free(engine, s) for s in (2, 3, 4)] == [False, False, True] for used in ranks)
