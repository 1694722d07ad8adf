"""The replay journal's row cache (``integrations/rllib/replay/growth.py``): survivors of an
eviction as views, new rows appended into room kept after the cached ones. Plain numpy, no Ray."""
import numpy as np

from ray_ckpt.integrations.rllib.replay.growth import appended, kept, survivors


def test_survivors_are_a_slice_when_the_evicted_rows_are_a_prefix_and_the_mask_otherwise():
    assert survivors(np.array([True, True, True])) == slice(0, 3)
    assert survivors(np.array([False, False, True, True])) == slice(2, 4)
    assert survivors(np.array([False, False])) == slice(2, 2)
    assert survivors(np.zeros(0, bool)) == slice(0, 0)
    interleaved = np.array([False, True, False, True])  # several envs: an evicted episode's rows are spread
    sel = survivors(interleaved)
    assert isinstance(sel, np.ndarray) and np.array_equal(sel, interleaved)
    arr = np.arange(4) * 10
    for keep in (np.array([False, False, True, True]), interleaved):
        sel = survivors(keep)
        assert np.array_equal(arr[sel], arr[keep])


def test_appended_writes_only_the_new_rows_after_the_newest_view_and_never_changes_an_earlier_one():
    a = appended(np.arange(6, dtype=np.int64).reshape(3, 2), np.array([[6, 7]]))
    b = appended(a, np.array([[8, 9], [10, 11]]))
    assert np.array_equal(b, np.arange(12).reshape(6, 2))
    assert np.shares_memory(a, b), "the new rows were not written after the cached ones"
    a_bytes = a.copy()
    # a's end is no longer where the rows in use end: appending to it must copy, not overwrite b's rows
    c = appended(a, np.array([[-1, -1]]))
    assert np.array_equal(c, np.concatenate([a_bytes, [[-1, -1]]]))
    assert not np.shares_memory(c, b) and np.array_equal(b, np.arange(12).reshape(6, 2))
    # survivors of a prefix eviction (a view), then more rows: still the same memory, a unchanged
    d = appended(b[2:], np.array([[12, 13]]))
    assert np.shares_memory(d, b) and np.array_equal(d, np.arange(4, 14).reshape(5, 2))
    assert np.array_equal(a, a_bytes) and np.array_equal(b, np.arange(12).reshape(6, 2))


def test_appended_grows_a_new_array_when_the_room_runs_out_and_keeps_dtype_semantics():
    x = appended(np.zeros(0, np.float32), np.ones(3, np.float32))
    room = len(x.base)
    y = appended(x, np.full(room, 2, np.float32))  # more than the room left
    assert np.array_equal(y, np.concatenate([np.ones(3), np.full(room, 2)])) and y.dtype == np.float32
    assert not np.shares_memory(x, y) and np.array_equal(x, np.ones(3))
    z = appended(np.arange(3, dtype=np.int32), np.array([1.5]))  # another dtype: numpy's concatenation
    assert z.dtype == np.float64 and np.array_equal(z, [0, 1, 2, 1.5])


def test_kept_is_the_survivors_then_the_new_rows_with_room_to_append_after_them():
    old = appended(np.arange(8, dtype=np.int64).reshape(4, 2), np.array([[8, 9]]))
    before = old.copy()
    spread = np.array([False, True, False, True, True])
    got = kept(old, survivors(spread), np.array([[10, 11]]))  # a mask: one copy into a new array
    assert np.array_equal(got, np.concatenate([before[spread], [[10, 11]]]))
    assert not np.shares_memory(got, old) and np.array_equal(old, before)
    more = appended(got, np.array([[12, 13]]))
    assert np.shares_memory(more, got), "no room was kept after the survivors"
    prefix = np.array([False, True, True, True, True])
    got = kept(old, survivors(prefix), np.array([[10, 11]]))  # a slice: appended after old's rows
    assert np.shares_memory(got, old) and np.array_equal(got, np.concatenate([before[1:], [[10, 11]]]))
    mixed = kept(np.arange(3, dtype=np.int32), survivors(np.array([True, False, True])), np.array([0.5]))
    assert mixed.dtype == np.float64 and np.array_equal(mixed, [0, 2, 0.5])
