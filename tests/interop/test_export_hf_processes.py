"""Interop (issue 24): `export-hf` on several processes, and killed with SIGKILL.

The step: MaxText 0.2.5's pre-training step of the tiny llama3.1 override
(tests/fixtures/maxtext025/pretrain_run/checkpoints/1), copied first; every export is
``export-hf STEP --out OUT --override-model-architecture --max-shard-size 4KB
--hf-model-path tests/fixtures/hf_tokenizer --json --maxtext-config <base.yml> <model keys>``
(14 shards of the 30 tensors), compared with one uninterrupted 1-process export of the same
step, file by file, byte for byte (the shards, the index, ``config.json``, the tokenizer).

- Several processes: ``--process-index 0/1 --process-count 2`` on the same ``--out``, started
  together as fresh ``python -m orbax_maxtext_layout`` processes, and again with process 1
  started only once process 0 has written its params and is waiting (it must go on waiting,
  publishing nothing). On a disk the processes share every file (each writes the tensors of
  the params it owns into common part files); the reports say so; nothing is left beside
  ``--out``.
- Crash safety: a single-process export SIGKILLed at seeded points of its work, each a
  boundary of the protocol (a tensor being written into a part file; a shard renamed into
  place; the ``.done-0`` marker written; the index and tokenizer written, ``config.json`` not
  yet; right before the work directory's rename to ``--out``). After each kill the work
  directory is checked to be in the state of that point, and nothing is listable under
  ``--out``; the same command then completes, equal to the uninterrupted export, with no
  ``.part.``/``.done-`` file or work directory left.
- Markers of another export are not trusted: a ``.done-1`` (and process 1's shards) of an
  export with another shard size in the work directory does not stop process 0 from waiting,
  and none of that export's files are published; a ``.done-0`` of a 2-process export killed
  while waiting does not make a 1-process rerun skip the shards process 1 never wrote.

The kills: the export of this model writes for a few milliseconds after seconds of planning,
so time-based kills would almost all land in the planning. Each killed run is a child of a
fork server (export_hf_zygote.py: MaxText and the library imported once) that wraps
``os.replace``/``os.rename``/``os.pwrite`` and SIGKILLs itself right before or after the
chosen call; the library itself is unchanged and reads no test switch. The occurrences
(which tensor write, which shard) are drawn from a seeded generator.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import hf_export_support as S
import maxtext_loop_support as L
import pytest

HERE = Path(__file__).resolve().parent
TOKENIZER = L.TESTS_DIR / "fixtures" / "hf_tokenizer"
SHARD_SIZE = "4KB"  # 14 shards of the tiny model's 30 tensors (39,360 bytes)
OTHER_SHARD_SIZE = "16KB"  # another export of the same step: other shard names
SEED = int(os.environ.get("OMTL_RELIABILITY_SEED", "20261202"))
WORK = ".export-hf-tmp"
SHARD_RE = r"^model-\d{5}-of-\d{5}\.safetensors$"
TIMEOUT_S = 600


# ----------------------------------------------------------------------------- processes


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "JAX_PLATFORMS": "cpu",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            # this checkout's library (the venv may hold another editable install)
            "PYTHONPATH": os.pathsep.join([str(L.REPO), str(HERE)]),
        }
    )
    return env


class Zygote:
    """The fork server (export_hf_zygote.py): `start` forks a child running the CLI."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.err = open(logs / "zygote.stderr", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "export_hf_zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=_env(),
            text=True,
        )
        ready = self.proc.stdout.readline()
        assert ready.startswith('{"ready"'), (logs / "zygote.stderr").read_text()[-3000:]
        self.names: dict[int, str] = {}

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def start(self, name: str, argv: list[str], kill: dict | None = None) -> int:
        req = {
            "op": "start",
            "argv": [str(a) for a in argv],
            "stdout": str(self.logs / f"{name}.stdout"),
            "stderr": str(self.logs / f"{name}.stderr"),
            "kill": kill,
        }
        pid = self._ask(req)["pid"]
        self.names[pid] = name
        return pid

    def poll(self, pid: int) -> int | None:
        return self._ask({"op": "poll", "pid": pid})["rc"]

    def wait(self, pid: int, timeout: float = TIMEOUT_S) -> int:
        return self._ask({"op": "wait", "pid": pid, "timeout": timeout})["rc"]

    def report(self, pid: int) -> dict:
        return _report((self.logs / f"{self.names[pid]}.stdout").read_text())

    def why(self, pid: int) -> str:
        name = self.names[pid]
        tail = (self.logs / f"{name}.stderr").read_text(errors="replace")[-3000:]
        return f"{name}:\n{tail}"

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.err.close()


def _report(stdout: str) -> dict:
    """The ``--json`` report in a child's stdout (anything printed before it skipped)."""
    return json.loads(stdout[stdout.index("\n{") + 1 :] if not stdout.startswith("{") else stdout)


def _argv(step: Path, out: Path, *extra: str, shard_size: str = SHARD_SIZE) -> list[str]:
    return [
        "export-hf",
        str(step),
        "--out",
        str(out),
        "--override-model-architecture",
        "--max-shard-size",
        shard_size,
        "--hf-model-path",
        str(TOKENIZER),
        "--json",
        *extra,
        "--maxtext-config",
        str(L.base_yml()),
        *S.model_keys(),
    ]


def _processes(i: int, n: int = 2) -> tuple[str, ...]:
    return ("--process-index", str(i), "--process-count", str(n))


# ----------------------------------------------------------------------------- files


def _digest(directory: Path) -> dict[str, str]:
    """``{file name: sha256}`` of ``directory`` (which holds files only)."""
    out = {}
    for p in sorted(directory.iterdir()):
        assert p.is_file(), f"{p}: not a file"
        out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _beside(out: Path) -> list[str]:
    """What the export left beside ``out`` (its work directory, anything named after it)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f"{out.name}."))


def _listable(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


def _work(out: Path) -> Path:
    return out.parent / f"{out.name}{WORK}"


def _assert_published(out: Path, reference: dict[str, str]) -> None:
    got = _digest(out)
    assert sorted(got) == sorted(reference), (sorted(set(got) ^ set(reference)), out)
    differ = [n for n in got if got[n] != reference[n]]
    assert not differ, f"{out}: not byte-identical to the 1-process export: {differ}"
    assert _beside(out) == [], _beside(out)
    assert not [n for n in got if ".part." in n or n.startswith(".done-")], sorted(got)


def _wait_for(predicate, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export_hf_processes")


@pytest.fixture(scope="module")
def zygote(work):
    z = Zygote(work / "logs")
    yield z
    z.close()


@pytest.fixture(scope="module")
def step(work) -> Path:
    return L.copy_tree(L.PRETRAIN_STEP, work / "pretrain" / "checkpoints" / "1")


@pytest.fixture(scope="module")
def reference(zygote, step, work) -> dict:
    """The uninterrupted 1-process export: ``files`` (name -> sha256), ``report``."""
    out = work / "reference"
    pid = zygote.start("reference", _argv(step, out))
    assert zygote.wait(pid) == 0, zygote.why(pid)
    files = _digest(out)
    report = zygote.report(pid)
    shards = [s["name"] for s in report["shards"]]
    assert len(shards) >= 3, shards
    assert report["status"] == "exported" and report["files"] == sorted(files)
    assert set(files) >= {*shards, "model.safetensors.index.json", "config.json"}
    assert _beside(out) == []
    return {"files": files, "report": report, "shards": shards}


# ----------------------------------------------------------------------------- 1. processes


def _check_two(out: Path, r0: dict, r1: dict, reference: dict) -> None:
    _assert_published(out, reference["files"])
    shards = reference["shards"]
    assert r0["status"] == "exported" and r0["files"] == sorted(reference["files"])
    assert r0["process"] == {"index": 0, "count": 2}
    # process 1 wrote its params' tensors into the shared files, and published nothing
    assert r1["status"] == "shards written" and r1["files"] == []
    assert r1["process"] == {"index": 1, "count": 2}
    # on a disk the processes share every file (each decodes only the params it owns)
    for r in (r0, r1):
        assert [s["name"] for s in r["shards"]] == shards
        assert {s["process"] for s in r["shards"]} == {None}


def test_two_processes_write_what_one_writes(step, reference, work):
    """Two fresh CLI processes (``python -m orbax_maxtext_layout``) started together."""
    out = work / "two" / "hf"
    procs = []
    for i in (1, 0):
        log = work / "logs" / f"two_p{i}"
        cmd = [sys.executable, "-m", "orbax_maxtext_layout", *_argv(step, out, *_processes(i))]
        with open(f"{log}.stdout", "wb") as o, open(f"{log}.stderr", "wb") as e:
            procs.append((i, log, subprocess.Popen(cmd, stdout=o, stderr=e, env=_env())))
    reports = {}
    for i, log, p in procs:
        assert p.wait(timeout=TIMEOUT_S) == 0, Path(f"{log}.stderr").read_text()[-3000:]
        reports[i] = _report(Path(f"{log}.stdout").read_text())
    _check_two(out, reports[0], reports[1], reference)


def test_process_0_waits_for_a_late_process_1(zygote, step, reference, work):
    out = work / "late" / "hf"
    p0 = zygote.start("late_p0", _argv(step, out, *_processes(0)))
    _wait_for(lambda: (_work(out) / ".done-0").exists() or zygote.poll(p0) is not None, ".done-0")
    time.sleep(3.0)  # process 0 has written its shards and waits: well after, process 1 starts
    assert zygote.poll(p0) is None, zygote.why(p0)
    assert _listable(out) == [] and not (_work(out) / ".done-1").exists()
    p1 = zygote.start("late_p1", _argv(step, out, *_processes(1)))
    assert zygote.wait(p1) == 0, zygote.why(p1)
    assert zygote.wait(p0) == 0, zygote.why(p0)
    _check_two(out, zygote.report(p0), zygote.report(p1), reference)


# ----------------------------------------------------------------------------- 2. kills


def _kill_points(reference: dict) -> list[tuple[str, dict, object]]:
    """(name, the kill, the state of the work directory it must leave), seeded."""
    rng = random.Random(SEED)
    shards = reference["shards"]
    n, tensors = len(shards), reference["report"]["tensors"]
    write = rng.randint(n + 1, n + tensors)  # the first n writes are the shards' headers
    renamed = rng.randint(2, n - 1)

    def shards_in_place(k: int):
        def check(names: set[str]) -> list[str]:
            placed = sorted(names & set(shards))
            parts = [x for x in names if ".part." in x]
            bad = []
            if len(placed) != k or len(parts) != n - k:
                bad.append(f"{len(placed)} shards, {len(parts)} part files (want {k}, {n - k})")
            return bad + sorted(x for x in names if x.startswith(".done-"))

        return check

    def exactly(present: set[str], absent: set[str]):
        def check(names: set[str]) -> list[str]:
            return [f"missing {x}" for x in sorted(present - names)] + [
                f"unexpected {x}" for x in sorted(absent & names)
            ]

        return check

    index, config = "model.safetensors.index.json", "config.json"
    tokenizer = {"tokenizer.json", "tokenizer_config.json"}
    return [
        (
            f"tensor write {write - n} of {tensors}",
            {"call": "pwrite", "occurrence": write},
            shards_in_place(0),
        ),
        (
            "first shard renamed into place",
            {"call": "replace", "match": SHARD_RE, "occurrence": 1, "when": "after"},
            shards_in_place(1),
        ),
        (
            f"shard {renamed} of {n} renamed into place",
            {"call": "replace", "match": SHARD_RE, "occurrence": renamed, "when": "after"},
            shards_in_place(renamed),
        ),
        (
            ".done-0 written",
            {"call": "replace", "match": r"^\.done-0$", "when": "after"},
            exactly({*shards, ".done-0"}, {index, config}),
        ),
        (
            "index and tokenizer written, config.json not",
            {"call": "replace", "match": r"^config\.json$", "when": "before"},
            exactly({*shards, ".done-0", index, *tokenizer}, {config}),
        ),
        (
            "right before the rename to --out",
            {"call": "rename", "match": r"^hf$", "when": "before"},
            exactly({*shards, index, config, *tokenizer}, {".done-0"}),
        ),
    ]


def test_sigkill_leaves_nothing_under_out_and_the_rerun_completes(zygote, step, reference, work):
    points = _kill_points(reference)
    runs = []
    for k, (name, kill, check) in enumerate(points):
        out = work / f"kill{k}" / "hf"
        argv = _argv(step, out)
        runs.append((name, out, argv, check, zygote.start(f"kill{k}", argv, kill)))
    reruns = []
    for name, out, argv, check, pid in runs:
        rc = zygote.wait(pid)
        assert rc == -9, f"[{name}] not killed (exit {rc}): {zygote.why(pid)}"
        assert _listable(out) == [], f"[{name}] listable under --out: {_listable(out)}"
        names = {p.name for p in _work(out).iterdir()}
        problems = check(names)
        assert not problems, f"[{name}] the kill did not land there: {problems}; {sorted(names)}"
        reruns.append((name, out, zygote.start(f"rerun_{out.parent.name}", argv)))
    for name, out, pid in reruns:
        assert zygote.wait(pid) == 0, f"[{name}] rerun: {zygote.why(pid)}"
        _assert_published(out, reference["files"])
        assert zygote.report(pid)["status"] == "exported"
    print(json.dumps({"seed": SEED, "kills": [r[0] for r in runs]}))


# ----------------------------------------------------------------------------- 3. stale markers


def test_a_marker_of_another_export_is_not_trusted(zygote, step, reference, work):
    """Process 1 of an export with another shard size left its shards and ``.done-1`` (its
    process 0 never ran); the export with this shard size does not take them for its own."""
    out = work / "stale" / "hf"
    other = zygote.start(
        "stale_other_p1", _argv(step, out, *_processes(1), shard_size=OTHER_SHARD_SIZE)
    )
    assert zygote.wait(other) == 0, zygote.why(other)
    left = {p.name for p in _work(out).iterdir()}
    stale_marker = (_work(out) / ".done-1").read_text()
    other_shards = [s["name"] for s in zygote.report(other)["shards"]]
    # its shared part files: one per shard of that export, none renamed (no process 0)
    parts = {f"{n}.part.shared.{stale_marker[:16]}" for n in other_shards}
    assert left == {".done-1", *parts}, left
    assert not set(other_shards) & set(reference["shards"])  # other names: never rewritten

    p0 = zygote.start("stale_p0", _argv(step, out, *_processes(0)))
    _wait_for(lambda: (_work(out) / ".done-0").exists() or zygote.poll(p0) is not None, ".done-0")
    time.sleep(3.0)
    assert zygote.poll(p0) is None, f"process 0 did not wait: {zygote.why(p0)}"
    assert (_work(out) / ".done-1").read_text() == stale_marker
    assert (_work(out) / ".done-0").read_text() != stale_marker
    assert _listable(out) == []
    p1 = zygote.start("stale_p1", _argv(step, out, *_processes(1)))
    assert zygote.wait(p1) == 0, zygote.why(p1)
    assert zygote.wait(p0) == 0, zygote.why(p0)
    _check_two(out, zygote.report(p0), zygote.report(p1), reference)


def test_a_marker_of_another_process_count_is_not_trusted(zygote, step, reference, work):
    """Process 0 of a 2-process export killed while waiting for process 1 left its shards and
    ``.done-0``; rerun as one process, the export writes every shard (not only process 0's)."""
    out = work / "count" / "hf"
    argv = _argv(step, out, *_processes(0))
    p0 = zygote.start("count_p0", argv)
    _wait_for(lambda: (_work(out) / ".done-0").exists() or zygote.poll(p0) is not None, ".done-0")
    assert zygote.poll(p0) is None, zygote.why(p0)
    os.kill(p0, signal.SIGKILL)  # the server's child, not reaped yet: the pid is still that process
    assert zygote.wait(p0) == -9
    shards = reference["shards"]
    marker = (_work(out) / ".done-0").read_text()
    parts = {f"{n}.part.shared.{marker[:16]}" for n in shards}
    assert {p.name for p in _work(out).iterdir()} == {".done-0", *parts}
    assert _listable(out) == []
    pid = zygote.start("count_rerun", _argv(step, out))
    assert zygote.wait(pid) == 0, zygote.why(pid)
    _assert_published(out, reference["files"])
