"""``h.wait(durability="remote", progress=True)`` shows the upload as the CLI shows its long work:
lines on stderr that end at 100 %, nothing without the flag, and the same result either way."""
import re

import pytest
import torch

pytestmark = pytest.mark.timeout(180)


def test_a_remote_wait_shows_the_upload_and_ends_at_100_percent(engine_factory, capsys):
    eng = engine_factory(critical_writers=1, best_effort_writers=0)
    state = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB
    eng.register("policy", lambda: state)
    capsys.readouterr()
    res = eng.save(1).wait(timeout=120, durability="remote", progress=True)
    err = capsys.readouterr().err
    lines = [ln.strip("\r ") for ln in err.replace("\r", "\n").splitlines() if "upload" in ln]
    assert res.version == 1 and res.durability == "remote", res
    assert lines, err
    assert re.match(r"^step 1 upload: 12\.\d MiB / 12\.\d MiB \(100%\)", lines[-1]), lines
    res2 = eng.save(2).wait(timeout=120, durability="remote")  # no flag: nothing on stderr
    assert res2.durability == "remote" and "upload:" not in capsys.readouterr().err
