"""Messages name a version by its step, the public id, and by its directory's number as well only
where the two differ (runs written before every version was numbered by its step). Without Ray."""
import re

import pytest

import ray_ckpt as rc
from ray_ckpt.capture.providers import Registration
from ray_ckpt.client import restore as stages
from ray_ckpt.formats.manifest import Manifest, StateEntry
from ray_ckpt.storage import sharded_io
from ray_ckpt.types import step_label

OLD = Manifest("r", 7, 70, 0.0)  # version 7 of a run whose versions were not numbered by their steps
NEW = Manifest("r", 4, 4, 0.0)


def test_a_restore_report_names_its_step():
    assert str(rc.RestoreReport(NEW.version, NEW.step, {}, 0.5)) == "restored step 4 in 0.500s"
    assert str(rc.RestoreReport(OLD.version, OLD.step, {}, 0.5)) == "restored step 70 (version 7) in 0.500s"


@pytest.mark.parametrize("m, named", [(NEW, "step 4"), (OLD, "step 70 (version 7)")])
def test_restore_and_load_errors_name_the_step(m, named):
    reg = Registration("policy", None, rc.Strategy.CRITICAL)
    report = stages.plan(m, {"policy": reg}, ["policy"]).reports["policy"]
    assert (report.status, report.detail) == ("missing", f"{named} has no state 'policy'")
    two_ranks = StateEntry("critical", "stored", files={"0": [], "1": []})
    with pytest.raises(rc.RestoreError, match=f"^state 'policy' of {re.escape(named)} was saved by 2 ranks; "
                                              f"it cannot be restored with world size 3"):
        sharded_io.check_world_size(two_ranks, "policy", step_label(m.step, m.version), 3)
