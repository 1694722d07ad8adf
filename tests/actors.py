"""Provider actors used by the integration tests (real torch training, real Ray actors)."""
import os
import random

import numpy as np
import ray
import torch

import ray_ckpt as rc


class Learner:
    """A tiny policy-gradient-ish learner with its own RNG streams; deterministic given its seed."""

    def __init__(self, seed: int = 0, hidden: int = 16):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.np_rng = np.random.default_rng(seed + 2)
        self.steps = 0

    def train(self, n: int = 1) -> int:
        for _ in range(n):
            obs = torch.randn(32, 4, generator=self.gen)
            noise = torch.as_tensor(self.np_rng.normal(size=(32, 2)), dtype=torch.float32)
            loss = (self.model(obs) - noise).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.steps += 1
        return self.steps

    def ckpt_get_state(self, name):
        if name == "policy":
            return self.model.state_dict()
        if name == "optimizer":
            return self.opt.state_dict()
        if name == "rng":
            return {"torch": self.gen.get_state(), "numpy": self.np_rng.bit_generator.state, "steps": self.steps}
        raise KeyError(name)

    def ckpt_set_state(self, name, state):
        if name == "policy":
            self.model.load_state_dict(state)
        elif name == "optimizer":
            self.opt.load_state_dict(state)
        elif name == "rng":
            self.gen.set_state(state["torch"])
            self.np_rng.bit_generator.state = state["numpy"]
            self.steps = state["steps"]

    def snapshot(self):
        """Everything that must be bit-identical, as plain bytes."""
        out = {f"p.{k}": v.clone() for k, v in self.model.state_dict().items()}
        for pid, st in self.opt.state_dict()["state"].items():
            for k, v in st.items():
                out[f"o.{pid}.{k}"] = v.clone() if torch.is_tensor(v) else torch.tensor(v)
        return out

    def pid(self):
        import os

        return os.getpid()

    def node(self):
        return ray.get_runtime_context().get_node_id()


class BigState:
    """Holds a large state to make a save take a while."""

    def __init__(self, mb: int):
        self.t = torch.randn(mb * (1 << 20) // 4)

    def ckpt_get_state(self, name):
        return {"big": self.t}

    def ckpt_set_state(self, name, state):
        self.t = state["big"]

    def checksum(self):
        return float(self.t.double().sum())


class Frozen:
    """A frozen reference model: same content every save."""

    def __init__(self):
        g = torch.Generator().manual_seed(7)
        self.sd = {"w": torch.randn(256, 256, generator=g)}

    def ckpt_get_state(self, name):
        return self.sd

    def ckpt_set_state(self, name, state):
        self.sd = state


class Replay:
    """A replay buffer: equally long numpy arrays, one row per transition, filled as it trains."""

    def __init__(self, capacity: int = 5000, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.data = {"obs": np.zeros((capacity, 8, 2), np.float32), "action": np.zeros(capacity, np.int64),
                     "reward": np.zeros(capacity, np.float32), "done": np.zeros(capacity, bool)}
        self.size = 0

    def add(self, n: int):
        for k, v in self.data.items():
            new = self.rng.standard_normal((n,) + v.shape[1:]) > 0 if v.dtype == bool else \
                self.rng.standard_normal((n,) + v.shape[1:]) * 100
            v[self.size: self.size + n] = new.astype(v.dtype)
        self.size += n

    def ckpt_get_state(self, name):
        return self.data

    def ckpt_set_state(self, name, state):
        self.data = state

    def contents(self):
        return {k: v.copy() for k, v in self.data.items()}


class Flaky:
    """A state whose capture can be made to fail (a save that fails in the provider)."""

    def __init__(self):
        self.w = torch.arange(16.0)
        self.failing = False

    def set_failing(self, failing: bool):
        self.failing = failing

    def ckpt_get_state(self, name):
        if self.failing:
            raise RuntimeError("capture failed on purpose")
        self.w += 1
        return {"w": self.w}

    def ckpt_set_state(self, name, state):
        if self.failing:
            raise RuntimeError("set_state refused on purpose")
        self.w = state["w"]

    def value(self):
        return self.w.clone()


class Weird:
    def ckpt_get_state(self, name):
        return {"ok": torch.ones(2), "bad": {"inner": object()}}

    def ckpt_set_state(self, name, state):
        pass


def remote(cls, **opts):
    opts.setdefault("num_cpus", 0.1)
    return ray.remote(**opts)(cls)


# the tests directory is not importable in Ray workers: ship these classes by value
import sys as _sys  # noqa: E402

ray.cloudpickle.register_pickle_by_value(_sys.modules[__name__])


class Sampler:
    """An actor whose only state is its random streams (its process's and its own generator)."""

    def __init__(self):
        self.gen = np.random.default_rng(5)

    def draw(self):
        return [random.random(), float(np.random.rand()), torch.rand(1).item(), float(self.gen.random())]

    def ckpt_get_state(self, name):
        return rc.rng_state(generators={"sampler": self.gen})

    def ckpt_set_state(self, name, state):
        rc.set_rng_state(state, generators={"sampler": self.gen})


class Resettable:
    """Runs ``__init__`` again in the same process: a test's fresh provider without a process start
    (a process that imports torch, and at its first optimizer torch._dynamo, is ~6 CPU-s on 2 cores).
    The pooled copies below are what the ``provider`` fixture of conftest.py hands out."""

    def reset(self, *args, **kwargs):
        self.__init__(*args, **kwargs)
        return os.getpid()


class FreshLearner(Resettable, Learner):
    pass


class FreshFlaky(Resettable, Flaky):
    pass


class FreshFrozen(Resettable, Frozen):
    pass


class FreshWeird(Resettable, Weird):
    pass


class FreshBigState(Resettable, BigState):
    pass


class FreshReplay(Resettable, Replay):
    pass
