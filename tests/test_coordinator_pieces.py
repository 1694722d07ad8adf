"""The coordinator's Ray-free pieces, without Ray: the rank_timeout_s rule (rank_deadline.py) and
what a starting coordinator rebuilds and cleans from storage (recovery.py)."""
import json

import pytest

import ray_ckpt as rc

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


def _committed_version(local, v, created_at):
    from ray_ckpt.formats.manifest import Manifest, StateEntry
    from ray_ckpt.formats.tree import flatten
    from ray_ckpt.storage.checkpoint_io import write_flat, write_manifest

    files = write_flat(local, v, "policy", 0, flatten({"w": [float(v)]}))
    write_manifest(local, Manifest("r", v, v, created_at, {"policy": StateEntry(
        "critical", "stored", {"0": files}, sum(f.size for f in files))}))


def test_versions_lost_with_a_node_stay_unlisted_after_a_restart_and_in_ray_ckpt_ls(tmp_path, capsys):
    """A version whose files died with a node is recorded lost (storage/lost.py): a restarting
    coordinator does not list it (its manifest still lies on this disk), keeps its number reserved
    and says why; ``ray-ckpt ls`` marks it lost. The same number written again later (another
    manifest) is listed."""
    from ray_ckpt.cli.main import main as cli
    from ray_ckpt.storage.lost import LostVersion, read_lost, record_lost

    cfg = EngineConfig(run="r", local_dir=str(tmp_path))
    local = cfg.local_tier()
    for v in (1, 2, 3):
        _committed_version(local, v, 100.0 + v)
    record_lost(local, {2: LostVersion("lost with node abc: 1 critical file(s) ...", 102.0)})
    record_lost(local, {3: LostVersion("lost with node def: ...", 999.0)})  # another manifest of number 3
    assert sorted(read_lost(local)) == [2, 3]  # records add up
    found = recover(cfg, local, None)
    assert sorted(found.catalogue.committed) == [1, 3]
    assert found.skipped == {2: "lost with node abc: 1 critical file(s) ..."}
    assert found.catalogue.reserved_through == 2
    with pytest.raises(rc.SaveError, match="step 2 .* not trusted .*lost with node abc"):
        found.catalogue.begin(2, 2, [])
    assert cli(["ls", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[1:] if line[:1].isdigit()}
    assert rows["2"].split()[-1] == "lost" and rows["1"].split()[-1] == "complete" and rows["3"].split()[-1] == "complete"
    assert "lost with node abc" in out
    # gc counts it as no checkpoint: --keep-last 2 keeps 1 and 3 (not the lost 2), and deletes 2's leftovers
    assert cli(["gc", str(tmp_path / "r"), "--keep-last", "2", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kept"] == [1, 3] and [(d["version"], d["kind"]) for d in plan["deleted"]] == [(2, "lost")], plan
    (tmp_path / "r" / "lost_versions.json").write_text("not json")  # garbage hides nothing
    assert sorted(recover(cfg, local, None).catalogue.committed) == [1, 2, 3]
