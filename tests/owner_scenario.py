"""A driver of its own (a subprocess) for the ownership tests: creates a run, saves version 1,
then saves again once told to (a file appears), and prints what happened to that save.

    python owner_scenario.py LOCAL_DIR RUN GO_FILE [ADDRESS] [--exit-without-shutdown]
ADDRESS: join that Ray cluster as a new job (default: start a cluster of its own)."""
import os
import sys
import time

import numpy as np
import ray

import ray_ckpt as rc

local_dir, run, go = sys.argv[1:4]
address = sys.argv[4] if len(sys.argv) > 4 and not sys.argv[4].startswith("--") else None
if address:
    ray.init(address=address, log_to_driver=False)
else:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # its own, always
state = {"w": np.zeros(8, np.float32)}  # numpy, not torch: this driver starts ~3 s sooner
eng = rc.CheckpointEngine.create(run, local_dir=local_dir, critical_writers=1, best_effort_writers=0,
                                 critical_cpus=0.05)
eng.register("policy", lambda: state, loader=lambda s: None)
eng.save(1).result(timeout=120)
print("SAVED 1", flush=True)
if "--exit-without-shutdown" in sys.argv:
    os._exit(0)  # a driver that dies: its job ends, its owner record stays behind
deadline = time.time() + 180
while not os.path.exists(go):
    assert time.time() < deadline, "never told to go on"
    time.sleep(0.05)
state["w"] = np.full(8, 6.0, np.float32)
try:
    eng.save(6).result(timeout=120)
    print("COMMITTED 6", flush=True)
except rc.SaveError as exc:
    print(f"REFUSED {exc}", flush=True)
eng.shutdown()
