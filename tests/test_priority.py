"""The background processes (coordinator, snapshot mailbox, writers) run every thread below
training's CPU priority: ``ray_ckpt/capture/priority.py``."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import ray

pytestmark = pytest.mark.timeout(180)


def test_every_thread_of_the_process_is_lowered_not_only_the_caller():
    """In a process of its own (the test's must keep its priority): a thread that was running
    before the call is lowered too, and one started afterwards inherits it."""
    code = textwrap.dedent("""
        import json, os, threading
        from ray_ckpt.capture.priority import lower_process_priority

        def nice():
            with open(f"/proc/self/task/{threading.get_native_id()}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[16])

        go, seen = threading.Event(), {}
        def early():  # started before the call, as Ray's own threads are before an actor's __init__
            go.wait(10); seen["early"] = nice()
        t = threading.Thread(target=early); t.start()
        base = nice()
        n = lower_process_priority(4)
        go.set(); t.join()
        later = threading.Thread(target=lambda: seen.setdefault("later", nice())); later.start(); later.join()
        print(json.dumps({"base": base, "n": n, "main": nice(), **seen}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = min(19, got["base"] + 4)
    assert got["n"] >= 2
    assert (got["main"], got["early"], got["later"]) == (want, want, want), got


def test_the_coordinator_the_mailbox_and_the_writers_run_every_thread_below_training(engine_factory, run_name):
    """Below training wherever it runs: the driver (nice 0) and a Ray actor's task thread (an env
    runner sampling, a remote learner: Ray runs those at ``RAY_worker_niceness``, 15), so every
    thread of theirs -- Ray's own core-worker threads too, which Ray starts at 0 -- is at least
    ``critical_nice`` (``best_effort_nice``) below the actor's task thread."""
    from ray_ckpt.capture.mailbox import MAILBOX_NAMESPACE, mailbox_name

    def nices(_=None) -> dict:  # nested: sent by value (the actors cannot import this module)
        import os as _os

        out = {}
        for tid in _os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    out[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
            except OSError:
                pass
        return out

    @ray.remote(num_cpus=0)
    class Trainer:  # what an env runner or a remote learner is to Ray
        def task_thread_nice(self):
            import threading

            return nices()[threading.get_native_id()]

    trainer = Trainer.remote()
    import threading

    training = max(ray.get(trainer.task_thread_nice.remote(), timeout=60), nices()[threading.get_native_id()])
    eng = engine_factory(overlap=True, critical_writers=1, best_effort_writers=1)
    eng.register("w", lambda: {"x": __import__("numpy").arange(4)})
    assert eng.save(1).wait(60).version == 1
    coordinator = eng._coordinator
    mailbox = ray.get_actor(mailbox_name(run_name), namespace=MAILBOX_NAMESPACE)
    writers = ray.get(coordinator.writers.remote())
    seen = {"coordinator": ray.get(coordinator.__ray_call__.remote(nices), timeout=60),
            "mailbox": ray.get(mailbox.__ray_call__.remote(nices), timeout=60),
            "critical writer": ray.get(writers["critical"][0].__ray_call__.remote(nices), timeout=60),
            "best-effort writer": ray.get(writers["best_effort"][0].__ray_call__.remote(nices), timeout=60)}
    offset = {"coordinator": eng.config.critical_nice, "mailbox": eng.config.critical_nice,
              "critical writer": eng.config.critical_nice, "best-effort writer": eng.config.best_effort_nice}
    for who, got in seen.items():
        want = min(19, training + offset[who])
        high = [tid for tid, n in got.items() if n < want]
        assert len(got) > 3 and not high, f"{who}: threads {high} of {len(got)} run above nice {want}: {got}"
    ray.kill(trainer)
