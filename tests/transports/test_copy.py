"""``transports._copy``: the torch executor of strided copies (``serial_chunks``) and ``CopyPlan``'s
use of it for families of short rows (a column slice), and how it makes scattered copies."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transports._copy import FEW_COPIES, SERIAL_ELEMS, CopyPlan, run_chunks, serial_chunks

pytestmark = pytest.mark.timeout(60)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_serial_chunks_bit_exact_on_random_boxes(seed):
    """Boxes of 1-3 dimensions at any byte offset (some word-aligned, some not), some larger than
    one serial copy: every chunk is at most SERIAL_ELEMS words, moved in the widest word that the
    addresses allow, and the result equals numpy's strided copy byte for byte."""
    rng = np.random.default_rng(seed)
    src = torch.from_numpy(rng.integers(0, 256, 3 << 20, dtype=np.uint8))
    dst = torch.zeros(3 << 20, dtype=torch.uint8)
    dims = int(rng.integers(1, 4))
    align = int(rng.choice([1, 2, 8]))
    long_rows = dims == 1 or rng.random() < 0.3  # rows longer than one serial copy
    run = align * int(rng.integers(1, 40_000 if long_rows else 64))
    shape = [int(rng.integers(1, 3 if long_rows else 300 if dims == 2 else 20)) for _ in range(dims - 1)]
    s_str, d_str, s_step, d_step = [], [], run + align * int(rng.integers(0, 8)), run
    for n in reversed(shape):  # inner dimensions first; destination dense, source with gaps
        s_str.insert(0, s_step)
        d_str.insert(0, d_step)
        s_step, d_step = s_step * n + align * int(rng.integers(0, 4)), d_step * n
    so, do = align * int(rng.integers(0, 64)), align * int(rng.integers(0, 64))
    s = src.as_strided((*shape, run), (*s_str, 1), so)
    d = dst.as_strided((*shape, run), (*d_str, 1), do)
    chunks = serial_chunks(d, s)
    assert all(c.numel() <= SERIAL_ELEMS for c, _ in chunks)
    g = math.gcd(s.data_ptr(), d.data_ptr(), run, *s_str, *d_str)
    assert {c.element_size() for c, _ in chunks} == {min(8, g & -g)}
    run_chunks(chunks)
    want = np.zeros(3 << 20, dtype=np.uint8)
    view = np.lib.stride_tricks.as_strided
    view(want[do:], (*shape, run), (*d_str, 1))[...] = view(src.numpy()[so:], (*shape, run), (*s_str, 1))
    assert np.array_equal(dst.numpy(), want)


def test_copy_plan_moves_a_column_slice_with_torch():
    """The rows of a column slice (a family of 2 KiB copies 4 KiB apart) go to torch chunks, not
    numpy, and land bit-exact; a backwards family (negative strides, which torch views lack)
    stays with numpy."""
    rows, width, take = 4096, 4096, 2048
    src = np.random.default_rng(1).integers(0, 256, rows * width, dtype=np.uint8)
    dst = np.zeros(rows * take, dtype=np.uint8)
    r = np.arange(rows, dtype=np.int64)
    n = np.full(rows, take, dtype=np.int64)
    plan = CopyPlan.of(dst.ctypes.data + r * take, src.ctypes.data + r * width, n)
    assert len(plan.chunks) == rows * take // 8 // SERIAL_ELEMS + 1 and not plan.strided
    plan.run()
    assert np.array_equal(dst.reshape(rows, take), src.reshape(rows, width)[:, :take])
    back = CopyPlan.of(dst.ctypes.data + r[::-1] * take, src.ctypes.data + r[::-1] * width, n)
    assert not back.chunks and len(back.strided) == 1
    dst[:] = 0
    back.run()
    assert np.array_equal(dst.reshape(rows, take), src.reshape(rows, width)[:, :take])


@pytest.mark.parametrize("count", [1, FEW_COPIES, FEW_COPIES + 1, 300])
def test_copy_plan_scattered_copies_few_by_memmove_many_by_one_syscall(count):
    """Copies in no progression: a batch of at most ``FEW_COPIES`` (a slot stamp, say) is made by
    ``memmove`` one by one (a ``process_vm_readv`` of the process itself cost 70 us there, the
    memmoves 9 us); more short ones go in one ``process_vm_readv``. Both land bit-exact."""
    rng = np.random.default_rng(count)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    n = rng.integers(1, 100, count).astype(np.int64)
    s_off = np.sort(rng.choice((1 << 20) // 200, count, replace=False)).astype(np.int64) * 200
    gaps = n[::-1] + 3  # the destination pieces in reverse order, 3 bytes apart: no progressions
    d_off = np.concatenate([[0], np.cumsum(gaps)[:-1]]).astype(np.int64)[::-1].copy()
    plan = CopyPlan.of(dst.ctypes.data + d_off, src.ctypes.data + s_off, n)
    assert (len(plan.long), len(plan.local_iov)) == ((count, 0) if count <= FEW_COPIES else (0, count))
    plan.run()
    want = np.zeros_like(dst)
    for d, s, k in zip(d_off, s_off, n):
        want[d : d + k] = src[s : s + k]
    assert np.array_equal(dst, want)
