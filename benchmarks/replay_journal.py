"""RLlib replay buffers: the journal (format /6, ``replay_journal``) against the format it replaces
(/4: ``replay`` rows + the ``replay_meta`` log), side by side on the same buffer contents.

    python benchmarks/replay_journal.py [--rows 40000] [--saves 8] [--adds 10] [--buffer prioritized]

Two buffers of the same class are filled with the same episodes (copies of sampled-like CartPole
chunks, as ``rllib_iteration.prefill --clone`` does), one journaled from its start (the callback
installs the recorders when the algorithm starts), one saved the old way. Then each save round
gives both the same ``--adds`` add() calls of fresh chunks (8 envs, 20-step chunks, evicting)
with a sample + update_priorities after each, and saves both: the capture timed (what ``save()``
adds to the training thread), the states written version after version as the engine's writers
write them (append-only over the previous version, to a local directory) and their bytes counted.
At the end the newest version of each is read back and restored into a fresh buffer, timed, and
compared with the original (every attribute, as the tests do).

Printed: one table, the two formats side by side, and their ratios. No Ray cluster: the capture,
the writer's encoding and the restore are the parts that differ; the engine around them is the
same for both (``rllib_rate.py`` measures the whole train() rate).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=40_000, help="buffer capacity; filled to it before the saves")
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--adds", type=int, default=10, help="add() calls (6 chunks each) between two saves")
    ap.add_argument("--buffer", default="prioritized", choices=["plain", "prioritized"])
    args = ap.parse_args()

    import numpy as np
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    from test_rllib_replay import _make, _sa_chunks

    from ray_ckpt.formats.tree import flatten
    from ray_ckpt.integrations.rllib.journal import journal as jn
    from ray_ckpt.integrations.rllib.journal.restore import restore_journal
    from ray_ckpt.integrations.rllib.replay import compare, incremental_capture, incremental_restore, row_ids, two_state
    from ray_ckpt.storage.checkpoint_io import decode_files, read_files, write_append_only
    from ray_ckpt.storage.tier import Tier

    prioritized = args.buffer == "prioritized"
    chunks = _sa_chunks(0, n_envs=8, steps=20 * 6 * args.adds * (args.saves + 1) // 8 + 40, chunk=20)
    done = [c.get_state() for c in _sa_chunks(1, n_envs=8, steps=400, chunk=1000) if c.is_done]

    def filled(journaled):
        buf = _make(args.buffer, capacity=args.rows)
        if journaled:
            jn.journal_of(buf)
        while len(buf) < args.rows - 2000:
            buf.add([SingleAgentEpisode.from_state({**st, "id_": uuid.uuid4().hex}) for st in done])
        return buf

    t0 = time.perf_counter()
    new_buf, old_buf = filled(True), filled(False)
    print(f"filled two {args.buffer} buffers of {len(new_buf):,} rows ({new_buf.get_num_episodes():,} episodes) "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)
    journal, rid = jn.journal_of(new_buf), row_ids.row_ids_of(old_buf)
    captures = {"journal": lambda: {jn.STATE_NAME: journal.capture(new_buf)},
                "format /4": lambda: incremental_capture.capture_states(old_buf, rid)}
    bufs = {"journal": new_buf, "format /4": old_buf}
    root = tempfile.mkdtemp(prefix="replay_journal_")
    tiers = {k: Tier(os.path.join(root, k.replace(" ", "").replace("/", "")), "local") for k in captures}
    base = {k: {} for k in captures}
    ms = {k: [] for k in captures}
    written = {k: [] for k in captures}
    files = {}
    try:
        it = iter(range(0, len(chunks) - 6, 6))
        for v in range(1, args.saves + 2):  # version 1 is the whole buffer (both formats): not counted
            plan = [next(it) for _ in range(args.adds)] if v > 1 else []
            for k, buf in bufs.items():
                rng = np.random.default_rng(v)
                for i in plan:
                    buf.add(chunks[i:i + 6])
                    if prioritized:
                        buf.sample(32, n_step=1)
                        buf.update_priorities(rng.random(32).astype(np.float32) * 3)
                t = time.perf_counter()
                states = captures[k]()
                ms[k].append((time.perf_counter() - t) * 1e3)
                files[k], nbytes = {}, 0
                for name, st in states.items():
                    files[k][name], n = write_append_only(tiers[k], v, name, 0, flatten(st, state_name=name),
                                                          base[k].get(name, []))
                    nbytes += n
                base[k] = files[k]
                written[k].append(nbytes)
        restore_s, equal = {}, {}
        for k, buf in bufs.items():
            back = {}
            t = time.perf_counter()
            for name, fs in files[k].items():
                b, _, _ = read_files([tiers[k]], fs)
                back[name] = decode_files(fs, b, name=name)
            fresh = _make(args.buffer, capacity=args.rows, seed=7)
            if k == "journal":
                restore_journal(fresh, back[jn.STATE_NAME])
            else:
                replay, meta, _ = incremental_restore.states_to_v1(back)
                two_state.restore_replay(fresh, replay, meta)
            restore_s[k] = time.perf_counter() - t
            equal[k] = compare.buffer_state_equal(buf, fresh) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)

    new_rows = 6 * 20 * args.adds  # timesteps added between two saves (at most: chunks end early when episodes do)
    print(f"\n{args.buffer} buffer, {len(new_buf):,} rows, {args.saves} saves of {args.adds} add() calls "
          f"(~{new_rows:,} new timesteps) each\n")
    print("| format | capture ms per save (median) | bytes written per save (median) | restore s (read + rebuild) "
          "| restored equal |")
    print("|---|---|---|---|---|")
    for k in captures:
        print(f"| {k} | {statistics.median(ms[k][1:]):.1f} | {int(statistics.median(written[k][1:])):,} "
              f"| {restore_s[k]:.2f} | {'yes' if equal[k] else 'NO'} |")
    j, o = "journal", "format /4"
    print(f"| journal / format /4 | {statistics.median(ms[j][1:]) / statistics.median(ms[o][1:]):.2f}x "
          f"| {statistics.median(written[j][1:]) / statistics.median(written[o][1:]):.2f}x "
          f"| {restore_s[j] / restore_s[o]:.2f}x | |")
    print(f"\nfirst version (the whole buffer): journal {written[j][0]:,} bytes in {ms[j][0]:.0f} ms, "
          f"format /4 {written[o][0]:,} bytes in {ms[o][0]:.0f} ms")


if __name__ == "__main__":
    main()
