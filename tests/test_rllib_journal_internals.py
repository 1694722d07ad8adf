"""What the replay journal (integrations/rllib/replay/) relies on RLlib's buffers and episodes to do
(_rllib_internals.STATE_KEYS and JOURNAL_INTERNALS; also run on the oldest Ray: Makefile OLDEST_TESTS):
get_state()/set_state() keys, add()'s index entries, leaf arithmetic, free-node order, eviction, episodes
rebuilt by from_state + concat_episode. Real RLlib objects (plain Python): no mocks, no Ray cluster."""
import collections
import copy
import operator

import numpy as np
import pytest

pytest.importorskip("ray.rllib")

from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.utils.replay_buffers import EpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer  # noqa: E402
from test_rllib_replay import _make, _sa_chunks  # noqa: E402

from ray_ckpt.integrations.rllib.base import _rllib_internals as internals  # noqa: E402


def _state_keys(cls):
    """STATE_KEYS' keys for ``cls``, found by its "module:Class" (RLlib moving it fails here)."""
    keys = {owner: set(names) for owner, names in internals.STATE_KEYS}
    return keys[f"{cls.__module__}:{cls.__qualname__}"]


def _same(a, b):
    """Equal, recursively; arrays by dtype and values, scalars by type and value."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def _leaves(buf, key, entries):
    """The tree leaves of index entries, read through get_state() (leaf i at len // 2 + i)."""
    values = buf.get_state()[key]
    return [values[len(values) // 2 + x[2]] for x in entries]


def _typed(values):
    return [(v, type(v)) for v in values]


@pytest.mark.timeout(60)
def test_get_state_has_exactly_the_keys_the_journal_handles_and_needs_no_episodes():
    """The journal stores RLlib's get_state() minus the episodes and passes the same keys to set_state():
    a key RLlib adds or renames would be lost. It calls EpisodeReplayBuffer.get_state with the episodes
    swapped for () (O(episodes), not O(timesteps)) and takes its _indices as the live list."""
    erb, per = _make("plain", 1000), _make("prioritized", 1000)
    for buf in (erb, per):
        buf.add(_sa_chunks(0)[:6])
    assert set(erb.get_state()) == _state_keys(EpisodeReplayBuffer)
    assert set(per.get_state()) == _state_keys(EpisodeReplayBuffer) | _state_keys(PrioritizedEpisodeReplayBuffer)
    for buf in (erb, per):
        full = EpisodeReplayBuffer.get_state(buf)
        episodes, ids = buf.episodes, [e.id_ for e in buf.episodes]
        buf.episodes = ()
        try:
            st = EpisodeReplayBuffer.get_state(buf)
            whole = type(buf).get_state(buf)
        finally:
            buf.episodes = episodes
        assert st["_indices"] is buf._indices and st["episodes"] == [] and whole["episodes"] == []
        assert {k: v for k, v in st.items() if k != "episodes"} == {k: v for k, v in full.items() if k != "episodes"}
        assert buf.episodes is episodes and [e.id_ for e in episodes] == ids
    # the prioritized class's get_state() gives the trees' own value lists (read, never copied, by the journal)
    st = per.get_state()
    assert st["_sum_segment"] is per._sum_segment.value and st["_min_segment"] is per._min_segment.value


@pytest.mark.timeout(120)
def test_the_multi_agent_state_is_rllibs_without_the_env_trees():
    """The journal reads the multi-agent keys itself (internals.multi_agent_state): what
    MultiAgentEpisodeReplayBuffer.get_state() adds to EpisodeReplayBuffer's, equal key by key and
    value by value, for both multi-agent classes -- its super() call would copy the prioritized
    class's env trees and free nodes (O(capacity)) at every add()."""
    from ray.rllib.utils.replay_buffers import MultiAgentEpisodeReplayBuffer
    from test_rllib_replay import _fill, _ma_chunks
    from ray_ckpt.integrations.rllib.replay.journal import base_state, family_of
    for name in ("multi_agent", "multi_agent_prioritized"):
        buf = _make(name, 200)
        _fill(buf, _ma_chunks(), "prioritized" in name, True, 0, 12)
        rllib = MultiAgentEpisodeReplayBuffer.get_state(buf)
        ours = base_state(buf, family_of(buf))
        assert set(rllib) - set(ours) == (_state_keys(PrioritizedEpisodeReplayBuffer) if "prioritized" in name
                                          else set())
        assert set(ours) <= set(rllib)
        for k in set(ours) - {"episodes", "episode_id_to_index"}:  # base_state swaps those two out
            assert ours[k] == rllib[k], k
        assert ours["_module_to_indices"][0][1] is buf._module_to_indices[ours["_module_to_indices"][0][0]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["plain", "prioritized"])
def test_add_keeps_copies_and_appends_each_kept_chunks_entries_in_call_order(name):
    """record_add() stores the caller's chunks as they are (no copy) and takes the last len(chunk)
    _indices entries of each kept chunk, in call order, as that add() call's: (episode index from
    episode_id_to_index, t from the stored length[, the tree leaf])."""
    buf = _make(name, 10_000)
    chunks = _sa_chunks(0)
    stored = {}
    for i in range(0, len(chunks), 3):
        call = chunks[i:i + 3]
        before = len(buf._indices)
        buf.add(call)
        want = []
        for c in call:
            e = buf.episode_id_to_index[c.id_]
            assert buf.episodes[e - buf._num_episodes_evicted].id_ == c.id_
            want += [(e, stored.get(c.id_, 0) + t) for t in range(len(c))]
            stored[c.id_] = stored.get(c.id_, 0) + len(c)
        assert [x[:2] for x in buf._indices[before:]] == want
        assert {len(x) for x in buf._indices} == {3 if name == "prioritized" else 2}
    assert any(len(c) < stored[c.id_] for c in chunks)  # some chunks continued a stored episode
    assert {e.id_: len(e) for e in buf.episodes} == stored
    snapshot = copy.deepcopy([e.get_state() for e in buf.episodes])
    for c in chunks:  # the caller changes its chunks' arrays in place after add()
        for lb in (c.observations, c.actions, c.rewards, *c.extra_model_outputs.values()):
            lb.data += 1
    assert _same([e.get_state() for e in buf.episodes], snapshot)


@pytest.mark.timeout(60)
def test_prioritized_leaves_hold_weight_and_priority_to_the_alpha_as_rllib_computes_them():
    """The journal records add()'s weight (the buffer's _max_priority when None, read before the call) and
    update_priorities()' values for _last_sampled_indices, and recomputes each leaf on restore as
    ``w ** _alpha`` / ``max(p, 1e-12) ** _alpha`` (value and type) and inner nodes as op(left, right)."""
    buf = _make("prioritized", 2000)
    assert (alpha := buf._alpha) == 0.6
    chunks = iter(_sa_chunks(0))

    def check(entries, want):
        for key in ("_sum_segment", "_min_segment"):
            assert _typed(_leaves(buf, key, entries)) == _typed(want), key

    for w in (0.7, np.float32(0.3), np.float64(2.5)):
        before = len(buf._indices)
        buf.add([next(chunks), next(chunks)], weight=w)
        check(buf._indices[before:], [w ** alpha] * (len(buf._indices) - before))
    assert type(np.float32(0.3) ** alpha) is np.float32  # numpy keeps float32 (NEP 50): so does the leaf
    for seed, dtype in ((1, np.float32), (2, np.float64)):
        buf.sample(8, n_step=1)
        sampled = list(buf._last_sampled_indices)
        assert len(sampled) == 8 and all(0 <= t < buf._sum_segment.capacity for t in sampled)
        p = (np.random.default_rng(seed).random(8) * 3 * seed).astype(dtype)
        p[-1] = 0.0  # clamped to 1e-12: a Python float leaf
        old = buf._max_priority
        buf.update_priorities(p)
        want, top = {}, old
        for t, x in zip(sampled, p):  # a leaf sampled twice holds the later value
            want[t] = max(x, 1e-12) ** alpha
            top = max(top, max(x, 1e-12))
        check([(0, 0, t) for t in want], list(want.values()))
        assert type(want[sampled[-1]]) is float
        assert buf._last_sampled_indices == []
        assert (buf._max_priority, type(buf._max_priority)) == (top, type(top)) and top > old
        # weight None: the _max_priority read before the call
        before, w = len(buf._indices), buf._max_priority
        buf.add([next(chunks)])
        check(buf._indices[before:], [w ** alpha] * (len(buf._indices) - before))
    for key, op, neutral in (("_sum_segment", operator.add, 0.0), ("_min_segment", min, float("inf"))):
        v = buf.get_state()[key]
        assert _typed(v[1:len(v) // 2]) == _typed([op(v[2 * i], v[2 * i + 1]) for i in range(1, len(v) // 2)])
        assert (v[0], type(v[0])) == (neutral, float)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["plain", "prioritized"])
def test_eviction_drops_oldest_episodes_and_frees_their_leaves_to_the_left(name):
    """The journal drops records of episodes below _num_episodes_evicted (oldest first, episode index =
    evicted + position), restores freed leaves as the neutral 0.0 / inf, saves _free_nodes as
    (freed, LIFO) + range, and expects new steps to take nodes with popleft()."""
    buf = _make(name, 45)  # 40: RLlib's own EpisodeReplayBuffer.add() fails (IndexError) on these chunks
    prioritized = name == "prioritized"
    chunks = _sa_chunks(0)
    evicted = checked = late = 0
    for i in range(0, len(chunks), 2):
        call = chunks[i:i + 2]
        where, n_evicted, indices = dict(buf.episode_id_to_index), buf._num_episodes_evicted, list(buf._indices)
        free = collections.deque(buf._free_nodes) if prioritized else None
        buf.add(call)
        first = buf._num_episodes_evicted
        evicted += first - n_evicted
        assert sorted(e for e in where.values() if e < first) == list(range(n_evicted, first))  # the oldest
        assert all((buf.episode_id_to_index.get(x) == e) == (e >= first) for x, e in where.items())
        assert [buf.episode_id_to_index[e.id_] for e in buf.episodes] == list(range(first, first + len(buf.episodes)))
        for c in call:  # a chunk of an episode this call evicted: PER drops it; ERB evicts it with its episode
            if where.get(c.id_, first) < first:  # or, evicted before it, stores it as a new episode (t from 0)
                e = buf.episode_id_to_index.get(c.id_)
                assert e is None or not prioritized
                if e is not None:
                    assert [x[1] for x in buf._indices if x[0] == e] == list(range(len(c)))
                late += e is not None or prioritized
        survivors = [x for x in indices if x[0] >= first]
        assert buf._indices[:len(survivors)] == survivors
        new = buf._indices[len(survivors):]
        assert len(new) == sum(len(c) for c in call if c.id_ in buf.episode_id_to_index)
        assert buf._num_timesteps == len(buf._indices) == sum(len(e) for e in buf.episodes)
        if not prioritized:
            continue
        for x in indices:
            if x[0] < first:
                free.appendleft(x[2])
        assert [x[2] for x in new] == [free.popleft() for _ in new]
        assert list(buf._free_nodes) == list(free)
        reused = {x[2] for x in new}
        gone = [x for x in indices if x[0] < first and x[2] not in reused]
        assert _typed(_leaves(buf, "_sum_segment", gone)) == _typed([0.0] * len(gone))
        assert _typed(_leaves(buf, "_min_segment", gone)) == _typed([float("inf")] * len(gone))
        checked += len(gone)
    assert evicted == buf._num_episodes_evicted > 0 and late > 0
    assert checked > 0 or not prioritized


@pytest.mark.timeout(60)
def test_set_state_keeps_present_episodes_takes_tree_lists_and_drops_the_free_node_maxlen():
    """The restore puts the rebuilt episodes in buf.episodes, then calls set_state() with episodes=[]
    (RLlib rebuilds episodes only into an empty deque), hands it fresh tree value lists, and puts the
    free-node deque's maxlen back afterwards (set_state() makes a deque without one)."""
    src = _make("plain", 10_000)
    src.add(_sa_chunks(0))
    st = src.get_state()
    mine = collections.deque([SingleAgentEpisode.from_state(st["episodes"][0])])
    kept = _make("plain", 10_000)
    kept.episodes = mine
    kept.set_state(st)  # st["episodes"] holds them all
    assert kept.episodes is mine and len(mine) == 1
    empty = _make("plain", 10_000)
    empty.set_state(st)
    assert [e.id_ for e in empty.episodes] == [e.id_ for e in src.episodes]
    per = _make("prioritized", 40)
    chunks = _sa_chunks(0)
    for i in range(0, len(chunks), 3):
        per.add(chunks[i:i + 3])
        per.sample(4, n_step=1)
        per.update_priorities(np.random.default_rng(i).random(4) * 2)
    assert per._free_nodes.maxlen == per._sum_segment.capacity == 128
    ps = per.get_state()
    sums, mins = list(ps["_sum_segment"]), list(ps["_min_segment"])
    new = _make("prioritized", 40)
    new.episodes = collections.deque(copy.deepcopy(per.episodes))
    new.set_state({**ps, "episodes": [], "_sum_segment": sums, "_min_segment": mins, "_indices": list(ps["_indices"])})
    assert new._sum_segment.value is sums and new._min_segment.value is mins  # SegmentTree.set_state: as is
    assert isinstance(new._free_nodes, collections.deque) and new._free_nodes.maxlen is None
    assert list(new._free_nodes) == list(per._free_nodes)
    new._free_nodes = collections.deque(new._free_nodes, maxlen=per._free_nodes.maxlen)  # what the restore does
    for buf in (per, new):
        buf.rng = np.random.default_rng(7)
        buf.sample(16, n_step=1)
    assert new._last_sampled_indices == per._last_sampled_indices
    new.add(chunks[:3])
    per.add(chunks[:3])
    assert new._indices == per._indices and list(new._free_nodes) == list(per._free_nodes)


@pytest.mark.timeout(60)
def test_from_state_and_concat_episode_rebuild_the_episode_add_stored():
    """The journal keeps each chunk's get_state() (with _start_time and _last_step_time, which have no
    public accessor) and rebuilds a stored episode as from_state(first chunk), then concat_episode() of
    each next chunk's from_state(): the same episode add() built from its copies."""
    chunks = _sa_chunks(0)
    parts = max(([c for c in chunks if c.id_ == x] for x in dict.fromkeys(c.id_ for c in chunks)), key=len)
    assert len(parts) >= 3
    buf = _make("plain", 10_000)
    for c in parts:
        buf.add(c)
    want = buf.episodes[0].get_state()
    ep = SingleAgentEpisode.from_state(parts[0].get_state())
    for c in parts[1:]:
        ep.concat_episode(SingleAgentEpisode.from_state(c.get_state()))
    got = ep.get_state()
    assert _state_keys(SingleAgentEpisode) <= set(got)
    assert got["_start_time"] == parts[0]._start_time is not None and got["_last_step_time"] is not None
    assert _same(got, want)
    assert len(ep) == sum(len(c) for c in parts) and ep.t == parts[-1].t
