"""Wrong targets: another model, the same model at another size, the other scan form, an
optimizer that does not match. Every offending path must be listed (checked against an
independent diff of the two trees), nothing written, CLI exit 1 naming the step."""

from __future__ import annotations

import json

import pytest
import rel_support as S
import rel_targets as T

from orbax_maxtext_layout import LayoutMismatchError, convert_step, read_specs
from orbax_maxtext_layout.base.treepaths import keystr


def model_view(step) -> dict:
    """``{model path: (source path, spec)}``: the adapter ``base`` and ``value`` levels off."""
    out = {}
    for p, s in read_specs(step / "model_params").items():
        q = p[:-1] if p[-1] == "value" else p
        q = q[1:] if q[:1] == ("base",) else q
        out[q] = (p, s)
    return out


def expected_model_offences(step, target) -> set[str]:
    src = model_view(step)
    tgt = {**target.params, **target.nnx_aux}
    bad = {keystr(p) for q, (p, s) in src.items() if q not in tgt or not s.same_layout(tgt[q])}
    return bad | {keystr(q) for q in tgt if q not in src}


def listed(problems: list[str]) -> set[str]:
    return {p.split(": ", 1)[0] for p in problems}


def refused(step, target, target_name: str) -> LayoutMismatchError:
    """API and CLI refuse with LayoutMismatchError; nothing is written."""
    before = S.digest(step)
    with pytest.raises(LayoutMismatchError) as info:
        convert_step(step, target)
    assert S.digest(step) == before
    res = S.zygote().cli("convert", step, "--target", f"rel_targets:{target_name}", "-q")
    assert res.rc == 1 and not res.traceback, res.stderr[-800:]
    assert f"{step}: LayoutMismatchError" in res.stderr, res.stderr
    assert S.digest(step) == before and not (step / "items").exists()
    S.count("bad_inputs")
    return info.value


CASES = [
    pytest.param(S.RL, "other_model", "same model config", id="another-model"),
    pytest.param(S.RL, "wider", "same model config", id="same-model-other-size"),
    pytest.param(S.DPO, "native", "scan form", id="scanned-target-unscanned-checkpoint"),
    pytest.param(S.RL, "unscanned", "scan form", id="unscanned-target-scanned-checkpoint"),
    pytest.param(S.SFT, "unscanned", "scan form", id="unscanned-target-scanned-sft"),
]


@pytest.mark.parametrize("fixture,target_name,hint", CASES)
def test_wrong_model_lists_every_offending_path(fixture, target_name, hint, tmp_path):
    step = S.copy_fixture(fixture, tmp_path)
    target = getattr(T, target_name)()
    err = refused(step, target, target_name)
    want = expected_model_offences(step, target)
    assert listed(err.problems) == want, sorted(listed(err.problems) ^ want)[:10]
    assert f"({len(want)} offending paths)" in err.summary and hint in err.hint
    # inspect shows the same list, metadata only
    out = S.zygote().cli("inspect", step, "--target", f"rel_targets:{target_name}", "--json")
    assert out.rc == 0, out.stderr
    (entry,) = json.loads(out.stdout)
    assert listed(m.removeprefix("  ") for m in entry["mismatch"][1:]) >= want


def test_optimizer_with_other_moment_dtype_lists_every_moment(tmp_path):
    step = S.copy_fixture(S.RL, tmp_path)
    target = T.bf16_moments()
    err = refused(step, target, "bf16_moments")
    mu = {f"opt_state/{keystr(p)}" for p in target.opt_state if "mu" in p}
    assert len(mu) == 12 and listed(err.problems) == mu, err.problems
    assert all("target expects bfloat16" in p for p in err.problems)
    assert "optimizer='drop'" in err.hint


def test_optimizer_of_another_recipe_is_refused_and_drop_converts(tmp_path):
    """SFT's chain(clip, adamw) for a target holding RL's inject_hyperparams shell."""
    step = S.copy_fixture(S.SFT, tmp_path)
    target = T.native()
    err = refused(step, target, "native")
    assert err.problems and all(p.startswith("opt_state/") for p in err.problems)
    assert "optimizer='drop'" in err.hint and "--optimizer drop" in err.hint
    res = S.zygote().cli("convert", step, "--target", "rel_targets:native", "--optimizer", "drop")
    assert res.rc == 0, res.stderr
    assert S.stock_restore(step / "items") == S.oracle(step, target, optimizer="drop")
