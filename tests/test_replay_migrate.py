"""``ray-ckpt migrate``: runs whose RLlib replay buffers were saved in the old two-state form
(``replay`` + ``replay_meta``, formats /4 and /5) by a real engine, with evictions and priority
updates between versions, on both tiers; migrated through the CLI entry point into the journal
(``replay_journal``, format /6). Every version then restores, through the journal, into a buffer
equal to the one the same version restored into before; ``verify`` passes on both tiers; the
manifest chain holds and a new engine lists every version; a second migrate and ``--dry-run``
change nothing; the old files are gone. Real RLlib buffers and episodes, a real Ray cluster (the
engine that writes the fixture runs), real files."""
from pathlib import Path

import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")

from test_rllib_replay import BUFFERS, _fill, _ma_chunks, _ma_mapping, _make, _sa_chunks  # noqa: E402
from test_rllib_replay_journal import _differences  # noqa: E402

import ray_ckpt as rc  # noqa: E402
from ray_ckpt.cli import main  # noqa: E402
from ray_ckpt.formats.manifest import chain_problems  # noqa: E402
from ray_ckpt.integrations.rllib.journal.restore import read_meta, restore_journal  # noqa: E402
from ray_ckpt.integrations.rllib.replay import (incremental_capture, incremental_multi_agent,  # noqa: E402
                                                row_ids, two_state)
from ray_ckpt.integrations.rllib.replay.incremental_ma_restore import log_to_v1  # noqa: E402
from ray_ckpt.storage.checkpoint_io import decode_files, read_files, read_manifest  # noqa: E402
from ray_ckpt.storage.tier import Tier  # noqa: E402

OLD = ("replay", "replay_meta")


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


def _old_restore(tier, v, name, cap):
    """The version's buffer as restore_algorithm_replay restores formats /3-/5."""
    replay, meta, _ = log_to_v1({"replay": _load(tier, v, "replay"), "replay_meta": _load(tier, v, "replay_meta")})
    fresh = _make(name, capacity=cap, seed=99)
    two_state.restore_replay(fresh, replay, meta, agent_to_module_mapping_fn=_ma_mapping)
    return fresh


def _journal_restore(tier, v, name, cap):
    fresh = _make(name, capacity=cap, seed=98)
    restore_journal(fresh, _load(tier, v, "replay_journal"), agent_to_module_mapping_fn=_ma_mapping)
    return fresh


def _old_run(engine_factory, name, chunks, cap, versions=4):
    """A run saved by a real engine as the RLlib callback saved it before the journal: ``replay``
    and ``replay_meta`` registered append-only, captured in format /4 (/5 multi-agent); evictions
    and priority updates between the versions; every version uploaded to the remote tier."""
    prioritized, multi_agent = "prioritized" in name, BUFFERS[name][2]
    eng = engine_factory(keep_last=10, critical_writers=1, best_effort_writers=0)
    buf = _make(name, capacity=cap)
    pending = {}
    for n in OLD:
        eng.register(n, (lambda n=n: pending[n]), strategy=rc.Strategy.CRITICAL, append_only=True,
                     loader=lambda s: None)
    rid = row_ids.row_ids_of(buf)
    step = -(-len(chunks) // versions)
    for v, i in enumerate(range(0, len(chunks), step), 1):
        _fill(buf, chunks, prioritized, multi_agent, i, i + step, seed=v)
        pending.update(incremental_multi_agent.capture_ma_states(buf, rid) if multi_agent
                       else incremental_capture.capture_states(buf, rid))
        h = eng.save(v)
        h.wait(timeout=60)
        h.wait(timeout=60, durability="remote")
    assert buf.get_num_episodes_evicted() > 0
    return eng


def _migrate_and_check(engine_factory, run_name, tmp_path, capsys, name, chunks, cap):
    eng = _old_run(engine_factory, name, chunks, cap)
    local, remote = tmp_path / "local" / run_name, tmp_path / "remote" / run_name
    tiers = [Tier(str(local), "local"), Tier(str(remote), "remote")]
    versions = sorted(tiers[0].version_dirs())
    assert len(versions) == 4 and sorted(tiers[1].version_dirs()) == versions
    fmt = "ray_ckpt.rllib.replay/5" if BUFFERS[name][2] else "ray_ckpt.rllib.replay/4"

    # a live engine owns the run: refused
    code, _, err = cli(capsys, "migrate", local, "--remote", f"file://{remote}")
    assert code == 1 and "migrate refused" in err and "--force" in err, err
    eng.shutdown()
    before = [tree(local), tree(remote)]

    pre = {v: _old_restore(tiers[0], v, name, cap) for v in versions}  # before migrating

    # --dry-run: says what would change, changes nothing
    code, out, err = cli(capsys, "migrate", local, "--remote", f"file://{remote}", "--dry-run")
    assert code == 0, err
    assert [tree(local), tree(remote)] == before
    assert out.count(f"{fmt} -> ray_ckpt.rllib.replay/6") == 4 and "to write" in out, out

    code, out, err = cli(capsys, "migrate", local, "--remote", f"file://{remote}")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 5 and all(f"version {v} (step {v}): {fmt}" in lines[v - 1] for v in versions), out
    assert "4 versions rewritten as replay journals" in lines[-1] and "on 2 tiers" in lines[-1], out

    next_ids = []
    for tier in tiers:
        manifests = {v: read_manifest(tier, v) for v in versions}
        assert chain_problems(manifests) == []
        assert all(manifests[v].previous is not None for v in versions[1:])  # the chain was rewritten, not cut
        for v, m in manifests.items():
            assert "replay_journal" in m.states and not set(OLD) & set(m.states), (v, sorted(m.states))
            assert m.states["replay_journal"].strategy == "critical"
            assert _differences(pre[v], _journal_restore(tier, v, name, cap)) == [], (tier.name, v)
        leftovers = [p for p in tier.list_files("") if "/replay/" in p or "/replay_meta/" in p]
        assert leftovers == [] and not tier.exists("migrate_progress.json")
        next_ids.append([read_meta(_load(tier, v, "replay_journal"))["next_row_id"] for v in versions])
        for v in versions[1:]:  # ids never name two rows: each version's start above the one before
            ids = _load(tier, v, "replay_journal")["row_id"]
            assert ids[0] >= next_ids[-1][v - 2]
    assert next_ids[0] == next_ids[1]
    assert [read_manifest(tiers[0], v).to_json() for v in versions] == \
           [read_manifest(tiers[1], v).to_json() for v in versions]

    for root in (local, f"file://{remote}"):
        code, out, err = cli(capsys, "verify", root, "--all")
        assert code == 0 and "OK: 4 versions" in out and "not named by the manifest" not in out, out + err

    # again: a no-op that says so
    after = [tree(local), tree(remote)]
    code, out, err = cli(capsys, "migrate", local, "--remote", f"file://{remote}")
    assert code == 0 and "nothing to migrate" in out and "4 versions already hold 'replay_journal'" in out, out
    assert [tree(local), tree(remote)] == after
    return pre, versions


@pytest.mark.timeout(60)
def test_migrate_a_prioritized_run_on_both_tiers(engine_factory, run_name, tmp_path, capsys):
    name, cap = "prioritized", 150
    pre, versions = _migrate_and_check(engine_factory, run_name, tmp_path, capsys, name,
                                       _sa_chunks(0, steps=150), cap)
    # a new engine on the migrated run trusts and lists every version, and loads the journal
    eng = engine_factory(keep_last=10, critical_writers=1, best_effort_writers=0)
    metas = eng.list_checkpoints()
    assert [m.version for m in metas] == versions and all("replay_journal" in m.states for m in metas)
    fresh = _make(name, capacity=cap, seed=5)
    restore_journal(fresh, eng.load("replay_journal", step=versions[-1]))
    assert _differences(pre[versions[-1]], fresh) == []


@pytest.mark.timeout(60)
def test_migrate_a_multi_agent_prioritized_run(engine_factory, run_name, tmp_path, capsys):
    _migrate_and_check(engine_factory, run_name, tmp_path, capsys, "multi_agent_prioritized", _ma_chunks(), 80)


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
def test_a_migration_stopped_between_two_manifests_is_finished_by_the_next(engine_factory, run_name, tmp_path,
                                                                           capsys, monkeypatch):
    """The manifest swap stops after version 1's (a disk error, injected into the storage call the
    command makes): version 1 is a journal, 2-4 are not, and version 2's manifest still names
    version 1's old manifest: the one broken link (recovery would distrust version 1 meanwhile), which
    the progress record explains; the next migrate finishes: chain whole, verify OK, every version
    restores as before."""
    from ray_ckpt.cli import migrate
    from ray_ckpt.formats.manifest import chain_suspects
    name, cap = "prioritized", 150
    _old_run(engine_factory, name, _sa_chunks(0, steps=150), cap).shutdown()
    local = tmp_path / "local" / run_name
    tier = Tier(str(local), "local")
    versions = sorted(tier.version_dirs())
    pre = {v: _old_restore(tier, v, name, cap) for v in versions}
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
        assert _differences(pre[v], _journal_restore(tier, v, name, cap)) == [], v
    code, out, err = cli(capsys, "verify", local, "--all")
    assert code == 0 and "not named by the manifest" not in out, out + err
    assert [p for p in tier.list_files("") if "/replay/" in p or "/replay_meta/" in p] == []
