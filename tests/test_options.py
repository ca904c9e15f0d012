"""The conversion options that cannot go together: one check (`options.check`), made by
`convert_step` before anything is read or moved and by ``convert`` before the target is built,
each naming the options as its caller wrote them."""

from __future__ import annotations

import pytest
from conftest import MAXTEXT_NATIVE, RL_ACTOR_STEPS, copy_fixture, tree_digest, without_warnings
from test_cli import cli

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.execute.options import FLAGS, KEYWORDS, ConvertOptions, check

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
