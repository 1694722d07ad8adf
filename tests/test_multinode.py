"""Several nodes on one machine: node-affine writers, per-node local tiers, preemption across nodes."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_preemption_across_nodes_restores_from_remote(tmp_path):
    # its own process: a multi-node Cluster needs its own ray.init, apart from the session's instance
    proc = subprocess.run([sys.executable, os.path.join(HERE, "multinode_scenario.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0 and "MULTINODE OK" in proc.stdout, out
    assert "tier=remote" in proc.stdout
