"""Goodput at scale, simulated from costs measured here (issue 45, part 3).

    python benchmarks/goodput_sim.py [--costs benchmarks/goodput_costs.json] [--nodes 1000]
                                     [--hours 24] [--seed 0]

``benchmarks/goodput.py`` measures a training job under preemptions on a few Ray nodes of this
machine; it cannot reach 1,000 nodes. This script replays the same arithmetic at a chosen scale
with a seeded Monte-Carlo run of preemptions, fed with the costs ``goodput.py`` measured
(``goodput_costs.json``; every figure can be overridden on the command line, and the table says
where each one came from).

Goodput = steps of progress kept at the end of ``--hours`` of wall time ÷ the steps the same job
makes in that time with no faults and no checkpoints.

The model, and what it leaves out (printed beside the figures):

* Preemptions arrive as a Poisson process, ``rate`` per node-hour, on every node alike. A share
  ``notice_share`` of them come with a notice ``notice_s`` before the node goes; the rest take the
  node at once.
* The job is one learner group of ``learner_nodes`` nodes and ``nodes - learner_nodes`` rollout
  nodes. Two shapes are simulated: **colocated** (every node holds a learner shard, as verl's and
  OpenRLHF's hybrid engines do: every preemption stops the job) and **disaggregated** (a tenth of
  the nodes learn, the rest generate rollouts). A learner node lost stops the whole job until the
  group is back and restored; a rollout node lost takes its share of the sampling away until its
  replacement is up (the job runs at the share of rollout nodes alive, in expectation) and costs
  the same in every arm.
* Arms. ``none``: no checkpoints, every learner loss starts from step 0. ``framework``: a blocking
  save every ``every`` steps that costs ``framework_save_pause_s`` of the loop, restored from the
  remote tier; notices unused. ``ray_ckpt``: the same cadence at ray_ckpt's pause
  ``save_pause_s``, restored from the remote tier, notices unused. ``ray_ckpt+notice``: the same,
  and a notice brings a save at the next step boundary (when the notice is at least
  ``notice_to_saved_s``), then one again each time the newest is off the node
  (``save_if_preempted``): what is kept is the step in progress ``notice_to_saved_s`` before the
  node goes, or the first save's if that is more; and it asks for the replacement node at the
  notice. ``ray_ckpt every step``: a save every step with a peer replica (restored from the peer)
  and notices used.
* After a learner loss the job is down for: without a notice ``detect_s + replace_node_s +
  rejoin_s + restore``; with a notice used, ``max(0, replace_node_s - notice_s) + rejoin_s +
  restore`` (the new node is asked for when the notice arrives). ``rejoin_s`` is restarting the
  learner processes and re-forming their group, which no checkpointer removes. Progress since the
  newest save that committed before the loss is lost; a loss during a restart only extends it.
* Left out: the time a version takes to become durable after its save returns (a loss in that
  window loses one more interval), correlated preemptions (a whole zone at once), stragglers,
  storage bandwidth shared by 1,000 restoring nodes, and time lost waiting for capacity.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))

# What each cost means, and the value used when goodput_costs.json does not carry it. The
# defaults are this repository's own measurements on the 2-core build VM (benchmarks/RESULTS.md:
# recovery.py for restore and node-lost figures at 1 GB, suite.py for the save pause).
COSTS = {
    "step_s": (10.0, "one training step (an RL iteration: rollouts + update) at full strength"),
    "save_pause_s": (0.25, "ray_ckpt: the loop's pause per save (one copy into Ray's object store)"),
    "save_pause_every_step_s": (0.25, "ray_ckpt saving every step: the loop's pause per save (each copies "
                                      "what changed since the step before)"),
    "framework_save_pause_s": (6.0, "a blocking save of the same state to the remote tier (torch.save + upload)"),
    "restore_local_s": (0.4, "restore from the node-local tier"),
    "restore_peer_s": (3.1, "restore from a peer replica"),
    "restore_remote_s": (3.1, "restore from the remote tier"),
    "notice_to_saved_s": (10.0, "from a preemption notice to its first save committed (a step + a save); "
                                "the lag of the saves that follow it"),
    "replace_node_s": (16.0, "from asking for a node to the node joined"),
    "detect_s": (10.0, "until a node taken without notice is known dead"),
    "rejoin_s": (5.0, "restarting the learner processes and re-forming their group"),
}


@dataclass(frozen=True)
class Costs:
    step_s: float
    save_pause_s: float
    save_pause_every_step_s: float
    framework_save_pause_s: float
    restore_local_s: float
    restore_peer_s: float
    restore_remote_s: float
    notice_to_saved_s: float
    replace_node_s: float
    detect_s: float
    rejoin_s: float


@dataclass(frozen=True)
class Arm:
    name: str
    every: int | None  # steps between saves; None: never
    pause_s: str  # the Costs field of the pause per save
    restore_s: str  # the Costs field of the restore
    uses_notice: bool


@dataclass(frozen=True)
class Cluster:
    nodes: int
    learner_nodes: int
    rate_per_node_hour: float
    notice_share: float
    notice_s: float


def arms(every: int) -> list[Arm]:
    return [
        Arm("none", None, "save_pause_s", "restore_remote_s", False),
        Arm(f"framework, every {every}", every, "framework_save_pause_s", "restore_remote_s", False),
        Arm(f"ray_ckpt, every {every}", every, "save_pause_s", "restore_remote_s", False),
        Arm(f"ray_ckpt+notice, every {every}", every, "save_pause_s", "restore_remote_s", True),
        Arm("ray_ckpt every step, peer, notice", 1, "save_pause_every_step_s", "restore_peer_s", True),
    ]


def simulate(arm: Arm, cluster: Cluster, costs: Costs, hours: float, seed: int) -> float:
    """Goodput of one arm: steps kept at the end ÷ steps of a fault-free, checkpoint-free job."""
    rng = random.Random(seed)
    horizon = hours * 3600.0
    every = arm.every
    pause = getattr(costs, arm.pause_s) if every else 0.0
    restore = getattr(costs, arm.restore_s)
    # seconds per step while running, save pauses spread over their interval
    step_time = costs.step_s + (pause / every if every else 0.0)
    rollout_nodes = cluster.nodes - cluster.learner_nodes
    rate = cluster.rate_per_node_hour / 3600.0  # per node-second

    def node_down_s(noticed: bool) -> float:
        if noticed:
            return max(0.0, costs.replace_node_s - cluster.notice_s)
        return costs.detect_s + costs.replace_node_s

    if rollout_nodes > 0:
        # a rollout node is down (rate x time down) of the time; the job samples at the share alive
        notice_used = arm.uses_notice
        mean_down = (cluster.notice_share * node_down_s(notice_used)
                     + (1 - cluster.notice_share) * node_down_s(False))
        step_time /= max(1e-9, 1.0 - min(1.0, rate * mean_down))

    learner_rate = rate * cluster.learner_nodes  # learner losses per second, all learner nodes
    progress = 0.0  # steps made since the start, as of `clock`, kept if nothing is lost
    committed = 0.0  # steps the newest committed save holds
    clock = 0.0  # the job's clock: runs from `up_at`
    up_at = 0.0  # the job trains from here on

    def advance(until: float) -> None:
        nonlocal progress, committed, clock
        start = max(clock, up_at)
        if until > start:
            progress += (until - start) / step_time
            if every:
                committed = max(committed, math.floor(progress / every) * every)
        clock = max(clock, until)

    t = 0.0
    while True:
        t += rng.expovariate(learner_rate) if learner_rate > 0 else horizon + 1
        if t >= horizon:
            advance(horizon)
            break
        noticed = rng.random() < cluster.notice_share
        use_notice = noticed and arm.uses_notice
        if use_notice and cluster.notice_s >= costs.notice_to_saved_s and t - cluster.notice_s >= up_at:
            # the first save: the step in progress at the notice, committed before the deadline;
            # the next ones follow it, each once the one before is off the node
            advance(t - cluster.notice_s)
            first = min(progress + 1.0, progress + cluster.notice_s / step_time)
            advance(t - costs.notice_to_saved_s)
            newest = progress
            advance(t)
            committed = max(committed, math.floor(max(first, newest)))
        else:
            advance(t)
        down = node_down_s(use_notice) + costs.rejoin_s + restore
        if t < up_at:  # lost during a restart: the restart takes longer, nothing more is lost
            up_at = max(up_at, t + down)
            continue
        progress = committed if every else 0.0
        up_at = t + down
    return progress / (horizon / costs.step_s)


def highest_rate(arm: Arm, nodes: int, learners: int, notice_s: float, costs: Costs, seed: int,
                 target: float = 0.97) -> float:
    """Bisect (in log space) the preemption rate at which ``arm`` falls to ``target``."""
    def good(rate: float) -> bool:
        hours = max(24.0, 2000.0 / (rate * learners))
        return simulate(arm, Cluster(nodes, learners, rate, 1.0, notice_s), costs, hours, seed) >= target
    lo, hi = 1e-6, 10.0
    if not good(lo):
        return 0.0
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if good(mid) else (lo, mid)
    return lo


def load_costs(path: str | None, overrides: dict) -> tuple[Costs, dict]:
    measured = {}
    if path and os.path.exists(path):
        with open(path) as f:
            raw = json.load(f)
        measured = {k: raw[k] for k in ("step_s", "save_pause_s", "framework_save_pause_s",
                                        "notice_to_saved_s", "replace_node_s") if k in raw}
        for key in ("detect_s", "save_pause_every_step_s"):  # goodput.py keeps these among its notes
            if isinstance((raw.get("notes") or {}).get(key), (int, float)):
                measured[key] = raw["notes"][key]
        for tier, value in (raw.get("restore_s") or {}).items():
            measured[f"restore_{tier}_s"] = value
        measured = {k: float(v) for k, v in measured.items() if v is not None and k in COSTS}
    values, source = {}, {}
    for key, (default, _) in COSTS.items():
        if overrides.get(key) is not None:
            values[key], source[key] = float(overrides[key]), "command line"
        elif key in measured:
            values[key], source[key] = measured[key], os.path.relpath(path, os.getcwd())
        else:
            values[key], source[key] = default, "default (RESULTS.md figures)"
    return Costs(**values), source


def table(rows: list[list[str]]) -> str:
    head, *body = rows
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--costs", default=os.path.join(HERE, "goodput_costs.json"))
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--learner-share", type=float, default=0.1,
                   help="share of the nodes that learn in the disaggregated shape")
    p.add_argument("--rates", default="0.01,0.1,1", help="preemptions per node-hour")
    p.add_argument("--notice-s", type=float, default=30.0)
    p.add_argument("--every", type=int, default=10, help="the cadence of the cadence arms, in steps")
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--seed", type=int, default=0)
    for key, (_, help_) in COSTS.items():
        p.add_argument("--" + key.replace("_", "-"), type=float, default=None, help=help_)
    a = p.parse_args(argv)
    costs, source = load_costs(a.costs, {k: getattr(a, k) for k in COSTS})
    rates = [float(r) for r in a.rates.split(",")]

    print(f"goodput_sim: {a.nodes} nodes, {a.hours:g} h simulated per cell, seed {a.seed}, "
          f"notices {a.notice_s:g} s, cadence arms every {a.every} steps\n")
    print(table([["cost", "s", "from", "what"]]
                + [[k, f"{getattr(costs, k):g}", source[k], COSTS[k][1]] for k in COSTS]))
    shapes = [("colocated", a.nodes), ("disaggregated", max(1, round(a.nodes * a.learner_share)))]
    best = {}
    for shape, learners in shapes:
        head = ["arm"] + [f"{r:g}/node-h, {'no notice' if s == 0 else f'{a.notice_s:g} s notice'}"
                          for r in rates for s in (0.0, 1.0)]
        rows = [head]
        for arm in arms(a.every):
            row = [arm.name]
            for r in rates:
                for share in (0.0, 1.0):
                    cl = Cluster(a.nodes, learners, r, share, a.notice_s)
                    g = simulate(arm, cl, costs, a.hours, a.seed)
                    best[(shape, r, share, arm.name)] = g
                    row.append(f"{100 * g:.1f} %")
            rows.append(row)
        print(f"\n### {shape}: {learners} learner node(s), {a.nodes - learners} rollout node(s)\n")
        print(table(rows))

    print("\nthe highest preemption rate (per node-hour) at which an arm keeps >= 97 % "
          f"({a.notice_s:g} s notices; each rate simulated over >= 2,000 learner losses):\n")
    rows = [["arm"] + [shape for shape, _ in shapes]]
    for arm in arms(a.every)[1:]:
        rows.append([arm.name] + [f"{highest_rate(arm, a.nodes, learners, a.notice_s, costs, a.seed):.3g}"
                                  for _, learners in shapes])
    print(table(rows))

    goal_rate = 1.0 if 1.0 in rates else rates[-1]
    print(f"\ngoal (issue 45): >= 97 % at {a.nodes} nodes, {goal_rate:g} preemption per node-hour, "
          f"{a.notice_s:g} s notices:")
    for shape, _ in shapes:
        g = best[(shape, goal_rate, 1.0, "ray_ckpt every step, peer, notice")]
        print(f"  {shape:14s} ray_ckpt every step, peer, notice: {100 * g:.1f} % "
              f"({'met' if g >= 0.97 else 'not met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
