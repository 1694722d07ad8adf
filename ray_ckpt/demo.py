"""``python -m ray_ckpt.demo``: the preemption demo (``cli/demo_run.py``; ``ray-ckpt demo`` runs the same)."""
from .cli.demo_run import main

if __name__ == "__main__":
    raise SystemExit(main())
