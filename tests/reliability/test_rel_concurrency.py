"""Concurrency: several converters on one root, a converter beside a training process that
keeps saving new steps into it, and a converter meeting one that is paused mid-step.

No step may be corrupted, none converted twice, and a step still being written or converted
by someone else is left alone or converted completely.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import rel_support as S

import orbax_maxtext_layout as oml

SIZE = 4 << 20
LOCK = ".orbax-maxtext-layout.lock"

BUG_UNLOCKED_REMOVAL = (
    "BUG: convert_step's 'already has items/' branch (finishing an in-place/remove-legacy "
    "run) verifies and removes the legacy items without taking the step lock: converter B "
    "meeting a step whose live owner A is halfway through its own removal verifies against "
    "the half-deleted legacy items and fails (exit 1, CheckpointReadError 'model_params: no "
    "_METADATA') for a step that is fine; earlier in A's removal both delete concurrently. "
    "B should leave a step locked by a live process alone ('locked')."
)


@pytest.fixture(scope="module")
def base() -> Path:
    return S.cached_synth_root("concurrency", list(range(10, 16)), SIZE)


@pytest.fixture(scope="module")
def target(base):
    import synth

    return synth.target_for(S.template_step(base))


def _argv(root: Path, *extra: str) -> list:
    return [
        "convert",
        root,
        "--target",
        "synth:target_from_env",
        "--json",
        "--keep-step-numbers",
        *extra,
    ]


def _statuses(outputs: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for text in outputs:
        for r in json.loads(text):
            out.setdefault(r["step_dir"], []).append(r["status"])
    return out


def _check_converted_once(root: Path, outputs: list[str], target) -> None:
    statuses = _statuses(outputs)
    steps = oml.find_steps(root)
    for s in steps:
        assert statuses[str(s.path)].count("converted") == 1, (s.path, statuses[str(s.path)])
        assert s.layout is oml.Layout.MAXTEXT
        assert S.stock_restore(s.path / "items") == S.oracle(s.path, target), s.path
        assert not S.leftovers(s.path), (s.path, S.leftovers(s.path))


def test_three_converters_convert_each_step_once(base, target, tmp_path):
    root = S.copy_root(base, tmp_path / "run")
    z = S.zygote()
    env = S.child_env(S.template_step(base))
    handles = [
        z.start({"kind": "cli", "argv": [str(a) for a in _argv(root)]}, env=env) for _ in range(3)
    ]
    results = [z.wait(h) for h in handles]
    assert [r.rc for r in results] == [0, 0, 0], [r.stderr[-300:] for r in results]
    _check_converted_once(root, [r.stdout for r in results], target)
    S.count("faults")


@pytest.mark.slow  # a converter beside a training process: .ci/run's slow pass
def test_converter_beside_a_training_process(base, target, tmp_path):
    """A trainer saves steps 20..25 into the root (Orbax: tmp dir, then rename) while the
    converter runs again and again, as a cron job would."""
    root = S.copy_root(base, tmp_path / "run")
    z = S.zygote()
    log = tmp_path / "trainer.log"
    new = list(range(20, 26))
    trainer = z.start(
        {
            "kind": "call",
            "func": "rel_jobs:trainer",
            "kwargs": {
                "root": str(root),
                "steps": new,
                "size": SIZE,
                "log": str(log),
                "pause": 0.1,
            },
        }
    )
    env = S.child_env(S.template_step(base))
    outputs, runs = [], 0
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        done = log.exists() and len(log.read_text().splitlines()) == len(new)
        res = z.cli(*_argv(root), env=env)
        assert res.rc == 0 and not res.traceback, res.stderr[-600:]
        outputs.append(res.stdout)
        runs += 1
        if done:
            break
    trained = z.wait(trainer)
    assert trained.rc == 0, trained.stderr[-600:]
    assert runs >= 2
    _check_converted_once(root, outputs, target)
    assert {s.step for s in oml.find_steps(root)} == set(range(10, 16)) | set(new)
    S.count("faults")
    print(json.dumps({"converter_runs": runs}))


def _wait_stopped(pid: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return
        assert state != "Z", f"pid {pid} exited before reaching the pause point"
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} never stopped")


def test_second_converter_leaves_a_step_whose_owner_is_alive(base, target, tmp_path):
    """A (--in-place) is paused halfway through removing the legacy items (after its
    commit, holding the lock); B (--in-place) runs to the end; then A resumes."""
    root = tmp_path / "run"
    S.make_synth_root(root, [10], SIZE)  # one step; its legacy is the oracle
    step = root / "actor" / "10"
    want = S.oracle(step, target)
    z = S.zygote()
    env = S.child_env(S.template_step(base))
    count = tmp_path / "calls.json"
    job = {"kind": "cli", "argv": [str(a) for a in _argv(root, "--in-place")]}
    probe_root = tmp_path / "probe"
    S.make_synth_root(probe_root, [10], SIZE)
    calls = z.run(
        {
            **job,
            "argv": [str(a) for a in _argv(probe_root, "--in-place")],
            "kill_on_call": {"calls": S.MUTATIONS, "count_file": str(count)},
        },
        env=env,
    )
    assert calls.rc == 0
    labels = json.loads(count.read_text())
    rmdirs = [c for c in labels if c == "finish_set_aside>rmdir"]
    assert rmdirs, labels
    pause = {  # before the middle rmdir of the legacy removal: half of it is gone
        "calls": S.MUTATIONS,
        "at_label": "finish_set_aside>rmdir",
        "occurrence": len(rmdirs) // 2 + 1,
        "signal": "SIGSTOP",
    }
    a = z.start({**job, "kill_on_call": pause}, env=env)
    S.count("faults")
    try:
        _wait_stopped(a[1])
        assert (step / "items").is_dir() and (step / LOCK).exists()
        b = z.cli(*_argv(root, "--in-place"), env=env)
    finally:
        os.kill(a[1], signal.SIGCONT)  # our own child, resumed (not ended)
    ra = z.wait(a)
    assert b.rc == 0 and json.loads(b.stdout)[0]["status"] == "locked", b.stdout[-400:]
    assert ra.rc == 0, ra.stderr[-600:]
    assert S.stock_restore(step / "items") == want
    assert not S.legacy_digest(step) and not S.leftovers(step)
