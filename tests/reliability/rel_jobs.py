"""Job functions run in forked children of `rel_zygote` (or as ``python rel_jobs.py``).

Each returns an exit code. They use only public APIs: the library's
`CheckpointManager` as MaxText drives it, and `bench/synth.py` as a training process.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (str(HERE), str(REPO / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def legacy_steps(directory: Path) -> dict[int, Path]:
    """``{presented MaxText step: directory}`` of the Tunix-layout steps under ``directory``.

    The manager presents Tunix directory ``N`` as step ``N - 1``; a moved directory
    records its Tunix number under ``TUNIX_STEP_KEY`` in the step metadata.
    """
    from orbax_maxtext_layout import Layout, detect_layout
    from orbax_maxtext_layout.integration.manager import TUNIX_STEP_KEY

    out = {}
    for child in sorted(Path(directory).iterdir()):
        if child.name.isdigit() and detect_layout(child) is Layout.TUNIX:
            meta = json.loads((child / "_CHECKPOINT_METADATA").read_text())
            n = int((meta.get("custom_metadata") or {}).get(TUNIX_STEP_KEY, child.name))
            out[n - 1] = child
    return out


def manager_cycle(directory: str, template: str, remove_legacy: bool = True) -> int:
    """What a resumed MaxText run does through the manager: restore, then save a step.

    Restores every legacy (Tunix-layout) step as MaxText items against the target of
    ``template`` (a pristine synthetic step of the same model), then saves the next
    step. The save moves and, once committed, migrates each restored legacy step.
    """
    import orbax.checkpoint as ocp
    import synth

    from orbax_maxtext_layout.base.treepaths import unflatten
    from orbax_maxtext_layout.integration.manager import CheckpointManager

    abstract = unflatten(dict(synth.target_for(Path(template)).abstract))
    mngr = CheckpointManager(
        Path(directory),
        item_names=("items",),
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
        remove_legacy=remove_legacy,
    )
    try:
        items = None
        for step in sorted(legacy_steps(Path(directory))):
            args = ocp.args.Composite(items=ocp.args.PyTreeRestore(item=abstract))
            items = mngr.restore(step, args=args)["items"]
        if items is None:
            return 0  # nothing left to migrate
        nxt = max(mngr.all_steps()) + 1
        mngr.save(nxt, args=ocp.args.Composite(items=ocp.args.PyTreeSave(items)), force=True)
        mngr.wait_until_finished()
    finally:
        mngr.close()
    return 0


def trainer(root: str, steps: list[int], size: int, log: str, pause: float = 0.0) -> int:
    """A training process saving new Tunix steps into ``root`` (``<root>/actor/<n>``).

    Appends ``<step> <time>`` to ``log`` once each step has committed.
    """
    import synth

    for s in steps:
        synth.make_step(Path(root), s, size, seed=s)
        with open(log, "a") as f:
            f.write(f"{s} {time.time()}\n")
        time.sleep(pause)
    return 0


# -- probes: anything that may fail inside Orbax runs here, not in the pytest process ------
# (a failed Orbax read leaves tensorstore threads that print tracebacks later; in the test
# process they race pytest's own traceback formatting, which CPython 3.11 cannot survive).
def _error(e: BaseException) -> dict:
    return {
        "type": type(e).__name__,
        "mro": [c.__name__ for c in type(e).__mro__],
        "message": str(e),
    }


def _restores(step: Path) -> dict:
    import rel_support as S

    out = {}
    for n in S.LEGACY:
        if (step / n).exists():
            try:
                out[n] = S.stock_restore(step / n)
            except Exception as e:  # a damaged item: compare the failure
                out[n] = f"unreadable: {type(e).__name__}"
    return out


def keep_step_numbers(argv: list[str]) -> list[str]:
    """``convert`` argv with Tunix's step numbers kept.

    The suite checks each step where it was (kills, faults, concurrency, damaged
    inputs); renumbering into MaxText's numbers is the CLI default, tested on its own
    (tests/test_numbering.py, tests/test_cli.py's concurrent converters).
    """
    argv = [str(a) for a in argv]
    if argv[:1] == ["convert"] and "--keep-step-numbers" not in argv:
        argv.append("--keep-step-numbers")
    return argv


def _cli(argv: list[str]) -> dict:
    import contextlib
    import io
    import traceback

    from orbax_maxtext_layout.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(keep_step_numbers(argv))
            uncaught = None
        except SystemExit as e:
            rc, uncaught = e.code, None
        except BaseException as e:
            traceback.print_exc()
            rc, uncaught = 1, type(e).__name__
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(), "uncaught": uncaught}


def probe_convert(step: str, target_from: str, out: str, cli: bool = True, **kw) -> int:
    """Converts a (damaged) step with the API, then the CLI; records what happened.

    JSON written to ``out``: ``error`` (type, mro, message) or None; ``items``: None, or
    the problem of the committed items/ against the oracle (None if equal); the legacy
    restores and the step digest before and after; ``cli`` (rc, stdout, stderr, uncaught).
    """
    import rel_support as S

    from orbax_maxtext_layout import Target, convert_step

    step_p = Path(step)
    target = Target.from_checkpoint(target_from)
    res: dict = {"digest_before": S.digest(step_p), "legacy_before": _restores(step_p)}
    try:
        convert_step(step_p, target, **kw)
        res["error"] = None
    except BaseException as e:  # the type is the finding
        res["error"] = _error(e)
    res["items_exist"] = (step_p / "items").exists()
    if res["items_exist"]:
        try:
            want = S.oracle(step_p, target)
        except Exception as e:
            want, res["oracle_error"] = {}, _error(e)
        res["items"] = S.restore_problem(step_p / "items", want)
    res["digest_after"] = S.digest(step_p)
    res["legacy_after"] = _restores(step_p)
    if cli and res["error"] is not None:
        res["cli"] = _cli(["convert", step, "--target-from", target_from, "-q"])
        res["digest_after_cli"] = S.digest(step_p)
    Path(out).write_text(json.dumps(res, default=list))
    return 0


def probe_verify(root: str, step: str, out: str) -> int:
    """`verify_step` on one step, then the CLI ``verify`` on the root."""
    from orbax_maxtext_layout import verify_step

    res: dict = {}
    try:
        r = verify_step(Path(step))
        res["result"] = {"ok": r.ok, "problems": r.problems}
    except BaseException as e:  # the type is the finding
        res["error"] = _error(e)
    res["cli"] = _cli(["verify", root])
    Path(out).write_text(json.dumps(res))
    return 0


def load_target(spec: str):
    """A MaxText checkpoint directory, or ``module:function`` returning a `Target`."""
    import importlib

    from orbax_maxtext_layout import Target

    if ":" in spec and not Path(spec).exists():
        module, _, fn = spec.partition(":")
        return getattr(importlib.import_module(module), fn)()
    return Target.from_checkpoint(spec)


def sweep(
    fixture: str,
    files: list[str],
    how: str,
    target_from: str,
    work: str,
    out: str,
    optimizer: str = "convert",
) -> int:
    """Damages each file of a fixture step in turn (on a fresh copy) and classifies the
    outcome of a conversion against the rule of test_rel_corrupt (None = as it should)."""
    import shutil

    import rel_support as S

    from orbax_maxtext_layout import CheckpointReadError, LayoutMismatchError, convert_step

    target = load_target(target_from)
    results = {}
    for i, rel in enumerate(files):
        step = S.copy_fixture(fixture, Path(work) / str(i))
        S.damage(step / rel, how)
        before = S.digest(step)
        try:
            convert_step(step, target, optimizer=optimizer)
            err = None
        except BaseException as e:  # the type is the finding
            err = e
        if err is None:
            try:
                want = S.oracle(step, target, optimizer=optimizer)
            except Exception:
                got = S.restore_problem(step / "items", {}) or ""
                kind = (
                    "damaged data committed"
                    if "cannot restore" in got
                    else "unreadable source converted into readable items (values invented)"
                )
            else:
                why = S.restore_problem(step / "items", want)
                kind = f"items/ differs from the source: {why}" if why else None
        elif isinstance(err, KeyError):
            kind = "KeyError"
        elif type(err) is ValueError and any(
            c in str(err) for c in ("FAILED_PRECONDITION", "OUT_OF_RANGE", "DATA_LOSS", "NOT_FOUND")
        ):
            kind = "tensorstore error escaped"
        elif not isinstance(err, CheckpointReadError | LayoutMismatchError):
            kind = f"{type(err).__name__} escaped: {err}"
        elif str(step / rel.split("/")[0]) not in str(err) and str(step) not in str(err):
            kind = f"error does not name {rel.split('/')[0]}: {str(err)[:200]}"
        elif S.digest(step) != before:
            kind = "the refused step was modified"
        else:
            kind = None
        results[rel] = kind
        shutil.rmtree(Path(work) / str(i))
    Path(out).write_text(json.dumps(results))
    return 0


def read_specs_fuzz(item: str, contents: list[str], out: str) -> int:
    """`read_specs` over each hex-encoded ``_METADATA`` content: what escaped, by type."""
    from orbax_maxtext_layout import CheckpointReadError, read_specs

    meta = Path(item) / "_METADATA"
    original = meta.read_bytes()
    escaped: dict[str, str] = {}
    for c in contents:
        meta.write_bytes(bytes.fromhex(c))
        try:
            read_specs(Path(item))
        except CheckpointReadError:
            pass
        except BaseException as e:  # the finding
            escaped.setdefault(type(e).__name__, f"{c[:80]}: {e}"[:300])
    meta.write_bytes(original)
    Path(out).write_text(json.dumps(escaped))
    return 0


if __name__ == "__main__":  # python rel_jobs.py FUNC JSON_KWARGS
    sys.exit(globals()[sys.argv[1]](**json.loads(sys.argv[2])))
