"""Options as objects (issue 59): `convert_step`, `merge_lora`, `export_hf` and `import_hf`
take one frozen options object or the same options as keywords, with the same result, never
both; and the conversion options that cannot go together: one check (`options.check`), made
by `convert_step` before anything is read or moved and by ``convert`` before the target is
built, each naming the options as its caller wrote them. (The Hugging Face functions' results
need MaxText: tests/interop/test_options_hf.py.)"""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest
from conftest import (
    MAXTEXT_NATIVE,
    RL_ACTOR_STEPS,
    copy_fixture,
    raw,
    restore_flat,
    tree_digest,
    without_warnings,
)
from lora_writers import base_params, lora_factors, write_adapters, write_base
from test_cli import cli

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.execute import options as options_module
from orbax_maxtext_layout.execute.options import FLAGS, KEYWORDS, ConvertOptions, check
from orbax_maxtext_layout.hf import export_hf as export_module
from orbax_maxtext_layout.hf import import_hf as import_module

RL = RL_ACTOR_STEPS["tunix017_rl"]

# (options, error type, the options a refusal names)
CONFLICTS = {
    "rescan+in_place": (
        ConvertOptions(in_place=True, rescan="unroll"),
        oml.UsageError,
        ("in_place", "rescan"),
    ),
    "copy+in_place": (
        ConvertOptions(in_place=True, copy=True),
        oml.UsageError,
        ("in_place", "copy"),
    ),
    "out+in_place": (
        ConvertOptions(in_place=True, out="/elsewhere"),
        oml.ReadOnlyStepError,
        ("out", "in_place", "remove_legacy"),
    ),
    "out+remove_legacy": (
        ConvertOptions(remove_legacy=True, out="/elsewhere"),
        oml.ReadOnlyStepError,
        ("out", "in_place", "remove_legacy"),
    ),
}
FLAG_ARGS = {
    "rescan+in_place": ["--unroll", "--in-place"],
    "copy+in_place": ["--copy", "--in-place"],
    "out+in_place": ["--out", "/elsewhere", "--in-place"],
    "out+remove_legacy": ["--out", "/elsewhere", "--remove-legacy"],
}


@pytest.mark.parametrize("name", CONFLICTS)
@pytest.mark.parametrize("spelling", [KEYWORDS, FLAGS], ids=["keywords", "flags"])
def test_each_conflict_is_refused_naming_the_path_and_its_options(name, spelling):
    options, error, named = CONFLICTS[name]
    with pytest.raises(error) as e:
        check(options, "/runs/ckpt/3", spelling)
    message = str(e.value)
    assert message.startswith("/runs/ckpt/3: "), message
    for option in named:
        assert getattr(spelling, option) in message, (option, message)
    assert "Drop" in message or "Choose one" in message  # says what to do
    if name.startswith("out+"):
        assert "/elsewhere" in message


@pytest.mark.parametrize(
    "options",
    [
        ConvertOptions(),
        ConvertOptions(copy=True, remove_legacy=True),
        ConvertOptions(in_place=True, remove_legacy=True),
        ConvertOptions(copy=True, out="/elsewhere", rescan="stack"),
        ConvertOptions(remove_legacy=True, rescan="unroll"),
    ],
)
def test_options_that_go_together_pass(options):
    check(options, "/runs/ckpt/3", FLAGS)
    check(options, "/runs/ckpt/3")


@pytest.mark.parametrize("name", CONFLICTS)
def test_convert_step_refuses_with_the_shared_check(name, tmp_path):
    options, error, _ = CONFLICTS[name]
    step = copy_fixture(RL, tmp_path)
    before = tree_digest(tmp_path)
    with pytest.raises(error) as e:
        check(options, step)
    with pytest.raises(error) as got:
        oml.convert_step(
            step,
            oml.Target.from_checkpoint(MAXTEXT_NATIVE),
            in_place=options.in_place,
            copy=options.copy,
            remove_legacy=options.remove_legacy,
            out=options.out,
            rescan=options.rescan,
        )
    assert str(got.value) == str(e.value)
    assert tree_digest(tmp_path) == before


def test_convert_step_refuses_before_renumbering_the_step(tmp_path):
    """``renumber=True`` moves Tunix directory 2 to MaxText's 1 before converting it; the
    refusal of ``in_place`` with ``rescan`` comes first, so nothing is moved."""
    step = copy_fixture(RL, tmp_path)
    before = tree_digest(tmp_path)
    target = oml.unroll_target(oml.Target.from_checkpoint(MAXTEXT_NATIVE))
    with pytest.raises(oml.UsageError, match="in_place cannot change the scan form"):
        oml.convert_step(step, target, rescan="unroll", in_place=True, renumber=True)
    assert sorted(p.name for p in step.parent.iterdir()) == ["2"]
    assert tree_digest(tmp_path) == before


def test_convert_step_refuses_whatever_the_step_holds(tmp_path):
    """A refused combination is refused even where there would be nothing to convert."""
    with pytest.raises(oml.UsageError, match="in_place"):
        target = oml.Target.from_checkpoint(MAXTEXT_NATIVE)
        oml.convert_step(tmp_path / "gone" / "3", target, rescan="stack", in_place=True)


@pytest.mark.parametrize("name", CONFLICTS)
def test_cli_refuses_with_the_shared_check_naming_its_flags(name, tmp_path):
    options, error, _ = CONFLICTS[name]
    step = copy_fixture(RL, tmp_path)
    root = step.parent
    before = tree_digest(tmp_path)
    with pytest.raises(error) as e:
        check(options, str(root), FLAGS)
    # Checked before the target is built: --target-from x is never read.
    res = cli("convert", str(root), "--target-from", "x", *FLAG_ARGS[name], check_rc=2)
    assert without_warnings(res.stderr) == f"error: {e.value}\n"
    assert res.stdout == ""
    assert tree_digest(tmp_path) == before


# -- options as objects ----------------------------------------------------------------------
# (options class, its keywords' TypedDict, the function, its arguments other than options)
FUNCTIONS = {
    "convert_step": (
        oml.ConvertOptions,
        options_module.ConvertKeywords,
        oml.convert_step,
        lambda p: ((p / "3", oml.Target({}, {})), {}),
    ),
    "merge_lora": (
        oml.MergeOptions,
        options_module.MergeKeywords,
        oml.merge_lora,
        lambda p: ((p / "sft" / "2", p / "base" / "0"), {"out": p / "merged"}),
    ),
    "export_hf": (
        oml.ExportOptions,
        export_module.ExportKeywords,
        oml.export_hf,
        lambda p: ((p / "3", p / "hf"), {"maxtext_config": ["base.yml"]}),
    ),
    "import_hf": (
        oml.ImportOptions,
        import_module.ImportKeywords,
        oml.import_hf,
        lambda p: ((p / "hf", p / "out"), {"maxtext_config": ["base.yml"]}),
    ),
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_options_are_frozen_keyword_only_objects_exported_by_the_package(name):
    kind, _, fn, _ = FUNCTIONS[name]
    assert getattr(oml, kind.__name__) is kind and kind.__name__ in oml.__all__
    made = kind()
    field = dataclasses.fields(kind)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, field, getattr(made, field))
    with pytest.raises(TypeError):
        kind(getattr(made, field))  # keywords only: no option is told by its place
    assert dataclasses.replace(made) == made
    # The function's third parameter; the others keyword-only, each option a keyword.
    params = list(inspect.signature(fn).parameters.values())
    assert params[2].name == "options" and params[2].default is None
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD


@pytest.mark.parametrize("name", FUNCTIONS)
def test_the_keywords_are_the_options_fields(name):
    """The keyword arguments' type (for type checkers) names each option with its type: a
    field added to the options is added there too."""
    kind, keywords, _, _ = FUNCTIONS[name]
    fields = {f.name: f.type for f in dataclasses.fields(kind)}
    hints = {k: v.__forward_arg__ for k, v in keywords.__annotations__.items()}
    assert hints == fields
    assert not keywords.__required_keys__ and typing.is_typeddict(keywords)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_options_with_option_keywords_are_refused_naming_them(name, tmp_path):
    """Refused before anything is read: none of the paths exists."""
    kind, _, fn, args = FUNCTIONS[name]
    positional, required = args(tmp_path)
    field = next(f.name for f in dataclasses.fields(kind) if f.name != "dry_run")
    with pytest.raises(oml.UsageError) as e:
        fn(*positional, kind(), **required, dry_run=True, **{field: None})
    message = str(e.value)
    assert message.startswith(f"{name}: options= and the keyword argument(s) dry_run, {field} ")
    assert kind.__name__ in message
    with pytest.raises(TypeError, match=rf"^{name}\(\) got an unexpected keyword argument 'nope'"):
        fn(*positional, **required, nope=1)
    with pytest.raises(TypeError, match=f"options must be a {kind.__name__}, not dict"):
        fn(*positional, {"dry_run": True}, **required)
    assert list(tmp_path.iterdir()) == []


def test_ignore_is_held_as_a_tuple():
    patterns = (p for p in ["a/*", "b"])  # read once, not used up by the plan's first leaf
    made = ConvertOptions(ignore=patterns)
    assert made.ignore == ("a/*", "b") and made == ConvertOptions(ignore=["a/*", "b"])
    assert hash(made) == hash(ConvertOptions(ignore=("a/*", "b")))


def _values(item_dir) -> dict:
    return {p: (v.dtype, v.shape, raw(v).tobytes()) for p, v in restore_flat(item_dir).items()}


def _report(report, root) -> dict:
    """A report without what differs between two runs in two directories: the paths, and the
    bytes written (the B-tree's files carry random names)."""
    d = report.to_dict()
    d.pop("bytes_written")
    return {k: v.replace(str(root), "<root>") if isinstance(v, str) else v for k, v in d.items()}


@pytest.mark.parametrize(
    "keywords",
    [
        dict(copy=True, optimizer="drop", memory_budget=1 << 20),
        dict(rescan="unroll", remove_legacy=True, ignore=["*/max_logits"]),
        dict(dry_run=True, optimizer="drop"),
    ],
    ids=["copy-drop", "unroll-remove", "dry-run"],
)
def test_convert_step_options_and_keywords_convert_alike(keywords, tmp_path):
    target = oml.Target.from_checkpoint(MAXTEXT_NATIVE)
    if keywords.get("rescan"):
        target = oml.unroll_target(target)
    runs = {}
    for way in ("keywords", "options"):
        step = copy_fixture(RL, tmp_path / way)
        if way == "keywords":
            report = oml.convert_step(step, target, **keywords)
        else:
            report = oml.convert_step(step, target, ConvertOptions(**keywords))
        written = sorted(p.name for p in step.iterdir())
        values = None if keywords.get("dry_run") else _values(step / "items")
        prov = oml.converted_provenance(step)
        if prov is not None:
            prov.pop("bytes_written")  # as the report's
        runs[way] = (_report(report, tmp_path / way), written, values, prov)
    assert runs["keywords"] == runs["options"]
    assert runs["options"][0]["status"] == ("dry-run" if keywords.get("dry_run") else "converted")


@pytest.mark.parametrize("way", ["keywords", "options"])
def test_a_renumbered_conversion_records_the_optimizer_mode_it_used(way, tmp_path):
    """``renumber=True`` moves the step, then converts it there with every option: the
    optimizer state dropped is recorded as dropped (it was recorded as converted, and
    verify then found 25 optimizer leaves missing)."""
    step = copy_fixture(RL, tmp_path)
    target = oml.Target.from_checkpoint(MAXTEXT_NATIVE)
    asked = dict(optimizer="drop", renumber=True)
    if way == "keywords":
        report = oml.convert_step(step, target, **asked)
    else:
        report = oml.convert_step(step, target, ConvertOptions(**asked))
    assert report.step_dir == str(step.parent / "1") and report.optimizer == "drop"
    assert report.destinations["opt_state"]["leaves"] == 0
    assert oml.converted_provenance(report.step_dir)["optimizer"] == "drop"
    verified = oml.verify_step(report.step_dir)
    assert verified.ok, verified.problems


def test_convert_step_takes_options_by_name_too(tmp_path):
    step = copy_fixture(RL, tmp_path)
    target = oml.Target.from_checkpoint(MAXTEXT_NATIVE)
    report = oml.convert_step(step, target, options=ConvertOptions(dry_run=True))
    assert report.status == "dry-run" and not (step / "items").exists()


@pytest.mark.parametrize(
    "keywords",
    [dict(alpha=8.0, memory_budget=1 << 10), dict(alpha=4.0, scan="unroll", dry_run=True)],
    ids=["budget", "unroll-dry-run"],
)
def test_merge_lora_options_and_keywords_merge_alike(keywords, tmp_path):
    b = write_base(tmp_path / "base", 0, base_params(layers=3, axis=1))
    a = write_adapters(tmp_path / "sft", 2, lora_factors(layers=3, axis=1, rank=4))
    if keywords.get("scan"):
        keywords = {**keywords, "target": oml.unroll_target(oml.Target.from_checkpoint(b))}
    runs = {}
    for way in ("keywords", "options"):
        out = tmp_path / way
        if way == "keywords":
            report = oml.merge_lora(a, b, out=out, **keywords)
        else:
            report = oml.merge_lora(a, b, oml.MergeOptions(**keywords), out=out)
        values = None if keywords.get("dry_run") else _values(out / "0" / "items")
        runs[way] = (_report(report, out), values)
    assert runs["keywords"] == runs["options"]


def test_load_params_from_path_binds_as_maxtext_calls_it():
    """MaxText 0.2.5's callers pass five arguments by place at most and
    ``enable_single_replica_ckpt_restoring`` by name (maxtext/common/checkpointing.py): the
    sixth is keyword-only here (at most five positional parameters in the package)."""
    sig = inspect.signature(oml.load_params_from_path)
    sig.bind("p", {}, 96, True, True, enable_single_replica_ckpt_restoring=False)
    with pytest.raises(TypeError):
        sig.bind("p", {}, 96, True, True, False)
