"""Multi-agent replay buffers saved incrementally (format /5): version after version written as the
engine writes append-only states and restored exactly; a version's bytes grow with the rows it
adds, not with the buffer; format /1 versions (the earlier multi-agent form) still restore and are
continued as /5; multi-agent DQN (two policies, prioritized buffer) saved by the callback and
restored into a fresh Algorithm. Real RLlib episodes from RLlib's own MultiAgentEnvRunner; CPU."""
import numpy as np
import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")

from test_rllib_replay import (BUFFERS, _assert_same, _dqn_config, _fill, _ma_mapping, _make,  # noqa: E402
                               _same_states, _sampled, _store_version, _through_storage)

import ray_ckpt as rc  # noqa: E402
from ray_ckpt.integrations import rllib as rr  # noqa: E402
from ray_ckpt.integrations.rllib.replay import (compare, incremental_ma_restore, incremental_multi_agent,  # noqa: E402
                                                incremental_restore, incremental_state, key_order, multi_agent,
                                                records, row_ids, two_state)
from ray_ckpt.integrations.rllib.replay.buffers import buffer_kind  # noqa: E402
from ray_ckpt.storage.tier import Tier  # noqa: E402


@pytest.fixture(autouse=True)
def _format_5(monkeypatch):
    """This module tests formats /1, /4 and /5 (``replay`` + ``replay_meta``), which the callback
    writes only when asked to: the journal (format /6, the default) is tests/test_rllib_replay_journal.py's."""
    from ray_ckpt.integrations.rllib.replay import algorithm as replay_algorithm
    monkeypatch.setattr(replay_algorithm, "REPLAY_FORMAT", 5)

_CHUNKS = {}


def _chunks(n_samples, runners=1):
    """Episode chunks from RLlib's MultiAgentEnvRunner on MultiAgentCartPole (two agents, modules p0
    and p1, random actions, 20 env steps a sample): agents' episodes end at different times. With
    several runners their chunks interleave, as when several env runners feed one buffer."""
    if (n_samples, runners) not in _CHUNKS:
        from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole
        _CHUNKS[(n_samples, runners)] = runner_chunks(MultiAgentCartPole, runners, n_samples, 20)
    return _CHUNKS[(n_samples, runners)]


def runner_chunks(env_cls, runners, n_samples, chunk):
    """``n_samples`` rounds of one ``chunk``-step sample from each of ``runners`` MultiAgentEnvRunners
    on ``env_cls`` (two agents), their chunks interleaved in that order."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.env.multi_agent_env_runner import MultiAgentEnvRunner
    made = []
    for r in range(runners):
        cfg = (PPOConfig().environment(env_cls, env_config={"num_agents": 2})
               .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=_ma_mapping)
               .env_runners(rollout_fragment_length=chunk).debugging(seed=1 + r))
        runner = MultiAgentEnvRunner(config=cfg)
        for env in runner.env.envs:  # random actions from seeded spaces: the same episodes every run
            for k, aid in enumerate(env.unwrapped.possible_agents):
                env.unwrapped.get_action_space(aid).seed(11 + k + 7 * r)
        made.append(runner)
    out = []
    for _ in range(n_samples):
        for runner in made:
            out += runner.sample(num_timesteps=chunk, random_actions=True)
    for runner in made:
        runner.stop()
    return out


def _restored(name, states, capacity):
    """A fresh buffer restored from the two states, its caches seeded (as restore_algorithm does)."""
    fresh = _make(name, capacity, seed=99)
    replay, meta, seeds = incremental_ma_restore.log_to_v1(states)
    two_state.restore_replay(fresh, replay, meta, agent_to_module_mapping_fn=_ma_mapping)
    incremental_ma_restore.seed_log(row_ids.row_ids_of(fresh), seeds, fresh)
    return fresh


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["multi_agent", "multi_agent_prioritized"])
def test_multi_agent_versions_restore_exactly_and_a_restored_buffer_continues_the_log(name, tmp_path):
    """Captured every few adds (evictions, and priority updates per module in between), the two
    states are written version after version as the engine writes them (append-only over the
    previous version); each version restores into a fresh buffer exactly; a buffer restored from
    version 3 and fed the same since captures the same states, byte for byte, as the original."""
    prioritized = "prioritized" in name
    tier = Tier(str(tmp_path / "tier"), "local")
    chunks = _chunks(24)
    buf = _make(name, capacity=120)
    base, restored, step = {}, None, 4
    for v, i in enumerate(range(0, len(chunks), step), 1):
        for b in (buf, restored) if restored is not None else (buf,):
            _fill(b, chunks, prioritized, True, i, i + step, seed=v)
        states = incremental_multi_agent.capture_ma_states(buf, row_ids.row_ids_of(buf))
        assert states["replay_meta"]["format"] == "ray_ckpt.rllib.replay/5"
        base, back, _ = _store_version(tier, v, states, base)
        if restored is not None:
            _same_states(states, incremental_multi_agent.capture_ma_states(restored, row_ids.row_ids_of(restored)))
        fresh = _restored(name, back, 120)
        assert compare.buffer_state_equal(buf, fresh) == [], v
        if v == 3:
            restored = fresh
    assert buf.get_num_episodes_evicted() > 10
    assert len(row_ids.row_ids_of(buf).inc.env_recs) < v  # env records of evicted episodes left the log
    _assert_same(_sampled(buf, True), _sampled(restored, True), "sample")


@pytest.mark.timeout(300)
def test_multi_agent_save_writes_the_new_rows_not_the_buffer(tmp_path):
    """A multi-agent prioritized buffer of ~4k agent rows, then versions that each add ~80 and
    update priorities of both modules: a version's bytes are a small multiple of its new rows'
    segment and do not grow with the buffer, while format /1's meta (written whole each save) is
    tens of KB and grows with it."""
    tier = Tier(str(tmp_path / "tier"), "local")
    chunks = _chunks(100)
    buf = _make("multi_agent_prioritized", capacity=100_000)
    first = len(chunks) - 16
    _fill(buf, chunks, True, True, 0, first)
    base, per_version, sizes = {}, [], []
    for v, i in enumerate(range(first, len(chunks), 4), 1):
        if v > 1:
            _fill(buf, chunks, True, True, i, i + 4, seed=v)
        states = incremental_multi_agent.capture_ma_states(buf, row_ids.row_ids_of(buf))
        base, back, written = _store_version(tier, v, states, base)
        new_segment = [f.size for f in base["replay"] if f.path.startswith(f"v{v:012d}/") and f.role == "segment"]
        per_version.append((written, sum(new_segment)))
        sizes.append(buf._num_agent_timesteps)
    n_rows = buf._num_agent_timesteps
    assert n_rows > 3000
    whole = sum(f.size for f in base["replay"] if f.role == "segment")
    for (w, seg) in per_version[1:]:
        assert 0 < seg < 0.05 * whole
        assert w["replay_meta"] < 8000, w          # O(what was added), not O(N)
        assert sum(w.values()) < seg + 10000, (w, seg)
    # format /1's meta of the same buffer, written whole every save: O(episodes + env steps + rows)
    _, meta_v1 = two_state.capture_replay(buf, row_ids=row_ids.RowIds())
    files, _ = _through_storage(tmp_path / "v1", "replay_meta", meta_v1)
    assert sum(f.size for f in files) > 5 * max(w["replay_meta"] for w, _ in per_version[1:])
    fresh = _restored("multi_agent_prioritized", back, 100_000)
    assert compare.buffer_state_equal(buf, fresh) == []


@pytest.mark.timeout(300)
def test_a_format_1_version_restores_and_continues_as_format_5(tmp_path):
    """Format /1 (rows + a nested meta written whole, the earlier multi-agent form) is read: the
    buffer comes back exactly; its next capture is a whole format /5 log, which restores exactly."""
    name = "multi_agent_prioritized"
    chunks = _chunks(24)
    buf = _make(name, capacity=120)
    _fill(buf, chunks, True, True, 0, 40)
    replay, meta = multi_agent.capture_multi_agent(buf, buffer_kind(buf), row_ids.RowIds())
    assert meta["format"] == "ray_ckpt.rllib.replay/1"
    _, replay_back = _through_storage(tmp_path / "r", "replay", replay)
    _, meta_back = _through_storage(tmp_path / "m", "replay_meta", meta)
    old = _make(name, capacity=120, seed=7)
    two_state.restore_replay(old, replay_back, meta_back, agent_to_module_mapping_fn=_ma_mapping)
    assert compare.buffer_state_equal(buf, old) == []
    for b in (buf, old):
        _fill(b, chunks, True, True, 40, len(chunks), seed=3)
    states = incremental_multi_agent.capture_ma_states(old, row_ids.row_ids_of(old))
    assert states["replay_meta"]["format"] == "ray_ckpt.rllib.replay/5"
    _, back, _ = _store_version(Tier(str(tmp_path / "tier"), "local"), 2, states, {})
    assert compare.buffer_state_equal(buf, _restored(name, back, 120)) == []


def _s2t_bytes(log):
    """The bytes of ``_sample_idx_to_tree_idx``'s part of a replay_meta log's meta record (what every
    version writes again), before compression."""
    meta, _, _ = incremental_restore.read_log(log)
    return len(records._raw(meta["priority"]["s2t"]))


def _feed(buf, chunks, start, stop, seed):
    """:func:`test_rllib_replay._fill`, three chunks at a time; where RLlib's own multi-agent sampler
    fails ('N is not in list' in ``env_t_to_agent_t``: interleaved runners' chunks hit it) that
    group's priorities are not updated and the partial batch's indices are dropped."""
    for i in range(start, min(stop, len(chunks)), 3):
        try:
            _fill(buf, chunks, True, True, i, min(i + 3, stop), seed=seed)
        except ValueError as exc:
            assert "is not in list" in str(exc)
            for sampled in buf._module_to_last_sampled_indices.values():
                sampled.clear()


def _evicting_versions(tmp_path, capacity, n_samples, runners=2, step=4, check_every=1):
    """A multi-agent prioritized buffer fed ``runners``' interleaved chunks, ``step`` at a time, a
    version written after each (append-only, as the engine writes); every ``check_every``-th version
    restored into a fresh buffer and compared. Yields (buffer, version, states captured, states read
    back, bytes written)."""
    name = "multi_agent_prioritized"
    tier = Tier(str(tmp_path / f"tier{capacity}"), "local")
    chunks = _chunks(n_samples, runners)
    buf = _make(name, capacity=capacity)
    base = {}
    for v, i in enumerate(range(0, len(chunks), step), 1):
        _feed(buf, chunks, i, i + step, seed=v)
        states = _capture(buf)
        base, back, written = _store_version(tier, v, states, base)
        if v % check_every == 0:
            assert compare.buffer_state_equal(buf, _restored(name, back, capacity)) == [], (capacity, v)
        yield buf, v, states, back, written


def _key_runs(buf):
    keys = np.fromiter(buf._sample_idx_to_tree_idx, np.int64, len(buf._sample_idx_to_tree_idx))
    return int(1 + np.count_nonzero(np.diff(keys) != 1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", ["in_meta", "records"])
def test_an_evicting_buffer_restores_exactly_and_its_meta_per_save_stays_bounded(order, tmp_path, monkeypatch):
    """Buffers of two capacities fed two runners' interleaved chunks until they have taken ten
    times their capacity: every version restores exactly (RLlib's ``_sample_idx_to_tree_idx``, whose
    key order evictions break into runs, included); a buffer restored at a version and fed the same
    since captures the same states as the original; the map's part of the meta record (which every
    version writes again) is no larger after ten capacities than after two, nor for the buffer four
    times as large.
    ``records``: the key order is kept in key-order records from its first run on (short chains:
    bases and deltas alternate)."""
    if order == "records":
        monkeypatch.setattr(key_order, "INLINE_RUNS", 0)
        monkeypatch.setattr(key_order, "MAX_RECORDS", 4)
    name = "multi_agent_prioritized"
    steady = {}
    for capacity in (60, 240):
        sizes, runs, restored, chunks = {0: [], 1: []}, 0, None, _chunks(capacity // 4 + 4, 2)
        for buf, v, states, back, _ in _evicting_versions(tmp_path, capacity, n_samples=capacity // 4 + 4):
            if restored is not None:
                _feed(restored, chunks, 4 * (v - 1), 4 * v, seed=v)
                _same_states(states, _capture(restored))
            elif buf.get_num_episodes_evicted() > 3:
                restored = _restored(name, back, capacity)
            added = buf._num_timesteps_added / capacity
            if added >= 2:
                sizes[int(added >= 6)].append(_s2t_bytes(back["replay_meta"]))
                runs = max(runs, _key_runs(buf))
        assert buf._num_timesteps_added > 10 * capacity and runs > 4, (capacity, runs)  # the order broke up
        if order == "records":
            assert len(row_ids.row_ids_of(buf).inc.s2t_recs) > 0
        assert np.median(sizes[1]) < 1.2 * np.median(sizes[0]) + 64, (capacity, sizes)
        steady[capacity] = np.median(sizes[1])
    assert steady[240] < 1.2 * steady[60] + 256, steady


def _capture(buf):
    return incremental_multi_agent.capture_ma_states(buf, row_ids.row_ids_of(buf))


@pytest.mark.timeout(300)
def test_a_version_with_the_key_order_in_its_meta_record_continues_into_key_order_records(tmp_path, monkeypatch):
    """A /5 version whose meta record holds ``_sample_idx_to_tree_idx``'s key order as runs (every
    version written before the key-order records; a short order now) of a buffer whose order is long
    enough for key-order records: it restores exactly, the restored buffer's next save starts the
    records with a base, and that version restores exactly too."""
    monkeypatch.setattr(key_order, "INLINE_RUNS", 3)
    name = "multi_agent_prioritized"
    tier = Tier(str(tmp_path / "tier"), "local")
    versions = _evicting_versions(tmp_path / "orig", 60, n_samples=60)
    for buf, v, _, back, _ in versions:
        if len(row_ids.row_ids_of(buf).inc.s2t_recs) > 1:  # a base and a delta
            break
    old = _with_key_order_in_meta(back)
    fresh = _restored(name, old, 60)
    assert compare.buffer_state_equal(buf, fresh) == []
    next(versions)  # the original buffer's next version
    _feed(fresh, _chunks(60, 2), 4 * v, 4 * v + 4, seed=v + 1)
    states = _capture(fresh)
    assert [len(r) for r in (row_ids.row_ids_of(fresh).inc.s2t_recs,)] == [1]  # a base
    _, back, _ = _store_version(tier, v + 1, states, {})
    assert compare.buffer_state_equal(buf, _restored(name, back, 60)) == []


def _with_key_order_in_meta(states):
    """``states`` with the key order in the meta record itself (runs of keys), as /5 captures wrote
    it before the key-order records: no key-order record listed."""
    log = dict(states["replay_meta"])
    meta, rows, dicts = incremental_restore.read_log(log)
    s2t = meta["priority"]["s2t"]
    keys, _ = incremental_ma_restore._s2t_keys(s2t, rows, dicts)
    meta["priority"]["s2t"] = {"runs": key_order.runs_of(keys), "off_at": s2t["off_at"], "off_v": s2t["off_v"]}
    packed = {k: v for k, v in meta.items() if k not in ("format", "buffer_type")}
    zdict = incremental_restore._newest_dict(log, rows)
    blob = records._encode(incremental_state.META, records._raw(packed), zdict=zdict)
    at = int(log["meta_at"])
    log["row_id"] = np.concatenate([rows["row_id"], np.arange(at, at + len(blob), dtype=np.int64)])
    log["blob"] = np.concatenate([rows["blob"], blob])
    log["next_chunk"] = at + len(blob)
    return {**states, "replay_meta": log}


# ---------------------------------------------------------------- multi-agent DQN, saved by the callback
def _ma_dqn_config(cb, seed=3):
    """:func:`test_rllib_replay._dqn_config` on MultiAgentCartPole: two agents, one policy each, its
    buffer the multi-agent prioritized one (same capacity, alpha, beta)."""
    from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole
    cfg = _dqn_config(cb, seed)
    buffer = dict(cfg.replay_buffer_config, type="MultiAgentPrioritizedEpisodeReplayBuffer")
    return (cfg.environment(MultiAgentCartPole, env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=_ma_mapping)
            .training(replay_buffer_config=buffer))


@pytest.mark.timeout(300)
def test_multi_agent_dqn_buffer_saved_by_callback_restores_exactly(engine_factory, run_name):
    """Two policies, a multi-agent prioritized buffer that evicts: saved every iteration (each
    version appends its new rows and log records), resumed into a fresh Algorithm: the buffer's
    contents, per-module priorities and trees, counters and generator equal; the resumed run's next
    save appends to the same log."""
    engine = engine_factory(critical_writers=1)
    cb = rr.make_callback(run_name, every=1, on_busy="wait")
    algo = _ma_dqn_config(cb).build_algo()
    try:
        for _ in range(4):
            algo.train()
        assert sorted(rr.wait_for_saves(algo, timeout=120)) == [1, 2, 3, 4]
        buf = algo.local_replay_buffer
        assert buf.get_num_episodes_evicted() > 0
        r3, r4 = engine.load(name="replay", version=3), engine.load(name="replay", version=4)
        assert len(r4["row_id"]) == buf._num_agent_timesteps and set(np.unique(r4["module"])) == {0, 1}
        common, i3, i4 = np.intersect1d(r3["row_id"], r4["row_id"], return_indices=True)
        assert len(common) > 0 and np.array_equal(r3["obs"][i3], r4["obs"][i4])
        assert engine.load(name="replay_meta", version=4)["format"] == "ray_ckpt.rllib.replay/5"
    finally:
        algo.stop()
    fresh = _ma_dqn_config(rr.make_callback(run_name, every=1, on_busy="wait", resume=True)).build_algo()
    try:
        report = rr.find_callback(fresh).resumed
        assert report.version == 4 and report.states["replay"] == "restored"
        assert compare.buffer_state_equal(buf, fresh.local_replay_buffer) == []
        chunk_before = engine.load(name="replay_meta", version=4)["next_chunk"]
        fresh.train()
        rr.wait_for_saves(fresh, timeout=120)
        meta5 = engine.load(name="replay_meta", version=5)
        r5 = engine.load(name="replay", version=5)
        assert meta5["meta_at"] >= chunk_before  # the log continued: no rewrite from chunk 0
        assert np.setdiff1d(r5["row_id"], r4["row_id"]).min() > r4["row_id"].max()
    finally:
        fresh.stop()
    with pytest.raises(rc.RestoreError):  # a single-agent buffer cannot take it: named, nothing changed
        two_state.restore_replay(BUFFERS["prioritized"][0](capacity=300), *two_state.capture_replay(buf))
