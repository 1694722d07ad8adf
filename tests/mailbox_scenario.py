"""A run's snapshot mailbox lost with its node, on a real 2-node Ray cluster on one machine.

Run by tests/test_preemption.py in its own process (a Cluster needs its own ray.init). Prints
"MAILBOX OK" and exits 0 when every check holds; an AssertionError otherwise.

What it reproduces (benchmarks/goodput.py, RLlib job): the mailbox, created by the run's
coordinator, ran on a learner's node; that node was preempted, and the learner restarted on a
replacement could not register its states: the mailbox Ray handed out by name was the dead one
("ActorDiedError ... its node has died"). Here the mailbox is put on the worker node, held by the
coordinator as the coordinator holds it; the node is removed; a rank's overlapped register then
gets a live mailbox, on the coordinator's node, and its save commits.
"""
import os
import sys
import tempfile
import time

import ray
import torch
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import ray_ckpt as rc  # noqa: E402
from ray_ckpt.capture import mailbox  # noqa: E402
from ray_ckpt.protocol import NAMESPACE, actor_name  # noqa: E402
from ray_ckpt.ray_internals import actor_id_hex  # noqa: E402


def _put_on(coordinator, name: str, node: str):
    """Runs in the coordinator: its mailbox started on ``node`` and held as _spawn_mailbox holds it."""
    mb = mailbox.SnapshotMailbox.options(
        name=name, namespace=mailbox.MAILBOX_NAMESPACE, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(nice=0)
    coordinator.__dict__.setdefault("_held_mailboxes", {})[name] = mb
    return mb


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="rc_mailbox_")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    worker = cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        head = ray.get_runtime_context().get_node_id()
        run = "mailbox-lost"
        engine = rc.CheckpointEngine.create(run, local_dir=os.path.join(root, "{node_id}"), critical_writers=1,
                                            best_effort_writers=0, overlap=True)
        coord = ray.get_actor(actor_name(run), namespace=NAMESPACE)
        name = mailbox.mailbox_name(run)
        deadline = time.monotonic() + 60  # create() starts the mailbox without waiting: let it start
        while True:
            try:
                ray.get(ray.get_actor(name, namespace=mailbox.MAILBOX_NAMESPACE).__ray_ready__.remote(), timeout=30)
                break
            except ValueError:
                assert time.monotonic() < deadline, "the run's mailbox did not start within 60 s"
                time.sleep(0.2)
        ray.kill(ray.get_actor(name, namespace=mailbox.MAILBOX_NAMESPACE), no_restart=True)
        deadline = time.monotonic() + 30
        while True:  # the name is free once the kill is through
            try:
                ray.get_actor(name, namespace=mailbox.MAILBOX_NAMESPACE)
            except ValueError:
                break
            assert time.monotonic() < deadline, "the killed mailbox's name was not freed within 30 s"
            time.sleep(0.2)
        old = ray.get(coord.__ray_call__.remote(_put_on, name, worker.node_id), timeout=60)
        ray.get(old.__ray_ready__.remote(), timeout=60)
        old_id = actor_id_hex(old)
        print(f"mailbox {old_id[:8]} on the worker node {worker.node_id[:12]}", flush=True)

        cluster.remove_node(worker, allow_graceful=False)  # the preemption: the mailbox goes with it
        deadline = time.monotonic() + 60
        while any(n["NodeID"] == worker.node_id and n["Alive"] for n in ray.nodes()):
            assert time.monotonic() < deadline, "the removed node still listed alive after 60 s"
            time.sleep(0.5)

        # a rank restarted elsewhere registers an overlapped state: open_mailbox() by name
        mb = mailbox.open_mailbox(run, timeout=60)
        assert actor_id_hex(mb) != old_id, "open_mailbox handed out the mailbox that died with its node"
        node = ray.get(mb.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=60)
        assert node == head, f"the new mailbox runs on {node[:12]}, not beside its coordinator on {head[:12]}"
        w = torch.arange(1000, dtype=torch.float32)
        engine.register("w", lambda: {"w": w}, loader=lambda st: None, overlap=True)
        engine.save(1).wait(timeout=120)
        assert torch.equal(engine.load("w", step=1)["w"], w)
        engine.shutdown(timeout=60)
        print("MAILBOX OK", flush=True)
        return 0
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
