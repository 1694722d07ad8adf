"""ray_ckpt demo: a small but real RL run that is preempted mid-way and resumes bit-identically.

The demo itself ships inside the package (``ray_ckpt/cli/demo_run.py``, run by ``ray-ckpt demo`` or
``python -m ray_ckpt.demo``); this file runs it from a source checkout:

    python examples/demo.py [--steps 30 --save-every 5 --kill-at 17 --dir DIR]
"""
from ray_ckpt.demo import main

if __name__ == "__main__":
    raise SystemExit(main(prog="examples/demo.py"))
