"""The plan's ops, one class each (`plan.ops`, `lora.merge_op`): spelled as the enum they
replace spelled them, one instance per op, each the other's reverse where there is one."""

from __future__ import annotations

import copy
import pickle

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
