"""``ray-ckpt migrate``: runs whose RLlib replay buffers were saved in the old two-state form
(``replay`` + ``replay_meta``: formats /1, /4 and /5), written by a real engine with the code of the
time (tests/fixtures/replay_formats: evictions and priority updates between versions, both tiers for
two of them), migrated through the CLI entry point into the journal (``replay_journal``, format /6).
Every version then restores, through the journal, into the buffer the fixture names by its
fingerprint (the buffer that version restored into before the journal); ``verify`` passes on both
tiers; the manifest chain holds and a new engine lists every version; a second migrate and
``--dry-run`` change nothing; the old files are gone. Real RLlib buffers and episodes, real files."""
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")

from replay_compare import fingerprint  # noqa: E402
from test_rllib_replay import _ma_mapping, _make  # noqa: E402

from ray_ckpt.cli import main  # noqa: E402
from ray_ckpt.cli.migrate import restored_buffer  # noqa: E402
from ray_ckpt.formats.manifest import chain_problems  # noqa: E402
from ray_ckpt.integrations.rllib.replay.restore import read_meta, restore_journal  # noqa: E402
from ray_ckpt.storage.checkpoint_io import decode_files, read_files, read_manifest  # noqa: E402
from ray_ckpt.storage.tier import Tier  # noqa: E402

OLD = ("replay", "replay_meta")
FIXTURES = Path(__file__).parent / "fixtures" / "replay_formats"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
# fixture -> (buffer class in test_rllib_replay.BUFFERS, capacity)
CASES = {"prioritized": ("prioritized", 150), "plain": ("plain", 150),
         "multi_agent_prioritized": ("multi_agent_prioritized", 80), "format_1": ("multi_agent_prioritized", 80)}


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def tree(root):
    return sorted((str(p.relative_to(root)), p.read_bytes()) for p in Path(root).rglob("*") if p.is_file())


def _load(tier, v, name):
    m = read_manifest(tier, v)
    files = m.states[name].files["0"]
    bufs, _, _ = read_files([tier], files)
    return decode_files(files, bufs, name=name)


def _fixture(case, tmp_path):
    """The fixture run copied under ``tmp_path/local`` (and ``tmp_path/remote`` where it has one):
    (run name, local dir, remote dir or None, {version: expected})."""
    run = EXPECTED[case]["run"]
    dirs = []
    for tier in ("local", "remote"):
        src = FIXTURES / case / tier / run
        if src.exists():
            shutil.copytree(src, tmp_path / tier / run)
            dirs.append(tmp_path / tier / run)
        else:
            dirs.append(None)
    return run, dirs[0], dirs[1], {int(v): e for v, e in EXPECTED[case]["versions"].items()}


def _journal_restore(tier, v, name, cap):
    fresh = _make(name, capacity=cap, seed=98)
    restore_journal(fresh, _load(tier, v, "replay_journal"), agent_to_module_mapping_fn=_ma_mapping)
    return fresh


def _migrate_and_check(engine_factory, tmp_path, capsys, case):
    name, cap = CASES[case]
    run, local, remote, expected = _fixture(case, tmp_path)
    tiers = [Tier(str(local), "local")] + ([Tier(str(remote), "remote")] if remote else [])
    versions = sorted(tiers[0].version_dirs())
    assert versions == sorted(expected) and all(sorted(t.version_dirs()) == versions for t in tiers)
    remote_args = ["--remote", f"file://{remote}"] if remote else []

    # the frozen reader restores each version into the buffer the fixture names
    for v in versions:
        buf, fmt = restored_buffer(_load(tiers[0], v, "replay"), _load(tiers[0], v, "replay_meta"), v)
        assert (fmt, fingerprint(buf)) == (expected[v]["format"], expected[v]["fingerprint"]), v

    # a live engine owns the run: refused
    eng = engine_factory(run=run, keep_last=10, critical_writers=1, best_effort_writers=0)
    code, _, err = cli(capsys, "migrate", local, *remote_args)
    assert code == 1 and "migrate refused" in err and "--force" in err, err
    eng.shutdown()
    before = [tree(t.root) for t in tiers]

    # --dry-run: says what would change, changes nothing
    code, out, err = cli(capsys, "migrate", local, *remote_args, "--dry-run")
    assert code == 0, err
    assert [tree(t.root) for t in tiers] == before
    for v in versions:
        assert f"version {v} (step {v}): {expected[v]['format']} -> ray_ckpt.rllib.replay/6" in out, out
    assert "to write" in out, out

    code, out, err = cli(capsys, "migrate", local, *remote_args)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == len(versions) + 1, out
    assert all(f"version {v} (step {v}): {expected[v]['format']}" in lines[i] for i, v in enumerate(versions)), out
    assert f"{len(versions)} versions rewritten as replay journals" in lines[-1], out
    assert ("on 2 tiers" in lines[-1]) == bool(remote), out

    next_ids = []
    for tier in tiers:
        manifests = {v: read_manifest(tier, v) for v in versions}
        assert chain_problems(manifests) == []
        assert all(manifests[v].previous is not None for v in versions[1:])  # the chain was rewritten, not cut
        for v, m in manifests.items():
            assert "replay_journal" in m.states and not set(OLD) & set(m.states), (v, sorted(m.states))
            assert m.states["replay_journal"].strategy == "critical"
            assert fingerprint(_journal_restore(tier, v, name, cap)) == expected[v]["fingerprint"], (tier.name, v)
        leftovers = [p for p in tier.list_files("") if "/replay/" in p or "/replay_meta/" in p]
        assert leftovers == [] and not tier.exists("migrate_progress.json")
        next_ids.append([read_meta(_load(tier, v, "replay_journal"))["next_row_id"] for v in versions])
        for i, v in enumerate(versions[1:]):  # ids never name two rows: each version's start above the one before
            assert _load(tier, v, "replay_journal")["row_id"][0] >= next_ids[-1][i]
    if remote:
        assert next_ids[0] == next_ids[1]
        assert [read_manifest(tiers[0], v).to_json() for v in versions] == \
               [read_manifest(tiers[1], v).to_json() for v in versions]

    for root in [local] + ([f"file://{remote}"] if remote else []):
        code, out, err = cli(capsys, "verify", root, "--all")
        assert code == 0 and f"OK: {len(versions)} versions" in out and "not named by the manifest" not in out, \
            out + err

    # again: a no-op that says so
    after = [tree(t.root) for t in tiers]
    code, out, err = cli(capsys, "migrate", local, *remote_args)
    assert code == 0 and "nothing to migrate" in out, out
    assert f"{len(versions)} versions already hold 'replay_journal'" in out, out
    assert [tree(t.root) for t in tiers] == after
    return run, versions, expected


@pytest.mark.timeout(90)
def test_migrate_a_prioritized_run_on_both_tiers(engine_factory, tmp_path, capsys):
    run, versions, expected = _migrate_and_check(engine_factory, tmp_path, capsys, "prioritized")
    # a new engine on the migrated run trusts and lists every version, and loads the journal
    eng = engine_factory(run=run, keep_last=10, critical_writers=1, best_effort_writers=0)
    metas = eng.list_checkpoints()
    assert [m.version for m in metas] == versions and all("replay_journal" in m.states for m in metas)
    fresh = _make("prioritized", capacity=150, seed=5)
    restore_journal(fresh, eng.load("replay_journal", step=versions[-1]))
    assert fingerprint(fresh) == expected[versions[-1]]["fingerprint"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["multi_agent_prioritized", "plain", "format_1"])
def test_migrate_other_buffers_and_formats(engine_factory, tmp_path, capsys, case):
    """Format /5 (multi-agent prioritized, both tiers), /4 of a plain buffer, /1 (the whole-meta
    multi-agent form)."""
    _migrate_and_check(engine_factory, tmp_path, capsys, case)


@pytest.mark.timeout(60)
def test_migrate_refuses_what_it_cannot_do(tmp_path, capsys):
    """Not a run, a run without committed versions: one-line errors; a run without replay states: a no-op."""
    code, _, err = cli(capsys, "migrate", tmp_path / "nope")
    assert code == 1 and err.startswith("ray-ckpt: error:") and len(err.strip().splitlines()) == 1
    (tmp_path / "r" / "v000000000001").mkdir(parents=True)
    code, _, err = cli(capsys, "migrate", tmp_path / "r")
    assert code == 1 and "no committed version" in err, err
    code, out, _ = cli(capsys, "migrate", tmp_path / "r", "--json", "--dry-run", "--remote", tmp_path / "r")
    assert code == 2


def test_migrate_is_listed(capsys):
    code, out, _ = cli(capsys, "--help")
    assert code == 0 and "migrate" in out


def _crafted_run(root, meta):
    """A committed version whose ``replay_meta`` is ``meta`` (written by the storage layer itself)."""
    import numpy as np
    from ray_ckpt.formats.manifest import Manifest, StateEntry
    from ray_ckpt.formats.tree import flatten
    from ray_ckpt.storage.checkpoint_io import write_flat, write_manifest
    tier = Tier(str(root), "local")
    states = {"replay": {"row_id": np.arange(3, dtype=np.int64), "x": np.zeros(3, np.float32)}, "replay_meta": meta}
    m = Manifest("r", 1, 1, 1.0)
    for n, st in states.items():
        files = write_flat(tier, 1, n, 0, flatten(st, state_name=n))
        m.states[n] = StateEntry("critical", "stored", {"0": files}, sum(f.size for f in files))
    write_manifest(tier, m)
    return tier


@pytest.mark.timeout(60)
@pytest.mark.parametrize("meta,message", [
    ({"format": "ray_ckpt.rllib.replay/2", "next_ids": {"row": 3}}, "version 1 holds a replay buffer in format "
                                                                    "ray_ckpt.rllib.replay/2"),
    ({"format": "ray_ckpt.rllib.replay/1", "buffer_type": "my_pkg.MyReplayBuffer", "config": {"capacity": 10}},
     "version 1: its replay buffer is a my_pkg.MyReplayBuffer, which migrate does not rebuild")])
def test_migrate_refuses_format_2_and_unknown_buffer_types_by_name(meta, message, tmp_path, capsys):
    _crafted_run(tmp_path / "r", meta)
    before = tree(tmp_path / "r")
    code, _, err = cli(capsys, "migrate", tmp_path / "r")
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err
    assert tree(tmp_path / "r") == before


@pytest.mark.timeout(60)
def test_a_migration_stopped_between_two_manifests_is_finished_by_the_next(tmp_path, capsys, monkeypatch):
    """The manifest swap stops after version 1's (a disk error, injected into the storage call the
    command makes): version 1 is a journal, 2-4 are not, and version 2's manifest still names
    version 1's old manifest: the one broken link (recovery would distrust version 1 meanwhile), which
    the progress record explains; the next migrate finishes: chain whole, verify OK, every version
    restores as before."""
    from ray_ckpt.cli import migrate
    from ray_ckpt.formats.manifest import chain_suspects
    name, cap = CASES["prioritized"]
    _, local, _, expected = _fixture("prioritized", tmp_path)
    tier = Tier(str(local), "local")
    versions = sorted(tier.version_dirs())
    calls = []
    real = migrate.write_manifest

    def failing(t, m):
        calls.append(m.version)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(t, m)

    monkeypatch.setattr(migrate, "write_manifest", failing)
    code, _, err = cli(capsys, "migrate", local)
    assert code == 1 and "1 manifest rewritten before it" in err and "again" in err, err
    monkeypatch.setattr(migrate, "write_manifest", real)
    manifests = {v: read_manifest(tier, v) for v in versions}
    assert "replay_journal" in manifests[1].states and "replay" in manifests[2].states
    assert list(chain_suspects(manifests)) == [1] and tier.exists("migrate_progress.json")

    code, out, err = cli(capsys, "migrate", local)
    assert code == 0 and "3 versions rewritten" in out, out + err
    manifests = {v: read_manifest(tier, v) for v in versions}
    assert chain_problems(manifests) == [] and not tier.exists("migrate_progress.json")
    for v in versions:
        assert fingerprint(_journal_restore(tier, v, name, cap)) == expected[v]["fingerprint"], v
    code, out, err = cli(capsys, "verify", local, "--all")
    assert code == 0 and "not named by the manifest" not in out, out + err
    assert [p for p in tier.list_files("") if "/replay/" in p or "/replay_meta/" in p] == []
