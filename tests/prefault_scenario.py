"""Run by test_object_store.py in its own process: a small Ray instance, one learner saved by one
engine per setting of ``prefault_object_store`` (off first, so that its figures are those of a
process that never mapped the store; then on, in the same process: one actor start fewer); prints
one JSON line of what a user could observe."""
import json
import os
import sys
import tempfile
import time

import numpy as np
import ray

import ray_ckpt as rc
from ray_ckpt.capture.object_store import prefault_status, store_regions

STORE = 256 << 20


def resident(actor, wait_s: float = 0.0) -> dict:
    """Runs in the learner: its prefault status and how much of its object-store mapping is resident."""
    status = prefault_status(wait_s).__dict__.copy()
    (lo, hi), = store_regions()
    rss, found = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                found = int(head.split("-")[0], 16) == lo
            elif found and head == "Rss:":
                rss = int(line.split()[1]) * 1024
                break
    return {"status": status, "resident": rss, "size": hi - lo}


@ray.remote(num_cpus=0.1, max_restarts=1, max_task_retries=3)
class Learner:
    def __init__(self):
        self.state = {"w": np.random.default_rng(0).standard_normal(2 << 20).astype(np.float32)}  # 8 MB

    def ckpt_get_state(self, name):
        return self.state

    def ckpt_set_state(self, name, state):
        self.state = {k: np.array(v) for k, v in state.items()}

    def bump(self):
        self.state["w"] += 1

    def get(self):
        return self.state["w"].tobytes()

    def pid(self):
        return os.getpid()


def run(learner, prefault: bool, root: str) -> dict:
    eng = rc.CheckpointEngine.create(f"prefault{int(prefault)}", local_dir=root, critical_writers=1,
                                     best_effort_writers=0, critical_cpus=0.1, prefault_object_store=prefault)
    eng.register("policy", learner)
    before = ray.get(learner.__ray_call__.remote(resident, 60 if prefault else 0), timeout=90)
    saved = ray.get(learner.get.remote())
    eng.save(1).wait(timeout=60)
    after = ray.get(learner.__ray_call__.remote(resident), timeout=60)
    ray.get(learner.bump.remote())
    eng.restore()
    restored = ray.get(learner.get.remote())
    restart = None
    if prefault:  # preempted: Ray restarts the learner in a new process, which restores first
        pid = ray.get(learner.pid.remote())
        ray.kill(learner, no_restart=False)
        deadline = time.time() + 60  # ray.kill is asynchronous: restore into the new process, not the old
        while True:
            try:
                if ray.get(learner.pid.remote(), timeout=10) != pid:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            assert time.time() < deadline, "the learner was not restarted in time"
            time.sleep(0.1)
        eng.restore()
        after_restart = ray.get(learner.__ray_call__.remote(resident, 60), timeout=90)
        restart = {"new_process": ray.get(learner.pid.remote()) != pid,
                   "restored_equal": ray.get(learner.get.remote()) == saved,
                   "resident": after_restart["resident"], "status": after_restart["status"]}
    eng.shutdown()
    return {"status": before["status"] if prefault else None, "store_mapping": before["size"],
            "resident_before_save": before["resident"], "resident_after_save": after["resident"],
            "off_status": None if prefault else before["status"], "restored_equal": restored == saved,
            "restart": restart}


def main() -> int:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=STORE)
    try:
        learner = Learner.remote()  # first: its process starts while the first engine's do
        with tempfile.TemporaryDirectory() as root:
            off = run(learner, False, os.path.join(root, "b"))  # before anything mapped the whole store
            on = run(learner, True, os.path.join(root, "a"))
        ray.kill(learner)
    finally:
        ray.shutdown()
    print(json.dumps({"store_bytes": on["store_mapping"], "on": on, "off": off}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
