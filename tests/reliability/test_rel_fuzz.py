"""Property tests (hypothesis) of the pure conversion and of the metadata readers.

Trees: a MaxText-form model is generated first (nesting, digit-string keys, names such as
``value``/``base``/``mu``), split into params and nnx_aux, and the Tunix form derived from
it the way Tunix writes it: a ``value`` level on every leaf, optionally the adapter's
``base``, an NNX optimizer (chains as digit-keyed dicts, optionally inside
``inject_hyperparams`` and ``MultiSteps`` shells, ``mu``/``nu`` mirroring the weights, in
memory sometimes as lists, tuples and optax namedtuples). `make_plan` and
`to_maxtext_items` must then either succeed, placing every source leaf exactly once (moved
bit-identically, or dropped with a reason), or raise `LayoutMismatchError` naming the
offending paths; nothing else, never a leaf lost silently.

Readers: `read_step_metadata`, `spec.key_impls` and `read_specs` fed corrupted JSON may
only raise `CheckpointReadError`.
"""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rel_support as S
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from orbax_maxtext_layout import (
    CheckpointReadError,
    LayoutMismatchError,
    LeafSpec,
    Target,
    make_plan,
    to_maxtext_items,
)
from orbax_maxtext_layout.base.treepaths import flatten, keystr, unflatten
from orbax_maxtext_layout.orbax_io.orbax_files import key_impls
from orbax_maxtext_layout.orbax_io.stepmeta import read as read_step_metadata
from orbax_maxtext_layout.storage.store import store_for

# Hypothesis caches (constants, unicode data) go to a temporary directory, not into the
# repository's .hypothesis/ (this suite writes only under tests/reliability). No other test
# module uses hypothesis, so setting its home for the session changes nothing else.
set_hypothesis_home_dir(S.session_dir() / "hypothesis")

SETTINGS = settings(
    max_examples=S.scale(150, 2000),
    deadline=None,
    database=None,  # write nothing outside tests/reliability
    derandomize=not S.FULL,  # CI: the same examples on every machine
    suppress_health_check=list(HealthCheck),
)
BUG_COLLISION = (
    "BUG: plan.make_plan lets rules.apply's ValueError('rule drop_adapter maps two leaves "
    "onto ...') escape: a model_params tree holding both base/<x> and <x> (an adapter level "
    "beside a sibling of the same name) is a collision, not a LayoutMismatchError naming "
    "both paths. The same for chain_to_list on keys such as '0' and '00' in the canonical "
    "optimizer branch (no try/except there, unlike the candidate search)."
)
BUG_READERS = (
    "BUG: spec.key_impls only guards json.loads(...)['array_metadatas']; entries that are "
    "not objects, 'array_metadatas' that is not a list, or an entry without 'param_name' "
    "raise AttributeError/TypeError/KeyError instead of CheckpointReadError (and "
    "read_specs, which calls it, passes them on)."
)


NAMES = [
    "decoder",
    "layers",
    "mlp",
    "wi",
    "kernel",
    "scale",
    "embedding",
    "query",
    "value",  # an attention projection named like the Variable level
    "base",  # a real module named like the adapter level
    "rngs",
    "count",
    "key",
    "0",
    "1",
    "12",
    "layers_0",
]
DTYPES = [np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint32)]

specs = st.builds(
    LeafSpec,
    shape=st.lists(st.integers(1, 3), max_size=3).map(tuple),
    dtype=st.sampled_from(DTYPES),
)


def _model_trees(names: list[str]):
    return st.recursive(
        specs,
        lambda ch: st.dictionaries(st.sampled_from(names), ch, min_size=1, max_size=3),
        max_leaves=10,
    ).filter(lambda t: isinstance(t, dict))


@st.composite
def cases(draw, names=NAMES):
    """(model_params specs, optimizer_state specs or None, target, description)."""
    model = flatten(draw(_model_trees(names)), is_leaf=lambda x: isinstance(x, LeafSpec))
    is_param = {p: draw(st.booleans()) or "rngs" not in p for p in model}
    params = {p: s for p, s in model.items() if is_param[p]}
    aux = {p: s for p, s in model.items() if not is_param[p]}
    adapter = draw(st.booleans())
    pre = ("base",) if adapter else ()
    src = {pre + p + ("value",): s for p, s in model.items()}
    if draw(st.booleans()):  # a sown intermediate, dropped by name
        src[pre + ("max_logits", "value")] = LeafSpec((2,), np.dtype(np.float32))
    opt = None
    if draw(st.booleans()) and params:
        inner = {("count",): LeafSpec((), np.dtype(np.int32))}
        for m in ("mu", "nu"):
            inner |= {(m, *pre, *p): s for p, s in params.items()}
        state = {("1", "0", *p): s for p, s in inner.items()}  # chain(clip, adamw), clip empty
        if draw(st.booleans()):  # inject_hyperparams
            state = {("inner_state", *p): s for p, s in state.items()}
            state[("count",)] = LeafSpec((), np.dtype(np.int32))
            state[("hyperparams", "learning_rate")] = LeafSpec((), np.dtype(np.float32))
        if draw(st.booleans()):  # MultiSteps
            state = {("inner_opt_state", *p): s for p, s in state.items()}
            state |= {("acc_grads", *pre, *p): s for p, s in params.items()}
            state[("mini_step",)] = LeafSpec((), np.dtype(np.int32))
            state[("gradient_step",)] = LeafSpec((), np.dtype(np.int32))
        opt = {("opt_state", *p, "value"): s for p, s in state.items()}
        opt[("step", "value")] = LeafSpec((), np.dtype(np.uint32))
    target = Target(params=params, nnx_aux=aux)
    how = draw(st.sampled_from(["match", "match", "reshape", "unknown", "missing", "random"]))
    if how == "reshape" and model:
        p = draw(st.sampled_from(sorted(model, key=keystr)))
        s = model[p]
        bad = LeafSpec(s.shape + (7,), s.dtype)
        target = Target(
            params={**params, p: bad} if p in params else params,
            nnx_aux={**aux, p: bad} if p in aux else aux,
        )
    elif how == "unknown" and model:
        p = draw(st.sampled_from(sorted(model, key=keystr)))
        target = Target(
            params={k: v for k, v in params.items() if k != p},
            nnx_aux={k: v for k, v in aux.items() if k != p},
        )
    elif how == "missing":
        target = Target(
            params={**params, ("extra_module", "kernel"): LeafSpec((1,), DTYPES[0])}, nnx_aux=aux
        )
    elif how == "random":  # unrelated trees: anything but a crash
        other = flatten(draw(_model_trees(names)), is_leaf=lambda x: isinstance(x, LeafSpec))
        target = Target(params=other, nnx_aux={}, opt_state=draw(st.sampled_from([None, {}])))
    return src, opt, target, how


def conservation_problems(plan, params: dict, opt: dict | None) -> list[str]:
    """Every source leaf moved (unchanged spec) or dropped with a reason, exactly once."""
    want = collections.Counter(("model_params", repr(p)) for p in params)
    want += collections.Counter(("optimizer_state", repr(p)) for p in opt or {})
    got = collections.Counter((m.item, repr(m.src)) for m in plan.moves if not m.note)
    got += collections.Counter((d.item, repr(d.src)) for d in plan.drops)
    problems = []
    if got != want:
        problems.append(f"lost {dict(want - got)}, duplicated {dict(got - want)}")
    problems += [f"drop without reason: {d}" for d in plan.drops if not d.reason]
    dsts = collections.Counter(repr(m.dst) for m in plan.moves)
    problems += [f"two leaves written to {d}" for d, n in dsts.items() if n > 1]
    for m in plan.moves:
        if not m.sources:  # a constant (step from the directory): no source leaf to conserve
            continue
        src = (params if m.item == "model_params" else opt)[m.src]
        if m.spec != src:
            problems.append(f"{keystr(m.src)}: spec changed {src} -> {m.spec}")
        if m.dst[:2] not in (("params", "params"), ("nnx_aux", "model")) and m.dst[0] not in (
            "opt_state",
            "step",
        ):
            problems.append(f"{keystr(m.src)} written outside the items sections: {m.dst}")
    return problems


def _plan(src, opt, target):
    return make_plan(src, opt, target, step=7)


@SETTINGS
@given(case=cases())
@example(  # an adapter level beside a sibling of the same name: base/a and a
    case=(
        {
            ("base", "a", "value"): LeafSpec((1,), DTYPES[0]),
            ("base", "b", "value"): LeafSpec((1,), DTYPES[0]),
            ("a", "value"): LeafSpec((1,), DTYPES[0]),
        },
        None,
        Target(
            params={("a",): LeafSpec((1,), DTYPES[0]), ("b",): LeafSpec((1,), DTYPES[0])},
            nnx_aux={},
        ),
        "collision",
    )
)
def test_plan_places_every_leaf_or_names_the_mismatch(case):
    """Names that collide with the levels the rules strip (a module called ``value`` that is
    its parent's only child, a real ``base``) make some trees ambiguous: a refusal is then a
    correct answer too (a known limit, docs/reliability.md); a crash or a lost leaf is not."""
    src, opt, target, _ = case
    S.count("fuzzed")
    try:
        plan = _plan(src, opt, target)
    except LayoutMismatchError as e:
        assert e.problems or e.hint, e
        return
    assert not conservation_problems(plan, src, opt), conservation_problems(plan, src, opt)


@SETTINGS
@given(case=cases(names=[n for n in NAMES if n not in ("base", "value")]))
def test_plan_without_ambiguous_names(case):
    """The same property where no module is named ``value`` or ``base`` (names MaxText
    models do use; the ambiguous cases are the test above): a matching target converts,
    each leaf lands at its model path, and a broken one names the broken path."""
    src, opt, target, how = case
    S.count("fuzzed")
    try:
        plan = _plan(src, opt, target)
    except LayoutMismatchError as e:
        assert how != "match", f"a matching target was refused: {e}"
        lines = "\n".join(e.problems)
        assert e.problems and all(": " in p for p in e.problems), e
        if how in ("reshape", "unknown") and not lines:
            raise AssertionError("no offending path listed") from e
        return
    assert how in ("match", "random") or not target.model_paths() ^ {
        p[1:-1] if p[0] == "base" else p[:-1] for p in src
    }
    assert not conservation_problems(plan, src, opt)
    for m in plan.moves:
        if m.item == "model_params":
            model_path = m.dst[2:]
            assert model_path in target.params or model_path in target.nnx_aux, m


# -- in memory: lists, tuples, namedtuples ----------------------------------------------
def _arrays(flat: dict, offset: int) -> dict:
    out = {}
    for i, (p, s) in enumerate(sorted(flat.items(), key=lambda kv: repr(kv[0]))):
        n = int(np.prod(s.shape))
        out[p] = (np.arange(n) + offset + 100 * i).astype(s.dtype).reshape(s.shape)
    return out


def _as_memory(flat: dict, draw) -> Any:
    """Nested in-memory tree; chain dicts sometimes as tuples, Adam's state as a namedtuple."""
    import optax

    tree = unflatten(flat)

    def rec(node):
        if isinstance(node, dict):
            node = {k: rec(v) for k, v in node.items()}
            if set(node) == {"count", "mu", "nu"} and draw(st.booleans()):
                return optax.ScaleByAdamState(**node)
            return node
        if isinstance(node, list):
            items = [rec(v) for v in node]
            return tuple(items) if draw(st.booleans()) else items
        return node

    return rec(tree)


@SETTINGS
@given(case=cases(names=[n for n in NAMES if n not in ("base", "value")]), data=st.data())
def test_to_maxtext_items_moves_values_bit_for_bit(case, data):
    src, opt, target, how = case
    S.count("fuzzed")
    src_a = _arrays(src, 0)
    opt_a = _arrays(opt, 10_000) if opt else None
    memory_opt = _as_memory(opt_a, data.draw) if opt_a else None
    try:
        out = to_maxtext_items(unflatten(src_a), memory_opt, target, step=7)
    except LayoutMismatchError:
        assert how != "match"
        return
    plan = _plan(src, opt, target)
    flat = flatten(out, is_leaf=lambda x: hasattr(x, "dtype"))
    flat = {tuple(k for k in p): v for p, v in flat.items()}
    for m in plan.moves:
        if not m.sources:  # the step constant (the directory number), not a source leaf
            continue
        value = (src_a if m.item == "model_params" else opt_a)[m.src]
        got = np.asarray(flat[m.dst])
        if m.cast is not None:
            value = value.astype(m.cast)
        assert got.dtype == value.dtype and got.tobytes() == value.tobytes(), m
    placed = {m.dst for m in plan.moves} | {("step",)}
    assert set(flat) <= placed, sorted(map(keystr, set(flat) - placed))


# -- metadata readers on corrupted JSON -------------------------------------------------
@pytest.fixture(scope="module")
def item_copy(tmp_path_factory) -> Path:
    step = S.copy_fixture(S.RL, tmp_path_factory.mktemp("readers"))
    return step


def _mutations(original: bytes):
    """Corruptions of a valid JSON file: truncations, byte flips, foreign JSON values."""
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=12), ch, max_size=3),
        max_leaves=8,
    )
    flips = st.lists(
        st.tuples(st.integers(0, max(len(original) - 1, 0)), st.integers(1, 255)), max_size=4
    ).map(lambda fl: _flip(original, fl))
    return st.one_of(
        st.integers(0, len(original)).map(lambda n: original[:n]),
        flips,
        json_values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
    )


def _flip(data: bytes, flips) -> bytes:
    b = bytearray(data)
    for i, x in flips:
        if b:
            b[i % len(b)] ^= x
    return bytes(b)


def _only_read_errors(fn, *args) -> None:
    try:
        fn(*args)
    except CheckpointReadError:
        pass


def test_step_metadata_reader_fuzz(item_copy):
    f = item_copy / "_CHECKPOINT_METADATA"
    original = f.read_bytes()

    @SETTINGS
    @given(content=_mutations(original))
    def run(content):
        S.count("fuzzed")
        f.write_bytes(content)
        _only_read_errors(read_step_metadata, item_copy)

    try:
        run()
    finally:
        f.write_bytes(original)


def test_array_metadata_reader_fuzz(item_copy):
    f = item_copy / "model_params" / "array_metadatas" / "process_0"
    original = f.read_bytes()

    @SETTINGS
    @given(content=_mutations(original))
    @example(content=b'{"array_metadatas": [1]}')
    @example(
        content=b'{"array_metadatas": [{"array_metadata": {"ext_metadata": {"random_key_impl": "x"}}}]}'
    )
    def run(content):
        S.count("fuzzed")
        f.write_bytes(content)
        item = item_copy / "model_params"
        _only_read_errors(lambda d: key_impls(d, store=store_for(d)), item)

    try:
        run()
    finally:
        f.write_bytes(original)


def test_read_specs_fuzz_in_a_child(item_copy, tmp_path):
    """``read_specs`` opens arrays through Orbax: run it in a forked child (see
    test_rel_corrupt), over corrupted ``_METADATA`` contents drawn here."""
    meta = item_copy / "model_params" / "_METADATA"
    original = meta.read_bytes()
    contents = []

    @settings(SETTINGS, max_examples=S.scale(60, 600))
    @given(content=_mutations(original))
    def draw(content):
        contents.append(content.hex())

    draw()
    work = tmp_path / "w"
    shutil.copytree(item_copy / "model_params", work)
    res = S.probe("read_specs_fuzz", item=str(work), contents=contents)
    escaped = {k: v for k, v in res.items() if v}
    assert not escaped, escaped
    S.count("fuzzed", len(contents))
