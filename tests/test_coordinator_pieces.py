"""The coordinator's Ray-free pieces, without Ray: the rank_timeout_s rule (rank_deadline.py) and
what a starting coordinator rebuilds and cleans from storage (recovery.py)."""
import json

from ray_ckpt.coordinator.catalogue import Catalogue
from ray_ckpt.config import EngineConfig
from ray_ckpt.coordinator.rank_deadline import expire_missing
from ray_ckpt.coordinator.recovery import DECLARED, recover


def test_a_rank_that_never_pushes_fails_its_version_by_name():
    cat = Catalogue("run")
    cat.declare("policy", "critical", 3)
    cat.accept_push(5, 5, "policy", 1)
    what, fails = expire_missing(cat, 5, 2.0)
    assert fails
    assert what == "ranks did not push within rank_timeout_s=2s: 'policy' rank 0, 'policy' rank 2 (2 of 3 parts)"
    assert cat.pending[5].error == what
    assert expire_missing(cat, 5, 2.0) is None  # nothing missing any more
    assert expire_missing(cat, 6, 2.0) is None  # no such version


def test_a_missing_best_effort_rank_is_reported_but_does_not_fail_the_version():
    cat = Catalogue("run")
    cat.declare("replay", "best_effort", 2)
    cat.accept_push(1, 1, "replay", 0)
    what, fails = expire_missing(cat, 1, 0.5)
    assert not fails and "'replay' rank 1" in what
    assert not cat.pending[1].error


def test_recovery_removes_unfinished_versions_and_reads_back_declarations(tmp_path):
    cfg = EngineConfig(run="r", local_dir=str(tmp_path))
    local = cfg.local_tier()
    local.put_bytes("v000000000007/policy.rank0.tensors.safetensors", b"half written")
    local.put_bytes(DECLARED, json.dumps({"policy": {"strategy": "critical", "world_size": 4}}).encode())
    found = recover(cfg, local, None)
    assert not local.exists("v000000000007/policy.rank0.tensors.safetensors")
    assert found.catalogue.committed == {} and found.skipped == {}
    assert found.catalogue.declared["policy"].world_size == 4
    assert not found.uploads.enabled
