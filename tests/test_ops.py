"""The plan's ops, one class each (`plan.ops`, `lora.merge_op`): spelled as the enum they
replace spelled them, one instance per op, each the other's reverse where there is one."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.plan import ops

SPELLED = {
    "COPY": "copy",
    "CAST": "cast",
    "CONSTANT": "constant",
    "SLICE": "slice",
    "STACK": "stack",
    "FRESH": "fresh",
    "MERGE_LORA": "merge_lora",
}


def test_each_op_is_spelled_as_the_enum_spelled_it() -> None:
    for name, value in SPELLED.items():
        op = getattr(oml.Op, name)
        assert (op.name, op.value, repr(op)) == (name, value, f"<Op.{name}: {value!r}>")


def test_each_op_is_one_instance_through_pickle_and_copy() -> None:
    for name in SPELLED:
        op = getattr(oml.Op, name)
        assert pickle.loads(pickle.dumps(op)) is op
        assert copy.deepcopy(op) is op


def test_slice_and_stack_are_each_others_reverse_and_a_merge_stays_a_merge() -> None:
    assert ops.COPY.unrolled is ops.SLICE and ops.SLICE.stacked is ops.STACK
    assert ops.STACK.unrolled is ops.SLICE
    assert oml.Op.MERGE_LORA.unrolled is oml.Op.MERGE_LORA
    assert oml.Op.MERGE_LORA.stacked is oml.Op.MERGE_LORA
    assert ops.CONSTANT.unrolled is None and ops.FRESH.unrolled is None


def _move(op=None, args=None) -> oml.Move:
    spec = oml.LeafSpec((4, 3), np.dtype(np.float32))
    return oml.Move("i", ("w",), ("params", "w"), oml.Dest.PARAMS, spec, op=op, args=args)


def test_each_op_takes_its_own_parameters_and_the_move_holds_none() -> None:
    assert {f.name for f in dataclasses.fields(oml.Move)} == {
        "item", "src", "dst", "dest", "spec", "note", "op", "args"
    }  # fmt: skip
    assert _move().op is ops.COPY and _move().args == ops.NoArgs()
    cast = _move(ops.CAST, ops.CastArgs(np.dtype(np.int32)))
    sliced = _move(ops.SLICE, ops.SliceArgs(axis=0, index=2))
    stacked = _move(ops.STACK, ops.StackArgs(axis=1, layers=(("w0",), None)))
    assert cast.out_spec.dtype == np.int32 and sliced.out_spec.shape == (3,)
    assert stacked.out_spec.shape == (4, 2, 3) and stacked.sources == (("w0",),)
    with pytest.raises(TypeError, match="slice takes SliceArgs"):
        _move(ops.SLICE, ops.StackArgs(axis=1, layers=()))


def test_a_moves_parameters_read_as_its_fields_once_did_and_survive_pickle() -> None:
    sliced = _move(ops.SLICE, ops.SliceArgs(axis=0, index=2))
    assert (sliced.axis, sliced.index, sliced.layers, sliced.cast, sliced.lora) == (
        0,
        2,
        (),
        None,
        (),
    )
    assert _move(ops.CONSTANT, ops.ConstantArgs(7)).value == 7
    assert _move(ops.CAST, ops.CastArgs(np.dtype(np.int32))).cast == np.int32
    assert pickle.loads(pickle.dumps(sliced)) == sliced
    # the reverse of a slice: the slice of a copy's layer, a stack of layers
    one = ops.COPY.unroll(_move(), dst=("params", "w0"), axis=0, index=1)
    assert (one.op, one.args, one.dst) == (ops.SLICE, ops.SliceArgs(0, 1), ("params", "w0"))
    both = one.op.stack_layers({0: one, 1: one}, 2, dst=("params", "w"), axis=0, note="")
    assert (both.op, both.args) == (ops.STACK, ops.StackArgs(0, (("w",), ("w",))))
