"""Shared helpers of the reliability suite: checkpoints, comparisons, processes, file systems.

Nothing is mocked: faults are real SIGKILLs, real full or read-only file systems, and real
damaged files. Every case checks two things: the exact error (type, the path named, the
CLI exit code) and that the source still restores bit-identically with stock Orbax.

Environment:
  OMTL_RELIABILITY_FULL=1     the full run (every kill point and file, larger steps)
  OMTL_RELIABILITY_SEED=N     seed of every random choice (default 20261129)
  OMTL_RELIABILITY_STATS=F    append the suite's counters (crash points, faults, bad inputs,
                              fuzzed inputs, crash states seen) to JSON file F at exit
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TESTS = REPO / "tests"
FIXTURES = TESTS / "fixtures"
BENCH = REPO / "bench"
MAXTEXT_NATIVE = FIXTURES / "maxtext_native" / "run" / "checkpoints" / "2"
RL = "tunix017/rl_run/checkpoints/actor/2"
SFT = "tunix017/sft_run/checkpoints/1"
DPO = "tunix017/dpo_run/checkpoints/1"  # unscanned, with the adapter level
PATHWAYS = "tunix017_pathways_style/actor/1"  # one zarr directory per array
V1_RL = "tunix_snapshot_v1/rl_run/checkpoints/actor/2"  # zarr3
for _p in (str(HERE), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

FULL = os.environ.get("OMTL_RELIABILITY_FULL", "") not in ("", "0")
SEED = int(os.environ.get("OMTL_RELIABILITY_SEED", "20261129"))
LEGACY = ("model_params", "optimizer_state")


def scale(default: int, full: int) -> int:
    """``default`` in CI, ``full`` with OMTL_RELIABILITY_FULL=1."""
    return full if FULL else default


# -- counters for docs/reliability.md ---------------------------------------------------
STATS: collections.Counter = collections.Counter()


def count(name: str, n: int = 1) -> None:
    STATS[name] += n


@atexit.register
def _dump_stats() -> None:
    out = os.environ.get("OMTL_RELIABILITY_STATS")
    if out and STATS:
        with open(out, "a") as f:
            f.write(json.dumps(dict(STATS), sort_keys=True) + "\n")


# -- checkpoints on disk ----------------------------------------------------------------
def chmod_tree(root: Path) -> None:
    for r, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(r, name), 0o755)
        for name in files:
            os.chmod(os.path.join(r, name), 0o644)


def copy_fixture(rel: str, dest: Path) -> Path:
    """Copies a frozen fixture step to ``dest/<rel>`` (writable); returns the step dir."""
    out = Path(dest) / rel
    shutil.copytree(FIXTURES / rel, out, symlinks=True)
    chmod_tree(out)
    return out


def digest(root: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """``{relative path: sha256}`` of every file (and ``-> target`` of every symlink)."""
    out = {}
    root = Path(root)
    for r, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            p = Path(r) / name
            rel = str(p.relative_to(root))
            if any(rel == e or rel.startswith(e + "/") for e in exclude):
                continue
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def legacy_digest(step: Path) -> dict[str, str]:
    """Digest of a step's legacy items (``model_params``/``optimizer_state``) only."""
    out = {}
    for name in LEGACY:
        if (step / name).exists():
            out.update({f"{name}/{k}": v for k, v in digest(step / name).items()})
    return out


def leftovers(step: Path) -> list[str]:
    """Temporary directories and lock files left in a step directory."""
    return sorted(c.name for c in Path(step).iterdir() if "tmp" in c.name or "lock" in c.name)


# -- stock Orbax ------------------------------------------------------------------------
Restored = dict[str, tuple[str, tuple[int, ...], str]]


def settle(err: BaseException | None = None) -> None:
    """Finalizes what a failed Orbax read leaves behind, now.

    A read that fails inside Orbax leaves never-awaited coroutines, kept alive by the
    frames of the exception's traceback (and of its cause). If the garbage collector
    finalizes them later, in the middle of pytest's ``ast.parse`` of a failure report,
    CPython 3.11 aborts the whole run ("AST constructor recursion depth mismatch"). So
    the tracebacks are dropped (the message and type are what the tests check) and the
    garbage collected here.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        err.__traceback__ = None
        nxt = err.__cause__ or err.__context__
        err = nxt
    gc.collect()


def stock_tree(item_dir: Path) -> Any:
    """What stock Orbax restores from an item, with no target (typed PRNG keys), each leaf
    placed on the default device (`conftest.stock_restore`), not where its _sharding says."""
    if str(TESTS) not in sys.path:  # a child process (the zygote's jobs)
        sys.path.append(str(TESTS))
    from conftest import stock_restore as placed_stock_restore

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return placed_stock_restore(os.path.abspath(item_dir))


def hashed(tree: Any) -> Restored:
    """``{path: (dtype, shape, sha256 of the bytes)}``; typed keys through their key data."""
    import jax
    import numpy as np

    from orbax_maxtext_layout.base.treepaths import flatten, keystr

    out = {}
    for path, x in flatten(tree, is_leaf=lambda v: hasattr(v, "dtype")).items():
        dtype = str(x.dtype)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        raw = np.ascontiguousarray(np.asarray(x))
        digest_ = hashlib.sha256(raw.tobytes()).hexdigest()
        out[keystr(tuple(str(k) for k in path))] = (dtype, tuple(raw.shape), digest_)
    return out


def stock_restore(item_dir: Path) -> Restored:
    """Restores an item with stock Orbax, no target: ``{path: (dtype, shape, sha256)}``."""
    return hashed(stock_tree(item_dir))


def oracle(step: Path, target: Any, **kw: Any) -> Restored:
    """The items a correct conversion of ``step`` holds: stock Orbax restores of the legacy
    items, converted in memory (`to_maxtext_items`, no file I/O of the library)."""
    from orbax_maxtext_layout import to_maxtext_items

    opt = stock_tree(step / "optimizer_state") if (step / "optimizer_state").is_dir() else None
    step_no = int(step.name) if step.name.isdigit() else None
    return hashed(
        to_maxtext_items(stock_tree(step / "model_params"), opt, target, step=step_no, **kw)
    )


def restore_problem(item_dir: Path, want: Restored) -> str | None:
    """None if ``item_dir`` restores with stock Orbax to exactly ``want``, else why not."""
    try:
        got = stock_restore(item_dir)
    except Exception as e:  # any failure to restore is the finding
        settle(e)
        return f"{item_dir}: stock Orbax cannot restore it: {type(e).__name__}: {e}"[:400]
    if got != want:
        diff = sorted(set(got) ^ set(want)) or [k for k in want if got.get(k) != want[k]]
        return f"{item_dir}: restores, but differs at {diff[:5]}"
    return None


def restore_legacy(step: Path) -> dict[str, Restored]:
    return {n: stock_restore(step / n) for n in LEGACY if (step / n).is_dir()}


def ocdbt_values(item_dir: Path) -> dict[str, set[str]]:
    """``{data file relative to item_dir: {array names whose chunks it stores}}``.

    Walks the item's OCDBT B-tree (``tensorstore.ocdbt.dump``). Small values live inline in
    the B-tree nodes; the files listed here hold the larger ones.
    """
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "file", "path": os.path.abspath(item_dir) + "/"}).result()
    out: dict[str, set[str]] = collections.defaultdict(set)
    todo = [ts.ocdbt.dump(kv).result()["versions"][-1]["root"]["location"]]
    while todo:
        node = ts.ocdbt.dump(kv, todo.pop()).result()
        for e in node["entries"]:
            if "indirect_value" in e:
                _, prefix, rel, *_ = e["indirect_value"].split(":")
                key = e["key"].decode() if isinstance(e["key"], bytes) else str(e["key"])
                out[prefix + rel].add(key.split("/")[0])
            for v in e.values():
                if isinstance(v, str) and v.startswith("btreenode:"):
                    todo.append(v)
    return dict(out)


# -- processes --------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    killed: bool = False
    elapsed: float = 0.0
    timed_out: bool = False

    @property
    def traceback(self) -> bool:
        """An exception escaped the command (not: a library thread printed a traceback)."""
        if "rel_zygote: uncaught exception" in self.stderr:
            return True
        lines = [x for x in self.stderr.splitlines() if x.strip()]
        last = lines[-1] if lines else ""
        return (
            self.rc == 1
            and bool(re.match(r"^[\w.]+(Error|Exception|Exit)\b", last))
            and ("Traceback (most recent call last)" in self.stderr)
        )


def child_env(synth_step: Path | None = None) -> dict[str, str]:
    """What a child process adds to this one's environment: its path before this process's
    (where a host may keep its packages), and JAX on the CPU (on a TPU host the pytest process
    holds the chip; see `conftest.child_env`)."""
    path = [str(BENCH), str(HERE), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in path if p), "JAX_PLATFORMS": "cpu"}
    if synth_step is not None:
        env["OMTL_SYNTH_STEP"] = str(synth_step)
    return env


class Zygote:
    """Client of `rel_zygote`: runs the CLI (or a `rel_jobs` function) in forked children."""

    def __init__(self) -> None:
        self._logs = Path(tempfile.mkdtemp(prefix="omtl-zygote-"))
        self._n = 0
        self._lock = threading.Lock()
        self.env = {**os.environ, **child_env()}  # what its interpreter started with
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "rel_zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=REPO,
            env=self.env,
        )
        ready = self._read()
        assert "ready" in ready, ready

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the zygote died")
        return json.loads(line)

    def _ask(self, req: dict) -> dict:
        with self._lock:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            return self._read()

    def start(
        self, job: dict, *, env: dict | None = None, cwd: Path | None = None, exact: bool = False
    ) -> tuple:
        self._n += 1
        out, err = self._logs / f"{self._n}.out", self._logs / f"{self._n}.err"
        # Made here, not only by the child: a kill that lands right after the fork, before
        # the child opened them, leaves empty output, not missing files.
        out.touch()
        err.touch()
        reply = self._ask(
            {
                "op": "start",
                "job": job,
                "env": {k: str(v) for k, v in (env or {}).items()},
                "env_exact": exact,
                "cwd": str(cwd or REPO),
                "stdout": str(out),
                "stderr": str(err),
            }
        )
        return reply["id"], reply["pid"], out, err

    def wait(self, handle: tuple, *, kill_after: float | None = None, timeout=600) -> Result:
        jid, _, out, err = handle
        r = self._ask({"op": "wait", "id": jid, "kill_after": kill_after, "timeout": timeout})
        res = Result(r["rc"], out.read_text(), err.read_text(), r["killed"], r["elapsed"])
        res.timed_out = r["timed_out"]
        out.unlink(missing_ok=True)
        err.unlink(missing_ok=True)
        return res

    def run(self, job: dict, *, kill_after: float | None = None, **kw: Any) -> Result:
        return self.wait(self.start(job, **kw), kill_after=kill_after)

    def cli(
        self,
        *argv: Any,
        kill_after: float | None = None,
        kill_on_call: dict | None = None,
        fsize_limit: int | None = None,
        **kw: Any,
    ) -> Result:
        from rel_jobs import keep_step_numbers

        job: dict = {"kind": "cli", "argv": keep_step_numbers(list(argv))}
        if kill_on_call:
            job["kill_on_call"] = kill_on_call
        if fsize_limit:
            job["fsize_limit"] = fsize_limit
        return self.run(job, kill_after=kill_after, **kw)

    def call(
        self,
        func: str,
        *,
        kill_after: float | None = None,
        kill_on_call: dict | None = None,
        env: dict | None = None,
        **kwargs: Any,
    ) -> Result:
        job: dict = {"kind": "call", "func": func, "kwargs": kwargs}
        if kill_on_call:
            job["kill_on_call"] = kill_on_call
        return self.run(job, kill_after=kill_after, env=env)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # our own child, by its handle
                self.proc.wait()
        shutil.rmtree(self._logs, ignore_errors=True)


_ZYGOTE: Zygote | None = None


def zygote() -> Zygote:
    """The suite's fork server, started on first use and stopped at exit."""
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = Zygote()
        atexit.register(_ZYGOTE.close)
    return _ZYGOTE


# File-system mutations made from Python, in the order a conversion makes them.
MUTATIONS = ["mkdir", "rename", "replace", "link", "unlink", "remove", "rmdir", "io.open"]


def cli_process(*argv: Any, env: dict | None = None, timeout: int = 300) -> Result:
    """The command line as users run it, in a fresh interpreter (exit codes, tracebacks)."""
    from rel_jobs import keep_step_numbers

    res = subprocess.run(
        [sys.executable, "-m", "orbax_maxtext_layout", *keep_step_numbers(list(argv))],
        capture_output=True,
        text=True,
        env={**os.environ, **child_env(), **(env or {})},
        cwd=REPO,
        timeout=timeout,
    )
    return Result(res.returncode, res.stdout, res.stderr)


# -- file systems -----------------------------------------------------------------------
def _run(*cmd: str) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


@contextlib.contextmanager
def tmpfs(path: Path, size_bytes: int) -> Iterator[bool]:
    """Mounts a tmpfs of ``size_bytes`` at ``path`` (yields False if mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    ok = _run("mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path))
    try:
        yield ok
    finally:
        if ok:
            _umount(path)


@contextlib.contextmanager
def read_only_view(src: Path, at: Path) -> Iterator[bool]:
    """A read-only bind mount of ``src`` at ``at`` (False if not allowed).

    Root bypasses permission bits, so ``chmod a-w`` would not make a directory
    read-only for the converter; a read-only mount does, for everyone.
    """
    at.mkdir(parents=True, exist_ok=True)
    ok = _run("mount", "--bind", str(src), str(at))
    if ok and not _run("mount", "-o", "remount,bind,ro", str(at)):
        _umount(at)
        ok = False
    try:
        yield ok
    finally:
        if ok:
            _umount(at)


def _umount(path: Path) -> None:
    for _ in range(50):
        if _run("umount", str(path)):
            return
        time.sleep(0.1)  # a child may still be closing files
    _run("umount", "-l", str(path))


# -- synthetic steps --------------------------------------------------------------------
def make_synth_root(root: Path, steps: list[int], size: int, **kw: Any) -> list[Path]:
    """``<root>/actor/<n>`` for each ``n``: synthetic Tunix RL steps (bench/synth.py)."""
    import synth

    return [synth.make_step(root, n, size, seed=n, **kw) for n in steps]


def cached_synth_root(name: str, steps: list[int], size: int, **kw: Any) -> Path:
    """A synthetic run root built once per session (copy it before writing to it)."""
    key = f"{name}-{'-'.join(map(str, steps))}-{size}-{sorted(kw.items())}"
    base = session_dir() / hashlib.sha1(key.encode()).hexdigest()[:12]
    if not (base / "done").exists():
        shutil.rmtree(base, ignore_errors=True)
        make_synth_root(base / "run", steps, size, **kw)
        # A pristine step of the same model outside any run root: targets are built
        # from it, so a conversion that removes legacy items never pulls the target away.
        make_synth_root(base / "template", [steps[0]], size, **kw)
        (base / "done").write_text("")
    return base


_session: Path | None = None


def session_dir() -> Path:
    """This process's scratch directory, made on first use and removed at exit. Made
    lazily: the forked and killed children that import this module (and never reach
    their exit handlers) would otherwise each leave an empty directory behind."""
    global _session
    if _session is None:
        _session = Path(tempfile.mkdtemp(prefix="omtl-rel-session-"))
        atexit.register(shutil.rmtree, _session, True)
    return _session


def template_step(base: Path) -> Path:
    (step,) = [p for p in (base / "template" / "actor").iterdir() if p.name.isdigit()]
    return step


def copy_root(base: Path, dest: Path) -> Path:
    shutil.copytree(base / "run", dest, symlinks=True)
    return dest


# -- damage -----------------------------------------------------------------------------
def truncate(p: Path) -> None:
    """Keeps the first half of the file."""
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def flip(p: Path) -> None:
    """Flips one bit in the middle byte."""
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x10
    p.write_bytes(bytes(b))


def empty(p: Path) -> None:
    p.write_bytes(b"")


def delete(p: Path) -> None:
    p.unlink()


def to_directory(p: Path) -> None:
    """A read error other than a short read: the file becomes a directory (EISDIR)."""
    p.unlink()
    p.mkdir()


def drop_param_name(p: Path) -> None:
    """A valid JSON array metadata whose first entry lacks ``param_name``."""
    d = json.loads(p.read_text())
    del d["array_metadatas"][0]["array_metadata"]["param_name"]
    p.write_text(json.dumps(d))


DAMAGE = {f.__name__: f for f in (truncate, flip, empty, delete, to_directory, drop_param_name)}


def damage(p: Path, how: str) -> None:
    """``how``: a name of `DAMAGE`, or ``write:<text>``."""
    if how.startswith("write:"):
        p.write_text(how[len("write:") :])
    else:
        DAMAGE[how](p)


def probe(func: str, **kwargs: Any) -> dict:
    """Runs ``rel_jobs.<func>`` in a forked child and returns the JSON it wrote."""
    fd, out = tempfile.mkstemp(prefix="omtl-probe-", suffix=".json")
    os.close(fd)
    try:
        res = zygote().call(f"rel_jobs:{func}", out=out, **kwargs)
        assert res.rc == 0, f"probe {func} failed: {res.stderr[-2000:]}"
        return json.loads(Path(out).read_text())
    finally:
        os.unlink(out)
