"""The RLlib callback under a preemption notice, on a real 2-node Ray cluster on one machine.

Run by tests/test_preemption.py in its own process (a Cluster needs its own ray.init). Prints
"RLLIB PREEMPTION OK" and exits 0 when every check holds; an AssertionError otherwise.

PPO (the example's config) saves every 3 iterations into a run with peer_replicas=1 and no remote
tier, so iteration 3's version is held in the memory of a replica holder on the worker node. That
node is drained for preemption (Ray's own ``ray drain-node``): the callback saves at the very next
iteration (4) although its cadence would wait for 6, and once only (iteration 5 is not saved: the
notice is about a replica holder's node, not the learner's parts or node, which would keep saving),
and the notice names the step saved for it.
"""
import os
import runpy
import subprocess
import sys
import tempfile
import time

import ray
from ray.cluster_utils import Cluster

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from preemption_scenario import drain, say, wait_for  # noqa: E402


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="rc_rllib_preempt_")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    worker = cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        from ray_ckpt.integrations.rllib import find_callback, make_callback, wait_for_saves

        example = runpy.run_path(os.path.join(HERE, "..", "examples", "rllib_example.py"), run_name="cfg")
        cb = make_callback("rlpre", local_dir=os.path.join(root, "local", "{node_id}"), every=3,
                           engine_options={"critical_writers": 1, "peer_replicas": 1})
        algo = example["build_config"](cb, seed=5).build_algo()
        try:
            for _ in range(3):
                algo.train()
            callback = find_callback(algo)
            engine = callback.engine
            callback.saves[3].wait(timeout=120, durability="replicated")
            holders = engine.status()["replicas"][3]
            assert holders == [worker.node_id[:12]], (holders, worker.node_id)
            say(f"iteration 3 saved; its replica held on the worker node {holders}")

            drain(cluster.address, worker.node_id, 60)
            wait_for("the notice", lambda: engine.preemption(max_age=0), 20)
            algo.train()  # iteration 4: not on the cadence (every=3), saved for the notice
            algo.train()  # iteration 5: the notice's save was taken already (the learner's node stays)
            wait_for_saves(algo, timeout=120)
            steps = [m.step for m in engine.list_checkpoints()]
            assert steps == [3, 4], steps
            notice = engine.preemption(max_age=0)
            assert notice is not None and notice.saved_step == 4, notice
            say(f"iteration 4 saved for the notice, 5 not: versions {steps}; {notice}")
        finally:
            algo.stop()
        say("RLLIB PREEMPTION OK")
        return 0
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
