"""The chaos run's short seeded form (benchmarks/chaos.py): a real training loop on a tmpfs local tier
(a temporary directory where this process may not mount one) and the session's S3 server, every
fault kind injected at least once in a seeded order; no acknowledged version may be lost and no
restore may bring back other bytes than were saved."""
import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _chaos_module():
    path = os.path.join(os.path.dirname(HERE), "benchmarks", "chaos.py")
    spec = importlib.util.spec_from_file_location("chaos", path)
    mod = importlib.util.module_from_spec(spec)
    import sys

    sys.modules["chaos"] = mod  # before exec: the module ships its functions to Ray workers by value
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(420)
def test_chaos_short_seeded(ray_session, s3_server, tmp_path):
    chaos = _chaos_module()
    lines = []
    # --every-kind: the run goes on past --minutes (3 s) until every kind was injected once, and ends
    # there; faults follow each other after 0.1-0.3 s (the run waits for each one's recovery and check
    # in between, so the gap is not what lets a fault's effects settle). The time goes to restarting
    # processes (learner ~8 s, coordinator ~6 s, rollout ~4 s, the S3 server ~3 s on 2 cores), hence
    # one rollout actor instead of the benchmark's two (a torch process less to start; the rollout
    # fault still kills it and restores) and outages of 0.5-1 s (saves come every ~0.5 s, so a save
    # or two usually falls inside one)
    status, r = chaos.main(["--minutes", "0.05", "--every-kind", "--seed", "3", "--fault-gap", "0.1", "0.3",
                            "--outage-s", "0.5", "1", "--save-every", "6", "--check-sample", "5",
                            "--rollouts", "1", "--tmpfs-mb", "96", "--dir", str(tmp_path / "chaos")],
                           s3_server=s3_server, log=lines.append)
    out = "\n".join(lines)
    print(out)
    assert s3_server.running()
    assert r["acknowledged"] > 0, out
    assert r["lost"] == 0, out
    assert r["wrong"] == 0, out
    assert r["remote_copies_wrong"] == 0, out
    assert r["restore_failures"] == 0 and r["not_recovered"] == 0 and r["hung_saves"] == 0, out
    kinds = [k for k in chaos.KINDS if k != "disk_full" or r["local_tier"] == "tmpfs"]
    assert all(r["faults"].get(k, 0) >= 1 for k in kinds), out
    assert status == 0, out
