"""Bytes per save of a multi-agent prioritized replay buffer that evicts for many capacities (format /5),
Ray-free: RLlib's MultiAgentEnvRunners (random actions, their chunks interleaved as when several env
runners feed one buffer) fill a small buffer a few chunks at a time; after each fill the buffer is
captured, written append-only over the previous version as the engine's writers write it, and every
25th version restored into a fresh buffer and compared. Printed per milestone (before eviction, after
1x/3x/10x capacity added): the runs of ``_sample_idx_to_tree_idx``'s key order, its stale keys, the
meta record's compressed bytes, the ``replay_meta`` and ``replay`` bytes the version wrote, the
free-node deques' prefixes and the live records the meta record lists.

    python benchmarks/rllib_ma_replay_evictions.py --env pendulum --capacity 1000 --runners 8 --chunk 5 \
        --samples 300 --step 16
"""
import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_rllib_replay import _fill, _ma_mapping, _make, _store_version  # noqa: E402
from test_rllib_replay_multi_agent import runner_chunks  # noqa: E402

from ray_ckpt.integrations.rllib.replay import compare, incremental_ma_restore, incremental_multi_agent  # noqa: E402
from ray_ckpt.integrations.rllib.replay import row_ids, two_state  # noqa: E402
from ray_ckpt.integrations.rllib.replay.segment_trees import _free_nodes_state  # noqa: E402
from ray_ckpt.storage.tier import Tier  # noqa: E402


def chunks(env, runners, samples, chunk):
    from ray.rllib.examples.envs.classes import multi_agent as ma
    env_cls = {"cartpole": ma.MultiAgentCartPole, "pendulum": ma.MultiAgentPendulum,
               "mountaincar": ma.MultiAgentMountainCar}[env]
    return runner_chunks(env_cls, runners, samples, chunk)


def feed(buf, ch, start, stop, seed):
    """Three chunks an add, sampled and priorities updated in between (test_rllib_replay._fill); where
    RLlib's own multi-agent sampler fails ('N is not in list' in env_t_to_agent_t) the partial batch's
    indices are dropped, as no update follows it."""
    for i in range(start, min(stop, len(ch)), 3):
        try:
            _fill(buf, ch, True, True, i, min(i + 3, stop), seed=seed)
        except ValueError:
            for sampled in buf._module_to_last_sampled_indices.values():
                sampled.clear()


def one_version(buf, v, states, written):
    log = states["replay_meta"]
    at = int(np.searchsorted(np.asarray(log["row_id"]), log["meta_at"]))
    keys = np.fromiter(buf._sample_idx_to_tree_idx, np.int64, len(buf._sample_idx_to_tree_idx))
    inc = row_ids.row_ids_of(buf).inc
    return {"v": v, "added_env": int(buf._num_timesteps_added), "evicted": int(buf._num_episodes_evicted),
            "key_runs": int(1 + np.count_nonzero(np.diff(keys) != 1)) if len(keys) else 0,
            "stale_keys": int(np.count_nonzero(keys >= len(buf._indices))),
            "meta_record": int.from_bytes(np.asarray(log["blob"])[at, :4].tobytes(), "little"),
            "replay_meta_written": written["replay_meta"], "replay_written": written["replay"],
            "free_prefix": len(_free_nodes_state(buf._free_nodes).get("prefix", [])),
            "module_free_prefix": sum(len(_free_nodes_state(d).get("prefix", []))
                                      for d in buf._module_to_free_nodes.values()),
            "key_order_records": len(getattr(inc, "s2t_recs", [])), "priority_records": len(inc.precs),
            "env_records": len(inc.env_recs), "episode_batches": len(inc.batches)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--env", default="cartpole", choices=["cartpole", "pendulum", "mountaincar"])
    p.add_argument("--capacity", type=int, default=200)
    p.add_argument("--runners", type=int, default=2)
    p.add_argument("--chunk", type=int, default=20)
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--step", type=int, default=4, help="chunks added between two saves")
    p.add_argument("--json", default=None)
    p.add_argument("--dir", default=None, help="where the versions are written (default: a temporary "
                   "directory, removed at the end)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ma_evictions_", dir=a.dir) as d:
        run(a, Tier(d, "local"))


def run(a, tier):
    ch = chunks(a.env, a.runners, a.samples, a.chunk)
    name = "multi_agent_prioritized"
    buf = _make(name, capacity=a.capacity)
    base, rows = {}, []
    for v, i in enumerate(range(0, len(ch), a.step), 1):
        feed(buf, ch, i, i + a.step, seed=v)
        states = incremental_multi_agent.capture_ma_states(buf, row_ids.row_ids_of(buf))
        base, back, written = _store_version(tier, v, states, base)
        rows.append(one_version(buf, v, states, written))
        if v % 25 == 0:
            fresh = _make(name, a.capacity, seed=99)
            replay, meta, _ = incremental_ma_restore.log_to_v1(back)
            two_state.restore_replay(fresh, replay, meta, agent_to_module_mapping_fn=_ma_mapping)
            assert compare.buffer_state_equal(buf, fresh) == [], v
    if a.json:
        Path(a.json).write_text(json.dumps(rows))
    cap = a.capacity
    marks = [("before eviction", [r for r in rows if r["evicted"] == 0][-1:])]
    marks += [(f"after {x}x capacity", [r for r in rows if r["added_env"] >= x * cap][:1]) for x in (1, 3, 10)]
    for label, sel in marks:
        if sel:
            print(label, json.dumps(sel[0]))
    late = [r for r in rows if r["added_env"] >= 2 * cap]
    for k in ("key_runs", "meta_record", "replay_meta_written", "replay_written"):
        if late:
            print(f"from 2x capacity on ({len(late)} versions): {k} median {statistics.median(r[k] for r in late)} "
                  f"max {max(r[k] for r in late)} sum {sum(r[k] for r in late)}")


if __name__ == "__main__":
    main()
