"""What the sharded-state tests (test_fsdp2.py, test_dcp.py) share: a free port for a gloo group's
rendezvous, joining and leaving a group of rank actors, a bit-exact tensor comparison, and the
small MLP their FSDP2 ranks train.

tests/ is not importable in Ray workers: a test module that ships these into rank actors registers
this module by value too (``ray.cloudpickle.register_pickle_by_value(gloo_util)``)."""
from __future__ import annotations

import os
import random
import socket
import time

import torch


def free_port() -> int:
    """A port nobody uses now, for ``init_process_group(init_method="tcp://127.0.0.1:PORT")``.

    Taken below the kernel's ephemeral range (and above Ray's worker ports, 10002-19999): a port the
    kernel hands out (bind to port 0) is also what it gives the next outgoing connection as its
    source port, and Ray opens many, so the rendezvous' listen failed with EADDRINUSE now and then."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(1000):
        port = rng.randrange(20000, max(ephemeral, 20001))
        with socket.socket() as s:
            try:
                s.bind(("", port))  # the rendezvous' store listens on every address
            except OSError:
                continue
        return port
    raise RuntimeError("no free TCP port below the ephemeral range")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN payloads and -0.0 included, unlike ``torch.equal``)."""
    return a.shape == b.shape and a.dtype == b.dtype and \
        a.reshape(-1).view(torch.uint8).numpy().tobytes() == b.reshape(-1).view(torch.uint8).numpy().tobytes()


def mlp(seed: int) -> torch.nn.Module:
    """Rows 10, 7, 5: uneven on 2, 3, 4 and 8 ranks; a bias of 5 leaves empty chunks on 4 and 8 ranks."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 7),
                               torch.nn.ReLU(), torch.nn.Linear(7, 5))


def group(pool: dict, world: int, reverse: bool = False) -> list:
    """The first (or last) ``world`` actors of ``pool["actors"]`` joined in a new gloo group, rank =
    position (each actor has ``join(rank, world, port)``)."""
    import ray

    actors = pool["actors"][::-1][:world] if reverse else pool["actors"][:world]
    port = free_port()
    ray.get([a.join.remote(r, world, port) for r, a in enumerate(actors)], timeout=60)
    return actors


def leave(actors: list) -> None:
    import ray

    ray.get([a.leave.remote() for a in actors], timeout=60)
