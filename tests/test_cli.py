"""The ``ray-ckpt`` command line against one real checkpoint set written by the engine.

One module-scoped run (steps 1..4: a policy, an Adam optimizer keyed by int, a constant RELOADABLE
"reference" stored once in v1, a RELOADABLE "critic_ref" stored in v1 and changed at step 3 (so
stored again in v3), and a "stats" state with a numpy array and an Arrow table) is written
with a real engine on a local and a file:// remote tier, then inspected with ``ray-ckpt`` both
in-process (``main([...])``) and as a subprocess (``python -m ray_ckpt.cli``). Tests that change
files work on a copy of the run.
"""
import collections
import copy
import json
import os
import shutil
import subprocess
import sys
import uuid
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

from ray_ckpt.cli import main

LR = 0.01
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(ray_session, tmp_path_factory):
    import ray_ckpt as rc

    base = tmp_path_factory.mktemp("cli")
    run = f"cli{uuid.uuid4().hex[:8]}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(collections.OrderedDict(fc=torch.nn.Linear(8, 4), out=torch.nn.Linear(4, 2)))
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    reference = {"w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "tag": "frozen", "scale": 0.5}
    stats = {"mean": np.zeros(4, np.float32), "count": 0,
             "table": pa.table({"a": [1, 2, 3], "b": [0.5, 1.5, 2.5]})}
    critic = {"ref": {"w": torch.ones(2, 2)}}
    replay = {"obs": np.arange(40, dtype=np.float32).reshape(10, 4), "done": np.arange(10) % 3 == 0}
    # one version at a time, no best-effort state: one critical writer, no best-effort pool
    eng = rc.CheckpointEngine.create(run, local_dir=str(base / "local"), remote_uri=f"file://{base / 'remote'}",
                                     critical_writers=1, best_effort_writers=0)
    try:
        eng.register("policy", lambda: model.state_dict(), loader=model.load_state_dict)
        eng.register("optimizer", lambda: opt.state_dict(), loader=opt.load_state_dict)
        eng.register("reference", lambda: reference, strategy=rc.Strategy.RELOADABLE, loader=lambda s: None)
        eng.register("critic_ref", lambda: critic["ref"], strategy=rc.Strategy.RELOADABLE, loader=lambda s: None)
        eng.register("stats", lambda: stats, loader=lambda s: None)
        eng.register("replay", lambda: replay, loader=lambda s: None)  # a buffer: one Arrow file
        for step in range(1, 5):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            stats["mean"] = stats["mean"] + step
            stats["count"] = step
            if step == 3:
                critic["ref"] = {"w": torch.full((2, 2), 3.0)}
            h = eng.save(step)
            h.wait(timeout=60)
            h.wait(timeout=60, durability="remote")
    finally:
        eng.shutdown()
    return SimpleNamespace(
        run=run,
        local=str(base / "local" / run),
        remote_uri=f"file://{base / 'remote' / run}",
        policy={k: v.detach().clone() for k, v in model.state_dict().items()},
        optimizer=copy.deepcopy(opt.state_dict()),
        reference=reference,
        stats=copy.deepcopy(stats),
        replay=replay,
    )


# ---------------------------------------------------------------------------- helpers
def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def cli_proc(*args, env=None):
    r = subprocess.run([sys.executable, "-m", "ray_ckpt.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=180, cwd=str(REPO), env=env)
    return r.returncode, r.stdout, r.stderr


def assert_one_line_error(err, code):
    assert code != 0
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ray-ckpt: error: "), err


@pytest.fixture
def run_copy(ckpt, tmp_path):
    """A private copy of the local run root, for tests that change files."""
    dst = tmp_path / ckpt.run
    shutil.copytree(ckpt.local, dst)
    return dst


def tree_files(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.read_bytes())
                  for p in Path(root).rglob("*") if p.is_file())


def flip_byte(path, offset=-1):
    b = bytearray(Path(path).read_bytes())
    b[offset] ^= 0xFF
    Path(path).write_bytes(bytes(b))


V = "v{:012d}".format


# ---------------------------------------------------------------------------- ls
def test_ls_lists_versions(ckpt, capsys):
    code, out, err = cli(capsys, "ls", ckpt.local)
    assert code == 0 and err == ""
    lines = out.strip().splitlines()
    assert lines[0].split()[:6] == ["VERSION", "STEP", "CREATED", "SIZE", "STATES", "STATUS"]
    rows = [ln.split() for ln in lines[1:]]
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    assert all(r[-1] == "complete" for r in rows)
    assert all(r[-2] == "critic_ref,optimizer,policy,reference,replay,stats" for r in rows)

    code, out, _ = cli(capsys, "ls", ckpt.local, "--json")
    assert code == 0
    doc = json.loads(out)
    vs = doc["versions"]
    assert [v["version"] for v in vs] == [1, 2, 3, 4] and [v["step"] for v in vs] == [1, 2, 3, 4]
    for v in vs:
        assert v["status"] == "complete" and v["committed"]
        assert v["states"] == {n: "stored" for n in ("critic_ref", "optimizer", "policy", "reference", "replay", "stats")}
        assert v["bytes"] > 0
        datetime.fromisoformat(v["created"])


def test_ls_remote_file_uri_as_subprocess(ckpt):
    code, out, err = cli_proc("ls", ckpt.remote_uri)
    assert code == 0, err
    assert "Traceback" not in err
    rows = [ln.split() for ln in out.strip().splitlines()[1:]]
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    assert {r[-1] for r in rows} == {"complete"}


def test_ls_marks_partial_versions(run_copy, capsys):
    (run_copy / V(2) / "manifest.json").unlink()  # a save that never committed
    (run_copy / V(9) / "policy").mkdir(parents=True)  # one still being written
    (run_copy / V(9) / "policy" / "rank0.safetensors.tmp-abc").write_bytes(b"x" * 10)
    code, out, _ = cli(capsys, "ls", run_copy, "--json")
    assert code == 0
    status = {v["version"]: v["status"] for v in json.loads(out)["versions"]}
    assert status == {1: "complete", 2: "partial", 3: "complete", 4: "complete", 9: "partial"}
    code, out, _ = cli(capsys, "ls", run_copy)
    assert code == 0
    assert "gc --partial" in out and "being written" in out


# ---------------------------------------------------------------------------- show
def test_show_lists_states_files_and_dtypes(ckpt, capsys):
    code, out, err = cli(capsys, "show", ckpt.local, "latest")
    assert code == 0 and err == ""
    assert "version 4" in out and "step 4" in out
    for name in ("policy", "optimizer", "reference", "critic_ref", "stats", "replay"):
        assert f"state {name}" in out
    assert "strategy=critical" in out and "strategy=reloadable" in out and "status=stored" in out
    assert "fc.weight" in out and "float32" in out and "[4, 8]" in out
    assert "state/0/exp_avg" in out
    assert "bfloat16" in out and "[3, 4]" in out
    assert f"{V(1)}/reference/rank0.safetensors" in out  # stored once, referenced by v4
    assert "arrow table" in out

    code, out, _ = cli(capsys, "show", ckpt.local, V(4), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["version"] == 4 and doc["status"] == "complete"
    pol = doc["states"]["policy"]
    (f,) = pol["ranks"]["0"]
    assert f["path"] == f"{V(4)}/policy/rank0.safetensors" and len(f["checksum"]) == 32
    assert f["bytes"] == (Path(ckpt.local) / f["path"]).stat().st_size
    leaves = {x["name"]: x for x in f["tensors"]["leaves"]}
    assert set(leaves) == set(ckpt.policy)
    for k, t in ckpt.policy.items():
        assert leaves[k]["dtype"] == "float32" and leaves[k]["shape"] == list(t.shape)
    ref = doc["states"]["reference"]
    assert ref["strategy"] == "reloadable" and ref["ranks"]["0"][0]["path"].startswith(V(1) + "/")
    stats_files = doc["states"]["stats"]["ranks"]["0"]
    assert [x["role"] for x in stats_files] == ["tensors", "table"]
    assert [c["name"] for c in stats_files[1]["table"]["columns"]] == ["a", "b"]

    (buf,) = doc["states"]["replay"]["ranks"]["0"]
    assert buf["role"] == "buffer" and buf["path"] == f"{V(4)}/replay/rank0.arrow"
    assert [c["name"] for c in buf["table"]["columns"]] == ["obs", "done"]

    # the same version by number, and by default (the latest)
    code, out2, _ = cli(capsys, "show", ckpt.local, "4", "--json")
    assert code == 0 and json.loads(out2) == doc
    code, out3, _ = cli(capsys, "show", ckpt.local, "--json")
    assert code == 0 and json.loads(out3) == doc


# ---------------------------------------------------------------------------- verify
def test_verify_ok(ckpt, capsys):
    code, out, err = cli(capsys, "verify", ckpt.local)
    assert code == 0, err
    assert "version 4 (step 4): OK" in out and out.strip().splitlines()[-1].startswith("OK:")
    code, out, _ = cli(capsys, "verify", ckpt.local, "--all")
    assert code == 0
    assert all(f"version {v} (step {v}): OK" in out for v in range(1, 5))
    code, out, err = cli(capsys, "verify", ckpt.remote_uri, "2", "--progress")
    assert code == 0
    assert "version 2 (step 2): OK" in out
    assert "verify:" in err and "(100%)" in err  # the progress indicator


def test_verify_detects_corruption(ckpt, run_copy, capsys):
    policy = f"{V(4)}/policy/rank0.safetensors"
    flip_byte(run_copy / policy)
    code, out, err = cli_proc("verify", run_copy)
    assert code == 1
    assert_one_line_error(err, code)
    assert "CORRUPT" in out and policy in out
    assert "optimizer/rank0" not in out  # only the bad file is listed

    # a missing file and a corrupt shared file (stored in v1, referenced by v4) are named too
    (run_copy / V(4) / "optimizer" / "rank0.safetensors").unlink()
    flip_byte(run_copy / V(1) / "reference" / "rank0.safetensors")
    code, out, err = cli(capsys, "verify", run_copy, "4")
    assert code == 1
    assert_one_line_error(err, code)
    assert "MISSING" in out and f"{V(4)}/optimizer/rank0.safetensors" in out
    assert f"{V(1)}/reference/rank0.safetensors" in out
    # older versions share the corrupt reference file, and only that file is bad in them
    code, out, _ = cli(capsys, "verify", run_copy, "--all")
    assert code == 1 and "version 2 (step 2): FAILED, 1 of 7 files bad" in out


def test_verify_reads_a_large_file_by_blocks_and_finds_a_flip_in_any(tmp_path, capsys):
    """A file of several checksum blocks is verified by threads reading blocks in parallel: OK when
    intact (progress reaches 100 %), CORRUPT for one flipped byte in its third block."""
    from ray_ckpt.storage.checkpoint_io import write_flat, write_manifest
    from ray_ckpt.formats.checksum import BLOCK
    from ray_ckpt.formats.manifest import Manifest, StateEntry
    from ray_ckpt.formats.tree import flatten
    from ray_ckpt.storage.tier import Tier

    tier = Tier(str(tmp_path / "big"), "local")
    state = {"w": torch.randint(0, 255, (2 * BLOCK + 12345,), dtype=torch.uint8)}
    files = write_flat(tier, 1, "policy", 0, flatten(state))
    write_manifest(tier, Manifest("big", 1, 1, 0.0, {"policy": StateEntry(
        "critical", "stored", {"0": files}, sum(f.size for f in files))}))
    code, out, err = cli(capsys, "verify", tmp_path / "big", "--progress")
    assert code == 0, err
    assert "version 1 (step 1): OK" in out and "(100%)" in err
    with open(tmp_path / "big" / files[0].path, "r+b") as f:
        f.seek(2 * BLOCK + 100)
        b = f.read(1)
        f.seek(2 * BLOCK + 100)
        f.write(bytes([b[0] ^ 1]))
    code, out, _ = cli(capsys, "verify", tmp_path / "big")
    assert code == 1 and "CORRUPT" in out and files[0].path in out


# ---------------------------------------------------------------------------- gc
def test_gc_dry_run_deletes_nothing(run_copy, capsys):
    before = tree_files(run_copy)
    code, out, _ = cli(capsys, "gc", run_copy, "--keep-last", "1", "--dry-run")
    assert code == 0
    assert "would delete version 1" in out and "would delete version 3" in out
    assert "would delete version 4" not in out
    assert tree_files(run_copy) == before


def test_gc_keep_last_keeps_newest_and_shared_reference(ckpt, run_copy, capsys):
    code, out, err = cli(capsys, "gc", run_copy, "--keep-last", "1")
    assert code == 0, err
    assert "deleted version 1" in out and "deleted version 2" in out and "deleted version 3" in out
    assert (run_copy / V(4) / "manifest.json").exists()
    for v in (1, 2, 3):
        assert not (run_copy / V(v) / "manifest.json").exists()
    # the reference state lives in v1's directory (critic_ref in v3's) and the kept v4 refers to it
    assert (run_copy / V(1) / "reference" / "rank0.safetensors").exists()
    assert (run_copy / V(3) / "critic_ref" / "rank0.safetensors").exists()
    assert not (run_copy / V(1) / "policy").exists() and not (run_copy / V(3) / "policy").exists()
    assert not (run_copy / V(2)).exists()

    code, out, _ = cli(capsys, "verify", run_copy)
    assert code == 0 and "version 4 (step 4): OK" in out
    code, out, _ = cli(capsys, "ls", run_copy, "--json")
    status = {v["version"]: v["status"] for v in json.loads(out)["versions"]}
    assert status == {1: "retired", 3: "retired", 4: "complete"}

    # idempotent, and --partial never removes files a kept version refers to
    code, out, _ = cli(capsys, "gc", run_copy, "--keep-last", "1", "--partial")
    assert code == 0 and "deleted 0 versions" in out
    assert (run_copy / V(1) / "reference" / "rank0.safetensors").exists()
    code, _, _ = cli(capsys, "export", run_copy, "latest", "--state", "reference", "--to", run_copy.parent / "x")
    assert code == 0


def test_gc_deletes_shared_files_once_no_kept_version_refers_to_them(run_copy, capsys):
    critic_v1 = run_copy / V(1) / "critic_ref" / "rank0.safetensors"  # referenced by v1, v2
    critic_v3 = run_copy / V(3) / "critic_ref" / "rank0.safetensors"  # referenced by v3, v4
    reference = run_copy / V(1) / "reference" / "rank0.safetensors"  # referenced by v1..v4
    assert critic_v1.exists() and critic_v3.exists() and not (run_copy / V(2) / "critic_ref").exists()
    code, out, _ = cli(capsys, "gc", run_copy, "--keep-last", "3")  # v1 goes; v2 still needs its files
    assert code == 0 and critic_v1.exists() and reference.exists()
    code, out, _ = cli(capsys, "gc", run_copy, "--keep-last", "2")  # v2 goes: v1's critic_ref is unused now
    assert code == 0, out
    assert not critic_v1.exists() and reference.exists() and critic_v3.exists()
    assert "shared files of deleted versions" in out
    code, out, _ = cli(capsys, "gc", run_copy, "--keep-last", "1")  # v3 goes; its critic_ref stays for v4
    assert code == 0 and critic_v3.exists() and reference.exists()
    assert not (run_copy / V(3) / "policy").exists()
    code, out, _ = cli(capsys, "verify", run_copy, "--all")
    assert code == 0 and "version 4 (step 4): OK, 7 files" in out


def test_gc_keep_every(run_copy, capsys):
    code, out, _ = cli(capsys, "gc", run_copy, "--keep-last", "1", "--keep-every", "2")
    assert code == 0
    kept = sorted(p.parent.name for p in run_copy.glob("v*/manifest.json"))
    assert kept == [V(2), V(4)]


def test_gc_partial_only_with_flag_and_never_in_flight(run_copy, capsys):
    (run_copy / V(2) / "manifest.json").unlink()  # an abandoned save, older than the newest
    (run_copy / V(9) / "policy").mkdir(parents=True)  # in flight: newer than the newest commit
    (run_copy / V(9) / "policy" / "rank0.safetensors").write_bytes(b"in flight")
    code, out, err = cli(capsys, "gc", run_copy, "--keep-last", "10")
    assert code == 0
    assert (run_copy / V(2) / "policy" / "rank0.safetensors").exists()
    assert "--partial" in out and V(9) in err
    code, out, _ = cli(capsys, "gc", run_copy, "--keep-last", "10", "--partial")
    assert code == 0
    assert not (run_copy / V(2)).exists()
    assert (run_copy / V(9) / "policy" / "rank0.safetensors").exists()
    assert sorted(p.parent.name for p in run_copy.glob("v*/manifest.json")) == [V(1), V(3), V(4)]


# ---------------------------------------------------------------------------- export
def test_export_policy_loads_with_safetensors(ckpt, tmp_path, capsys):
    from safetensors.torch import load_file

    out_dir = tmp_path / "export"
    code, out, err = cli(capsys, "export", ckpt.local, "latest", "--state", "policy", "--to", out_dir)
    assert code == 0, err
    tensors = load_file(str(out_dir / "policy.safetensors"))
    assert set(tensors) == set(ckpt.policy)
    for k, t in ckpt.policy.items():
        assert tensors[k].dtype == t.dtype and torch.equal(tensors[k], t)
    doc = json.loads((out_dir / "policy.json").read_text())
    assert doc["version"] == 4 and doc["state"] == "policy"
    assert doc["tree"]["fc.weight"] == {"tensor": "fc.weight", "dtype": "float32", "shape": [4, 8]}

    # refuses to overwrite without --force
    code, _, err = cli(capsys, "export", ckpt.local, "latest", "--state", "policy", "--to", out_dir)
    assert_one_line_error(err, code)
    assert "--force" in err
    code, _, _ = cli(capsys, "export", ckpt.local, "latest", "--state", "policy", "--to", out_dir, "--force")
    assert code == 0


def test_export_defaults_to_the_latest_version_and_takes_buffers(ckpt, tmp_path, capsys):
    from safetensors.numpy import load_file

    code, out, err = cli(capsys, "export", ckpt.local, "--state", "replay", "--to", tmp_path)
    assert code == 0, err
    assert "version 4" in out
    arrays = load_file(str(tmp_path / "replay.safetensors"))
    assert np.array_equal(arrays["obs"], ckpt.replay["obs"]) and np.array_equal(arrays["done"], ckpt.replay["done"])


def test_export_optimizer_is_exact(ckpt, tmp_path, capsys):
    from safetensors.torch import load_file

    from ray_ckpt.formats.tree import unflatten

    code, _, err = cli(capsys, "export", ckpt.local, "4", "--state", "optimizer", "--to", tmp_path)
    assert code == 0, err
    tensors = load_file(str(tmp_path / "optimizer.safetensors"))
    doc = json.loads((tmp_path / "optimizer.json").read_text())
    want = ckpt.optimizer
    assert torch.equal(tensors["state/0/exp_avg"], want["state"][0]["exp_avg"])
    assert torch.equal(tensors["state/3/exp_avg_sq"], want["state"][3]["exp_avg_sq"])
    assert doc["tree"]["param_groups"][0]["lr"] == LR
    # the exact structure rebuilds the optimizer state with int keys and tuples
    arrays = [bytearray(tensors[n].reshape(-1).view(torch.uint8).numpy().tobytes()) for n in doc["leaves"]]
    back = unflatten(doc["structure"], arrays, [])
    assert sorted(back["state"]) == [0, 1, 2, 3]
    assert back["param_groups"] == want["param_groups"]
    for i, st in want["state"].items():
        for k, t in st.items():
            assert torch.equal(back["state"][i][k], t)


def test_export_numpy_table_and_shared_reference(ckpt, tmp_path, capsys):
    from safetensors.torch import load_file

    code, _, err = cli(capsys, "export", ckpt.remote_uri, "4", "--state", "stats", "--to", tmp_path)
    assert code == 0, err
    doc = json.loads((tmp_path / "stats.json").read_text())
    assert doc["tree"]["count"] == 4
    assert doc["tree"]["mean"]["numpy"] == "mean"
    np.testing.assert_array_equal(load_file(str(tmp_path / "stats.safetensors"))["mean"].numpy(), ckpt.stats["mean"])
    table_file = tmp_path / doc["tree"]["table"]["arrow_table"]
    assert pa.ipc.open_file(str(table_file)).read_all().equals(ckpt.stats["table"])

    code, _, err = cli(capsys, "export", ckpt.local, "2", "--state", "reference", "--to", tmp_path)
    assert code == 0, err
    w = load_file(str(tmp_path / "reference.safetensors"))["w"]
    assert w.dtype == torch.bfloat16 and torch.equal(w, ckpt.reference["w"])
    tree = json.loads((tmp_path / "reference.json").read_text())["tree"]
    assert tree["tag"] == "frozen" and tree["scale"] == 0.5


def test_export_verifies_before_writing(run_copy, tmp_path, capsys):
    flip_byte(run_copy / V(4) / "policy" / "rank0.safetensors")
    out_dir = tmp_path / "out"
    code, _, err = cli(capsys, "export", run_copy, "4", "--state", "policy", "--to", out_dir)
    assert_one_line_error(err, code)
    assert code == 1 and "checksum" in err
    assert not out_dir.exists() or not any(out_dir.iterdir())


# ---------------------------------------------------------------------------- errors
ERROR_CASES = [
    (["ls", "{tmp}/does-not-exist"], 1, "no such directory"),
    (["show", "{local}", "99"], 1, "version 99 not found"),
    (["show", "{local}", "abc"], 2, "invalid VERSION"),
    (["verify", "{local}", "7"], 1, "not found"),
    (["verify", "{local}", "3", "--all"], 2, "not allowed"),
    (["frobnicate"], 2, "invalid choice"),
    ([], 2, "required"),
    (["gc", "{local}"], 2, "--keep-last"),
    (["gc", "{local}", "--keep-last", "0"], 2, "positive integer"),
    (["export", "{local}", "latest", "--state", "nope", "--to", "{tmp}/o"], 1, "has no state 'nope'"),
    (["export", "{local}", "latest", "--state", "policy", "--to", "{tmp}/o", "--rank", "3"], 1, "rank 3"),
    (["export", "{local}", "latest", "--state", "../x", "--to", "{tmp}/o"], 2, "invalid state name"),
    (["ls", "{local}/v000000000004/manifest.json"], 1, "is a file"),
    (["ls", "{parent}"], 1, "did you mean"),
    (["ls", "s3://"], 1, ""),
    (["ls", "{local}", "--endpoint-override", "localhost:9000"], 2, "s3://"),
]


@pytest.mark.parametrize("argv,want_code,want_text", ERROR_CASES, ids=[" ".join(c[0])[:40] for c in ERROR_CASES])
def test_errors_are_one_line(ckpt, tmp_path, capsys, argv, want_code, want_text):
    args = [a.format(local=ckpt.local, tmp=tmp_path, parent=str(Path(ckpt.local).parent)) for a in argv]
    code, _, err = cli(capsys, *args)
    assert_one_line_error(err, code)
    assert code == want_code
    assert want_text in err


def test_errors_in_a_subprocess_have_no_traceback(ckpt, tmp_path):
    code, out, err = cli_proc("ls", tmp_path / "nope")
    assert_one_line_error(err, code)
    assert code == 1 and out == ""
    code, out, err = cli_proc("show", ckpt.local, "12345")
    assert_one_line_error(err, code)
    assert code == 1 and "12345" in err


def test_unreadable_manifest(run_copy, capsys):
    (run_copy / V(4) / "manifest.json").write_text("{not json")
    code, _, err = cli(capsys, "show", run_copy, "4")
    assert_one_line_error(err, code)
    assert "unreadable manifest" in err
    code, out, _ = cli(capsys, "ls", run_copy, "--json")
    assert code == 0
    assert {v["version"]: v["status"] for v in json.loads(out)["versions"]}[4] == "unreadable"
    code, out, err = cli(capsys, "verify", run_copy, "--all")
    assert code == 1 and "BAD MANIFEST" in out
    # gc leaves a version it cannot read alone
    code, out, err = cli(capsys, "gc", run_copy, "--keep-last", "1")
    assert code == 0 and "leaving" in err
    assert (run_copy / V(4) / "manifest.json").exists() and (run_copy / V(3) / "manifest.json").exists()
    assert not (run_copy / V(2) / "manifest.json").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads everything")
def test_permission_denied_is_one_line(run_copy, capsys):
    os.chmod(run_copy, 0)
    try:
        code, _, err = cli(capsys, "ls", run_copy)
    finally:
        os.chmod(run_copy, 0o755)
    assert_one_line_error(err, code)


def test_help_lists_commands(capsys):
    code, out, _ = cli(capsys, "--help")
    assert code == 0
    for c in ("ls", "show", "verify", "gc", "export", "migrate", "demo"):
        assert c in out


# ---------------------------------------------------------------------------- S3
def test_s3_uri(ckpt, tmp_path, capsys, monkeypatch):
    """ls / show / verify / gc / export on s3:// against a real S3-compatible server."""
    try:
        from s3server import S3Server, weed_binary

        weed_binary()
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"no S3 test server: {exc}")
    from ray_ckpt.storage.tier import Tier

    srv = S3Server(str(tmp_path / "s3")).start()
    try:
        src = Tier(ckpt.local)
        dst = Tier(srv.uri(f"runs/{ckpt.run}"), "remote", srv.options)
        for rel in src.list_files(""):
            src.copy_to(dst, rel)
        uri = srv.uri(f"runs/{ckpt.run}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", srv.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", srv.secret_key)
        monkeypatch.setenv("AWS_REGION", "us-east-1")
        ep = ["--endpoint-override", srv.endpoint_url]
        code, out, err = cli(capsys, "ls", uri, *ep)
        assert code == 0, err
        assert [ln.split()[0] for ln in out.strip().splitlines()[1:]] == ["1", "2", "3", "4"]
        code, out, err = cli(capsys, "show", uri, "latest", "--s3-endpoint", srv.endpoint)
        assert code == 0 and "fc.weight" in out
        code, out, err = cli(capsys, "verify", uri, "--all", *ep)
        assert code == 0, out + err
        code, out, err = cli(capsys, "gc", uri, "--keep-last", "1", *ep)
        assert code == 0, err
        code, out, err = cli(capsys, "verify", uri, *ep)
        assert code == 0, out + err
        code, out, err = cli(capsys, "export", uri, "latest", "--state", "reference", "--to", tmp_path / "x", *ep)
        assert code == 0, err
        code, _, err = cli(capsys, "ls", srv.uri("runs/nothing-here"), *ep)
        assert_one_line_error(err, code)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
        code, _, err = cli(capsys, "ls", uri, *ep)
        assert_one_line_error(err, code)
    finally:
        srv.stop()


def test_command_line_starts_without_ray_or_torch():
    """Reading checkpoints needs neither Ray nor torch: `ray-ckpt ls` must not pay ~2 s to import them."""
    out = subprocess.run([sys.executable, "-c", "import sys, ray_ckpt.cli, ray_ckpt; "
                          "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
