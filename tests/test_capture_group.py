"""A rank's save captures all its states before their copies begin (``engine.push_group``), and the
flattening it does per save stays what it was: the same bytes, the memory ranges fences rely on.

No Ray here: the copier is a plain object (``ray_ckpt/capture/overlap.py``), the pusher's hold is
tested through ``tests/test_verl.py`` (a verl save pushes its four parts inside one group)."""
import threading

import numpy as np
import pytest
import torch

from ray_ckpt.capture.overlap import OverlapCopier, _ranges_of
from ray_ckpt.formats.tree import flatten, unflatten

pytestmark = pytest.mark.timeout(120)


class RecordingStore:
    """A real copy (numpy) that records when it ran."""

    def __init__(self):
        self.copied = []
        self.lock = threading.Lock()

    def put(self, flat):
        with self.lock:
            self.copied.append(len(flat.arrays))
        return [a.copy() for a in flat.arrays]


def test_copies_started_inside_held_begin_when_the_block_ends():
    store, delivered = RecordingStore(), {}
    copier = OverlapCopier(store.put, lambda job: delivered.__setitem__(job.key, job.result))
    model, opt_state = torch.nn.Linear(32, 32), {"m": torch.randn(32, 32)}
    with copier.held():
        a = copier.start("model", "k1", flatten(model.state_dict(), state_name="model"))
        b = copier.start("optimizer", "k2", flatten(opt_state, state_name="optimizer"))
        assert not a.done.wait(0.3) and not b.done.is_set() and store.copied == []  # parked, not copying
    assert a.done.wait(10) and b.done.wait(10)
    assert a.error is None and b.error is None and store.copied == [2, 1]
    assert [bytes(x) for x in delivered["k1"]] == [bytes(x.numpy()) for x in model.state_dict().values()]


def test_a_fence_inside_held_starts_the_parked_copy_instead_of_waiting_forever():
    store = RecordingStore()
    copier = OverlapCopier(store.put, lambda job: None)
    w = torch.randn(64)
    with copier.held():
        job = copier.start("policy", "k", flatten({"w": w}, state_name="policy"))
        copier.fence(tensors=[w], timeout=10)  # the optimizer's step pre-hook does this
        assert job.done.is_set() and job.error is None
        # a second snapshot of the same state inside the block waits for the first one, which runs
        again = copier.start("policy", "k2", flatten({"w": w}, state_name="policy"))
    assert again.done.wait(10) and again.error is None


def test_flatten_records_the_memory_each_array_reads():
    """Fences find the copies that read a tensor by these ranges: they must be the arrays' own."""
    state = {"f32": torch.randn(5, 7), "bf16": torch.randn(9).to(torch.bfloat16), "step": torch.tensor(3.0),
             "empty": torch.zeros(0), "np": np.arange(6, dtype=np.int16), "param": torch.nn.Parameter(torch.ones(4)),
             "view": torch.arange(20.0)[5:15]}
    flat = flatten(state, state_name="s")
    assert len(flat.spans) == len(flat.arrays)
    for arr, (lo, hi) in zip(flat.arrays, flat.spans):
        if arr.nbytes:
            assert (lo, hi) == (arr.__array_interface__["data"][0], arr.__array_interface__["data"][0] + arr.nbytes)
    assert flat.spans[list(state).index("view")][0] == state["view"].data_ptr()
    without = type(flat)(flat.structure, flat.arrays, flat.tables, flat.leaf_info)  # e.g. after transport
    assert _ranges_of(flat) == _ranges_of(without)
    back = unflatten(flat.structure, [bytearray(a.tobytes()) for a in flat.arrays], flat.tables)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert back[k].dtype == v.dtype and torch.equal(back[k], v.detach())
        else:
            assert np.array_equal(back[k], v)
