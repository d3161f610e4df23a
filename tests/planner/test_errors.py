"""Planner errors: missing tensors, dtype and shape mismatches, bad plans. Each names tensor and rank."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from planner import (
    LayoutBuilder,
    Plan,
    PlanError,
    Shard,
    SourceOps,
    build_plan,
    build_plans,
    validate_plan,
)

from .cases import sharded

pytestmark = pytest.mark.timeout(60)


def _one(rank, name, shape, dtype="float32", decl=None):
    b = LayoutBuilder(rank)
    b.add(name, shape, dtype, decl or Shard(name, shape))
    return b.build()


def test_missing_tensor_lists_names_and_ranks():
    src = [_one(0, "a", (4, 4))]
    dests = [_one(5, "b", (4, 4)), _one(6, "b", (4, 4))]
    with pytest.raises(PlanError) as e:
        build_plans(src, dests)
    assert "'b'" in str(e.value) and "[5, 6]" in str(e.value)


def test_partially_held_tensor():
    src = sharded({"w": ((8, 2), 0)}, tp=2)[:1]  # only rows 0..3 exist on the sources
    dst = [_one(9, "w", (8, 2))]
    with pytest.raises(PlanError, match=r"'w'.*rank 9.*16 of 16|'w'.*rank 9.*8 of 16"):
        build_plans(src, dst)


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(PlanError, match=r"'w'.*\(4, 4\).*rank 3.*\(4, 5\).*rank 0"):
        build_plan([_one(0, "w", (4, 5))], _one(3, "w", (4, 4)))


def test_dtype_mismatch_needs_a_transform():
    src, dst = [_one(0, "w", (4, 4), "float32")], _one(3, "w", (4, 4), "bfloat16")
    with pytest.raises(PlanError, match=r"'w'.*float32.*rank 0.*bfloat16.*rank 3.*named transform"):
        build_plan(src, dst)
    with pytest.raises(PlanError, match=r"'w'.*transform 'cast'.*cannot execute"):
        build_plan(src, dst, transforms={"w": "cast"})


def test_conflicting_source_specs():
    with pytest.raises(PlanError, match=r"'w'.*rank 0.*rank 1"):
        build_plan([_one(0, "w", (4, 4)), _one(1, "w", (4, 8), decl=Shard("w", (4, 8)))], _one(2, "w", (4, 4)))


def test_duplicate_ranks():
    with pytest.raises(PlanError, match="source rank 0 given twice"):
        build_plan([_one(0, "w", (2,)), _one(0, "w", (2,))], _one(1, "w", (2,)))


def _good():
    src = sharded({"w": ((8, 4), 0)}, tp=2)
    dst = _one(7, "w", (8, 4))
    return src, dst, build_plan(src, dst)


def _mutate(plan: Plan, **cols) -> Plan:
    s = plan.sources[0]
    new = {c: np.array(getattr(s, c)) for c in ("src_region", "src_offset", "dst_region", "dst_offset", "nbytes")}
    for c, f in cols.items():
        new[c] = f(new[c])
    return dataclasses.replace(plan, sources=(SourceOps(s.src_rank, **new),) + plan.sources[1:])


@pytest.mark.parametrize(
    "cols, pattern",
    [
        ({"src_offset": lambda a: a + 4}, "unmapped source bytes|source rank"),
        ({"dst_offset": lambda a: a + 4}, "overlap|unmapped destination|outside"),
        ({"nbytes": lambda a: a - 4}, "reads .* bytes but"),
        ({"src_offset": lambda a: a + 10**6}, "outside region"),
        ({"dst_region": lambda a: a + 3}, "region 3 does not exist"),
    ],
)
def test_validate_rejects_broken_plans(cols, pattern):
    src, dst, plan = _good()
    validate_plan(plan, src, dst)
    with pytest.raises(PlanError, match=pattern) as e:
        validate_plan(_mutate(plan, **cols), src, dst)
    assert "destination rank 7" in str(e.value)


def test_validate_catches_wrong_data_mapping():
    # Swap the sources of the two halves: in bounds, no overlap, right total, wrong bytes.
    src, dst, plan = _good()
    a, b = plan.sources
    swapped = dataclasses.replace(
        plan,
        sources=(
            SourceOps(a.src_rank, a.src_region, a.src_offset, b.dst_region, b.dst_offset, a.nbytes),
            SourceOps(b.src_rank, b.src_region, b.src_offset, a.dst_region, a.dst_offset, b.nbytes),
        ),
    )
    with pytest.raises(PlanError, match="copies"):
        validate_plan(swapped, src, dst)


def test_unknown_source_rank():
    src, dst, plan = _good()
    with pytest.raises(PlanError, match="unknown source rank 1"):
        validate_plan(plan, src[:1], dst)


def test_validate_catches_spec_disagreement():
    # Same bytes, same element count, but the destination says bfloat16 where the source says float16.
    src = [_one(0, "w", (4, 4), "float16")]
    dst = _one(3, "w", (4, 4), "float16")
    plan = build_plan(src, dst)
    other = _one(3, "w", (4, 4), "bfloat16")
    with pytest.raises(PlanError, match=r"'w'.*float16 on source rank 0.*bfloat16 on destination rank 3"):
        validate_plan(plan, src, other)


def test_columns_of_different_lengths():
    from planner.packing import StridedCopies

    with pytest.raises(PlanError, match=r"source rank 3: columns of different lengths"):
        SourceOps(3, [0, 0], [0, 8], [0], [0, 8], [8, 8])
    with pytest.raises(PlanError, match=r"strided copies: columns of different lengths"):
        StridedCopies([0], [0], [0, 0], [0], [4], [[1]], [[0]], [[0]])
    with pytest.raises(PlanError, match=r"strided copies: columns of different lengths"):
        StridedCopies([0], [0], [0], [0], [4], [[1]], [[0]], [[0, 0]])
    ops = SourceOps(1, [0, 0], [0, 8], [0, 0], [0, 8], [8, 8])
    assert ops.nbytes.dtype == np.int64 and not ops.nbytes.flags.writeable and ops.total_bytes == 16
