"""RLlib replay buffers: the replay journal's (format /6, ``replay_journal``) incremental save
against a whole-buffer capture at every save, side by side on the same buffer contents.

    python benchmarks/replay_journal.py [--rows 40000] [--saves 8] [--adds 10] [--buffer prioritized]

Two arms, both the journal (the only format the buffer is saved in):

  incremental   what every save of a run writes: the records of what ``add()`` and
                ``update_priorities()`` received since the previous save
  whole buffer  the journal with ``full_because`` set before each capture: every stored episode and
                a STATE record, all rows new. What the first save after a restore from another run
                or an older version writes (once), and what a checkpointer that writes the whole
                buffer at every save would write each time

Two buffers of the same class, both journaled from empty (as the callback journals a run's buffer
from the algorithm's start), are filled with the same episodes (copies of sampled-like CartPole
chunks with the same ids, as ``rllib_iteration.prefill --clone`` does). Then each save round gives
both the same ``--adds`` add() calls of fresh chunks (8 envs, 20-step chunks, evicting) with a
sample + update_priorities after each (the buffers' generators are seeded alike, so both draw the
same samples and stay equal), and saves both: the capture timed (what ``save()`` adds to the
training thread; the garbage collector paused around it, as the callback's ``save()`` does), the state written version after version as the engine's writers write it
(append-only over the previous version, to a local directory) and its bytes counted. At the end the
newest version of each is read back and restored into a fresh buffer, timed, and compared with the
original (every attribute, ``tests/replay_compare.differences``, as the tests do); the two originals
are compared with each other too (they must be equal: the arms saw the same contents).

Printed: one table, the two arms side by side, and their ratios. No Ray cluster: the capture, the
writer's encoding and the restore are the parts that differ; the engine around them is the same
for both (``rllib_rate.py`` measures the whole train() rate).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

INC, FULL = "incremental", "whole buffer"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=40_000, help="buffer capacity; filled to it before the saves")
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--adds", type=int, default=10, help="add() calls (6 chunks each) between two saves")
    ap.add_argument("--buffer", default="prioritized", choices=["plain", "prioritized"])
    args = ap.parse_args()

    import numpy as np
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    from replay_compare import differences
    from test_rllib_replay import _make, _sa_chunks

    from ray_ckpt.capture.gc_pause import collections_paused
    from ray_ckpt.formats.tree import flatten
    from ray_ckpt.integrations.rllib.replay import journal as jn
    from ray_ckpt.integrations.rllib.replay.restore import restore_journal
    from ray_ckpt.storage.checkpoint_io import decode_files, read_files, write_append_only
    from ray_ckpt.storage.tier import Tier

    prioritized = args.buffer == "prioritized"
    chunks = _sa_chunks(0, n_envs=8, steps=20 * 6 * args.adds * (args.saves + 1) // 8 + 40, chunk=20)
    done = [c.get_state() for c in _sa_chunks(1, n_envs=8, steps=400, chunk=1000) if c.is_done]

    def filled():
        buf = _make(args.buffer, capacity=args.rows)
        jn.journal_of(buf)  # journaled from empty: it sees the buffer fill
        n = 0
        while len(buf) < args.rows - 2000:
            batch = []
            for st in done:  # the same ids in both buffers: their contents are the same
                batch.append(SingleAgentEpisode.from_state({**st, "id_": f"{n:032x}"}))
                n += 1
            buf.add(batch)
        return buf

    t0 = time.perf_counter()
    bufs = {INC: filled(), FULL: filled()}
    print(f"filled two {args.buffer} buffers of {len(bufs[INC]):,} rows ({bufs[INC].get_num_episodes():,} episodes) "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)
    journals = {k: jn.journal_of(b) for k, b in bufs.items()}

    def capture(k):
        if k == FULL:  # this save writes the whole buffer (every row anew), as after a restore from elsewhere
            journals[k].full_because = "benchmark: the whole buffer every save"
        return {jn.STATE_NAME: journals[k].capture(bufs[k])}

    root = tempfile.mkdtemp(prefix="replay_journal_")
    tiers = {k: Tier(os.path.join(root, k.replace(" ", "_")), "local") for k in bufs}
    base = {k: {} for k in bufs}
    ms = {k: [] for k in bufs}
    written = {k: [] for k in bufs}
    files = {}
    try:
        it = iter(range(0, len(chunks) - 6, 6))
        for v in range(1, args.saves + 2):  # version 1 writes the whole buffer (both arms): not counted
            plan = [next(it) for _ in range(args.adds)] if v > 1 else []
            for k in (list(bufs) if v % 2 else list(bufs)[::-1]):  # the arms' order alternates
                buf = bufs[k]
                rng = np.random.default_rng(v)
                for i in plan:
                    buf.add(chunks[i:i + 6])
                    if prioritized:
                        buf.sample(32, n_step=1)
                        buf.update_priorities(rng.random(32).astype(np.float32) * 3)
                with collections_paused():  # as the callback's save() captures
                    t = time.perf_counter()
                    states = capture(k)
                    ms[k].append((time.perf_counter() - t) * 1e3)
                files[k], nbytes = {}, 0
                for name, st in states.items():
                    files[k][name], n = write_append_only(tiers[k], v, name, 0, flatten(st, state_name=name),
                                                          base[k].get(name, []))
                    nbytes += n
                base[k] = files[k]
                written[k].append(nbytes)
            print(f"  version {v}: " + ", ".join(f"{k} {written[k][-1]:,} bytes in {ms[k][-1]:.0f} ms" for k in bufs),
                  flush=True)
        restore_s, equal = {}, {}
        for k, buf in bufs.items():
            back = {}
            t = time.perf_counter()
            for name, fs in files[k].items():
                b, _, _ = read_files([tiers[k]], fs)
                back[name] = decode_files(fs, b, name=name)
            fresh = _make(args.buffer, capacity=args.rows, seed=7)
            restore_journal(fresh, back[jn.STATE_NAME])
            restore_s[k] = time.perf_counter() - t
            diffs = differences(buf, fresh)
            equal[k] = not diffs
            if diffs:
                print(f"  {k}: restored buffer differs: {diffs[:5]}", flush=True)
        same = differences(bufs[INC], bufs[FULL])
        if same:
            print(f"  the two arms' buffers differ (they should not): {same[:5]}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    new_rows = 6 * 20 * args.adds  # timesteps added between two saves (at most: chunks end early when episodes do)
    print(f"\n{args.buffer} buffer, {len(bufs[INC]):,} rows, {args.saves} saves of {args.adds} add() calls "
          f"(~{new_rows:,} new timesteps) each; the two arms' buffers equal: {'yes' if not same else 'NO'}\n")
    print("| save | capture ms per save (median) | bytes written per save (median) | restore s (read + rebuild) "
          "| restored equal |")
    print("|---|---|---|---|---|")
    for k in bufs:
        print(f"| {k} | {statistics.median(ms[k][1:]):.1f} | {int(statistics.median(written[k][1:])):,} "
              f"| {restore_s[k]:.2f} | {'yes' if equal[k] else 'NO'} |")
    i, f = INC, FULL
    print(f"| {i} / {f} | {statistics.median(ms[i][1:]) / statistics.median(ms[f][1:]):.3g}x "
          f"| {statistics.median(written[i][1:]) / statistics.median(written[f][1:]):.3g}x "
          f"| {restore_s[i] / restore_s[f]:.2f}x | |")
    print(f"\nfirst version (the whole buffer in both: the fill's add() records / a full capture): "
          f"{i} {written[i][0]:,} bytes in {ms[i][0]:.0f} ms, {f} {written[f][0]:,} bytes in {ms[f][0]:.0f} ms")


if __name__ == "__main__":
    main()
