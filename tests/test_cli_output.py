"""``ray-ckpt`` output that the engine never writes itself, on runs built by hand (no Ray): names and
text from storage with terminal control characters (shown escaped), URIs with credentials (shown
without them), and ``--json`` on ``verify``, ``gc`` and ``export``."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ray_ckpt.storage.checkpoint_io import write_flat
from ray_ckpt.cli import main
from ray_ckpt.formats.manifest import Manifest, StateEntry
from ray_ckpt.formats.tree import flatten
from ray_ckpt.storage.tier import Tier

REPO = Path(__file__).resolve().parents[1]
V = "v{:012d}".format
ESC = "\x1b"
EVIL_STATE = f"po{ESC}[31mlicy"  # the engine refuses such names; a hand-written manifest may hold one
EVIL_RUN = f"run{ESC}]0;title\x07"


def make_run(root, versions=(1, 2, 3), state="policy", run="hand", detail="", metrics=None):
    """Versions written like the engine writes them, the manifest JSON written here (so it may hold
    names the engine would refuse); the files always lie under ``<version>/policy/``. ``root``: a
    local path, or a Tier."""
    tier = root if isinstance(root, Tier) else Tier(str(root), "local")
    for v in versions:
        value = {"w": np.arange(6, dtype=np.float32) * v, "b": np.zeros(2), "n": v}
        files = write_flat(tier, v, "policy", 0, flatten(value))
        m = Manifest(run, v, v * 10, 1.7e9 + v, {state: StateEntry("critical", "stored", {"0": files},
                                                                   sum(f.size for f in files), detail=detail)},
                     dict(metrics or {}))
        tier.put_bytes(f"{V(v)}/manifest.json", m.to_json())
    return root


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ray-ckpt: error: "), err
    return lines[0]


def flip_byte(path):
    b = bytearray(Path(path).read_bytes())
    b[-1] ^= 0xFF
    Path(path).write_bytes(bytes(b))


# ---------------------------------------------------------------------------- control characters
def test_ls_and_show_escape_control_characters_from_manifests(tmp_path, capsys):
    root = make_run(tmp_path / "r", state=EVIL_STATE, run=EVIL_RUN, detail=f"see {ESC}[2J here",
                    metrics={f"lo{ESC}[1mss": 0.5})
    code, out, err = cli(capsys, "ls", root)
    assert code == 0, err
    assert ESC not in out and "\x07" not in out
    assert "po\\x1b[31mlicy" in out

    code, out, err = cli(capsys, "show", root, "latest")
    assert code == 0, err
    assert ESC not in out and "\x07" not in out
    assert "state po\\x1b[31mlicy  strategy=critical" in out
    assert "detail: see \\x1b[2J here" in out
    assert "lo\\x1b[1mss=0.5" in out
    assert "run 'run\\x1b]0;title\\x07'" in out

    # JSON keeps the exact names, its own escapes keep them off the terminal
    for argv in (["ls", root, "--json"], ["show", root, "--json"]):
        code, out, _ = cli(capsys, *argv)
        assert code == 0 and ESC not in out
        doc = json.loads(out)
        states = doc["versions"][-1]["states"] if argv[0] == "ls" else doc["states"]
        assert list(states) == [EVIL_STATE]


def test_file_paths_and_uris_are_escaped(tmp_path, capsys):
    root = make_run(tmp_path / "r")
    (root / V(1) / "manifest.json").unlink()  # v1: abandoned, older than v3
    evil = root / V(1) / "policy" / f"x{ESC}[2Jy"
    evil.write_bytes(b"leftover")
    code, out, err = cli(capsys, "gc", root, "--keep-last", "5", "--partial", "--dry-run", "-v")
    assert code == 0, err
    assert ESC not in out and f"  {V(1)}/policy/x\\x1b[2Jy" in out

    code, _, err = cli(capsys, "ls", tmp_path / f"no{ESC}[31mpe")
    line = one_line_error(err)
    assert code == 1 and ESC not in err and "no\\x1b[31mpe" in line


# ---------------------------------------------------------------------------- credentials in URIs
def test_errors_do_not_show_credentials_given_in_the_uri(capsys):
    code, _, err = cli(capsys, "ls", "s3://AKIAEXAMPLE:SEKRIT%2Fvalue@bucket/prefix", "--endpoint-override",
                       "127.0.0.1:9")
    line = one_line_error(err)
    assert code == 1 and "SEKRIT" not in line and "AKIAEXAMPLE" not in line and "***@bucket" in line


def test_ls_json_shows_the_uri_without_credentials(tmp_path, capsys):
    try:  # a real S3-compatible server
        from s3server import S3Server, weed_binary

        weed_binary()
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"no S3 test server: {exc}")
    srv = S3Server(str(tmp_path / "s3")).start()
    try:
        make_run(Tier(srv.uri("runs/hand"), "remote", srv.options))
        uri = (f"s3://{srv.access_key}:{srv.secret_key}@{srv.bucket}/runs/hand"
               f"?endpoint_override={srv.endpoint}&scheme=http&region=us-east-1")
        code, out, err = cli(capsys, "ls", uri, "--json")
        assert code == 0, err
        doc = json.loads(out)
        assert [v["version"] for v in doc["versions"]] == [1, 2, 3]
        assert srv.secret_key not in out and doc["uri"].startswith(f"s3://***@{srv.bucket}/runs/hand?")
        code, out, err = cli(capsys, "show", uri, "--json")
        assert code == 0 and srv.secret_key not in out, err
        code, _, err = cli(capsys, "show", uri, "7")
        assert code == 1 and srv.secret_key not in err and "***@" in one_line_error(err)
    finally:
        srv.stop()


# ---------------------------------------------------------------------------- --json
def test_verify_json(tmp_path, capsys):
    root = make_run(tmp_path / "r")
    code, out, err = cli(capsys, "verify", root, "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["ok"] and doc["problems"] == 0 and doc["uri"] == str(root)
    (v,) = doc["versions"]
    assert (v["version"], v["step"], v["status"], v["files"], v["problems"]) == (3, 30, "ok", 1, [])

    flip_byte(root / V(2) / "policy" / "rank0.safetensors")
    (root / V(1) / "policy" / "rank0.safetensors").unlink()
    code, out, err = cli(capsys, "verify", root, "--all", "--json")
    assert code == 1 and "verification failed" in one_line_error(err)
    doc = json.loads(out)
    assert not doc["ok"] and doc["problems"] == 2 and doc["distinct_files"] == 3
    status = {v["version"]: v["status"] for v in doc["versions"]}
    assert status == {1: "failed", 2: "failed", 3: "ok"}
    kinds = {p["kind"]: (p["path"], p["state"], p["rank"]) for v in doc["versions"] for p in v["problems"]}
    assert kinds == {"MISSING": (f"{V(1)}/policy/rank0.safetensors", "policy", "0"),
                     "CORRUPT": (f"{V(2)}/policy/rank0.safetensors", "policy", "0")}

    (root / V(3) / "manifest.json").write_text("{not json")
    code, out, err = cli(capsys, "verify", root, "--all", "--json")
    assert code == 1 and "verification failed: 3 problems" in one_line_error(err)
    v = json.loads(out)["versions"][-1]
    assert v["status"] == "bad_manifest" and "unreadable manifest" in v["error"]
    code, out, err = cli(capsys, "verify", root, "3", "--json")  # nothing verified: an error, no document
    assert code == 1 and out == "" and "unreadable manifest" in one_line_error(err)


def test_gc_json(tmp_path, capsys):
    root = make_run(tmp_path / "r", versions=(1, 2, 3, 4))
    before = sorted(p for p in root.rglob("*") if p.is_file())
    code, out, err = cli(capsys, "gc", root, "--keep-last", "2", "--dry-run", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["dry_run"] and doc["kept"] == [3, 4] and doc["newest"] == 4
    assert [(d["version"], d["kind"]) for d in doc["deleted"]] == [(1, "version"), (2, "version")]
    assert doc["deleted"][0]["files"] == [f"{V(1)}/policy/rank0.safetensors"] and doc["deleted"][0]["bytes"] > 0
    assert doc["versions_deleted"] == 2 and doc["files_deleted"] == 2
    assert sorted(p for p in root.rglob("*") if p.is_file()) == before

    code, out, err = cli(capsys, "gc", root, "--keep-last", "2", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert not doc["dry_run"] and doc["versions_deleted"] == 2
    assert sorted(p.name for p in root.iterdir()) == [V(3), V(4)]

    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, _ = cli(capsys, "gc", empty, "--keep-last", "1", "--json")
    assert code == 0 and json.loads(out)["newest"] is None and json.loads(out)["deleted"] == []


def test_export_json(tmp_path, capsys):
    from safetensors.numpy import load_file

    root = make_run(tmp_path / "r")
    out_dir = tmp_path / "out"
    code, out, err = cli(capsys, "export", root, "2", "--state", "policy", "--to", out_dir, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["version"], doc["step"], doc["state"], doc["rank"], doc["verified"]) == (2, 20, "policy", 0, True)
    assert [f["role"] for f in doc["files"]] == ["tensors", "structure"]
    assert doc["files"][0]["tensors"] == 2
    np.testing.assert_array_equal(load_file(doc["files"][0]["path"])["w"], np.arange(6, dtype=np.float32) * 2)
    assert json.loads(Path(doc["files"][1]["path"]).read_text())["tree"]["n"] == 2


def test_json_flag_is_on_every_command_that_prints_a_result():
    for command in ("ls", "show", "verify", "gc", "export"):
        r = subprocess.run([sys.executable, "-m", "ray_ckpt.cli", command, "--help"], capture_output=True,
                           text=True, timeout=60, cwd=str(REPO))
        assert r.returncode == 0 and "--json" in r.stdout, r.stdout + r.stderr


# ---------------------------------------------------------------------------- signed manifests
def test_verify_with_a_signing_key_refuses_unsigned_and_mis_signed_manifests(tmp_path, capsys, monkeypatch):
    from ray_ckpt.formats.manifest import sign_manifest

    tier = Tier(str(tmp_path / "r"), "local")
    make_run(tier, versions=(1, 2))
    m1 = Manifest.from_json(bytes(tier.read_bytes(f"{V(1)}/manifest.json")))
    tier.put_bytes(f"{V(1)}/manifest.json", sign_manifest(m1, b"secret-key").to_json())
    monkeypatch.setenv("RAY_CKPT_SIGNING_KEY", "secret-key")
    code, out, err = cli(capsys, "verify", tmp_path / "r", "1")
    assert code == 0, err
    code, out, err = cli(capsys, "verify", tmp_path / "r", "2")  # unsigned
    assert code != 0 and "not signed" in err
    monkeypatch.setenv("RAY_CKPT_SIGNING_KEY", "another-key")
    code, out, err = cli(capsys, "verify", tmp_path / "r", "1")
    assert code != 0 and "signature does not verify" in err and "another-key" not in err
    # a rotation in progress: the new key signs, the old one still verifies
    monkeypatch.setenv("RAY_CKPT_VERIFY_KEYS", "older-key,secret-key")
    code, out, err = cli(capsys, "verify", tmp_path / "r", "1")
    assert code == 0, err
    monkeypatch.delenv("RAY_CKPT_SIGNING_KEY")
    code, out, err = cli(capsys, "verify", tmp_path / "r", "1")
    assert code != 0 and "RAY_CKPT_VERIFY_KEYS is set but RAY_CKPT_SIGNING_KEY is not" in err


def test_verify_reports_a_leftover_file_inside_a_committed_version(tmp_path, capsys):
    make_run(tmp_path / "r", versions=(1,))
    leftover = tmp_path / "r" / V(1) / "policy" / "rank0.safetensors.tmp-1a2b3c"
    leftover.write_bytes(b"half a file")
    code, out, err = cli(capsys, "verify", tmp_path / "r", "1")
    assert code == 0 and f"{V(1)}/policy/rank0.safetensors.tmp-1a2b3c is not named by the manifest" in out
    code, out, err = cli(capsys, "verify", tmp_path / "r", "1", "--json")
    notes = json.loads(out)["versions"][0]["notes"]
    assert any("tmp-1a2b3c" in n["note"] for n in notes)
