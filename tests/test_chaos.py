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
    status, r = chaos.main(["--minutes", "1.5", "--seed", "3", "--fault-gap", "3", "6", "--outage-s", "2", "4",
                            "--tmpfs-mb", "96", "--dir", str(tmp_path / "chaos")],
                           s3_server=s3_server, log=lines.append)
    out = "\n".join(lines)
    print(out)
    assert s3_server.running()
    assert r["acknowledged"] > 0, out
    assert r["lost"] == 0, out
    assert r["wrong"] == 0, out
    assert r["remote_copies_wrong"] == 0, out
    assert r["restore_failures"] == 0 and r["not_recovered"] == 0 and r["hung_saves"] == 0, out
    assert sum(r["faults"].values()) >= 5, out
    assert status == 0, out
