"""Test support for issue 46: OCDBT items whose data-file table points outside the item, and
a check, by system call, that nothing outside was touched.

`forge` rewrites an item's B-tree (`ocdbt_craft`) so that every indirect value names a file
outside the item, in one of the `CASES`, and puts a real file there (the "bait"): a reader
that followed the table would find bytes to read, so only a refusal keeps it out.

- ``outside``: ``../../outside/d/<hex>``, the item's own data files moved there;
- ``absolute_rel``: an absolute relative path, ``/.../abs_rel/d/<hex>``;
- ``absolute_base``: an absolute base path, ``/.../abs_base/`` + ``d/<hex>``;
- ``victim``: another checkpoint's data files, ``../../../../victim/.../d/<hex>``;
- ``secret``: a file that is no checkpoint's, ``../../../../secret.txt``;
- ``deep``: ``../`` x 30, then the absolute path's components: the same file from any
  directory, so from the source item and from an output that grafted its values alike.

`traced` runs a command under ``strace -f -e trace=%file`` (every system call that takes a
path: open, openat, stat, access, readlink, rename, ...) and `touched` lists the calls that
named a bait path. A Python audit hook would miss tensorstore's C++ opens; an atime check is
unreliable (relatime, noatime mounts); a file of mode 000 is no barrier to root, which these
tests may run as; a FIFO in the bait's place blocks a reader and misses a stat. strace sees
every path the process and all its threads hand to the kernel, before the kernel acts on it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import ocdbt_craft as C

CASES = ("outside", "absolute_rel", "absolute_base", "victim", "secret", "deep")
# The cases each command runs in a separate process (CLI and strace tests): the two that
# differ most (``..`` out of the item; ``../`` x 30 to the same file from source and output)
# in the README's test command, every case in the full campaign (as the reliability suite,
# OMTL_RELIABILITY_FULL=1). Every case runs in-process against every reader either way.
FULL = os.environ.get("OMTL_RELIABILITY_FULL", "") not in ("", "0")
PROCESS_CASES = CASES if FULL else ("outside", "deep")


def _working_strace() -> str | None:
    """strace, if it is installed and may trace here (a container without ptrace refuses)."""
    found = shutil.which("strace")
    if found is None:
        return None
    probe = [found, "-f", "-qq", "-e", "trace=%file", "-o", os.devnull, "true"]
    try:
        ok = subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return found if ok else None


STRACE = _working_strace()
SECRET = b"not a checkpoint: a private file next to the run\n" * 1400  # ~70 KB


@dataclasses.dataclass
class Forged:
    """A forged item: ``bait``, the files (or directories) outside it that its table names;
    ``offending``, the paths (base + relative) the table holds."""

    item: Path
    case: str
    bait: list[Path]
    offending: list[str]


def forge(item: Path, case: str, world: Path, *, victim: Path | None = None) -> Forged:
    """Rewrites ``item``'s table as ``case`` says; bait goes under ``world`` (a directory
    above the item's run, outside the item). ``victim``: for "victim", the same item in
    another copy of the checkpoint (its data files are the bait); the item's own data files
    are then deleted, as for "secret"."""
    item, world = Path(item).resolve(), Path(world).resolve()
    entries = C.leaf_entries(item)
    files = C.data_files(entries)
    assert files, f"{item} has no indirect value: externalize it first (ocdbt_craft)"
    new: dict[tuple[str, str], tuple[str, str]] = {}
    bait: list[Path] = []
    for base, rel in files:
        own = item / (base + rel)
        name = Path(rel).name
        if case == "outside":
            to = item.parent.parent / "outside" / "d" / name
            new[base, rel] = ("", os.path.relpath(to, item))
        elif case == "absolute_rel":
            to = world / "abs_rel" / "d" / name
            new[base, rel] = ("", str(to))
        elif case == "absolute_base":
            to = world / "abs_base" / "d" / name
            new[base, rel] = (str(to.parent.parent) + "/", "d/" + name)
        elif case == "victim":
            assert victim is not None, "the victim case needs a second copy of the checkpoint"
            to = Path(victim).resolve() / (base + rel)
            new[base, rel] = ("", os.path.relpath(to, item))
        elif case == "secret":
            to = world / "secret.txt"
            new[base, rel] = ("", os.path.relpath(to, item))
        elif case == "deep":
            to = world / "deep" / "d" / name
            new[base, rel] = ("", "../" * 30 + str(to).lstrip("/"))
        else:
            raise ValueError(case)
        if case in ("victim", "secret"):
            own.unlink(missing_ok=True)
        else:
            to.parent.mkdir(parents=True, exist_ok=True)
            os.replace(own, to)
        bait.append(to)
    if case == "secret":
        (world / "secret.txt").write_bytes(SECRET)
    C.retable(item, lambda b, r: new[b, r])
    assert all(p.exists() for p in bait)
    return Forged(item, case, sorted(set(bait)), [b + r for b, r in new.values()])


def names_offender(message: str, forged: Forged) -> bool:
    """Whether ``message`` names one of the forged paths (as is, or as Python's repr)."""
    return any(p in message or repr(p) in message for p in forged.offending)


def snapshot(root: Path) -> dict[str, str]:
    """``{relative path: sha256 | "dir" | "link"}`` of everything under ``root``: equal before
    and after means nothing was written, renamed or left behind (a temp dir, ``items/``)."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# -- strace -----------------------------------------------------------------------------
# A string argument of a system call, and the directory of the fd before it when there is one
# (``-y`` prints ``AT_FDCWD</cwd>`` or ``3</dir>``); and every fd's path (``= 3</file>``: the
# file the kernel opened, as it resolved it).
_CALL = re.compile(r'(?:(?:AT_FDCWD|-?\d+)(?:<(?P<dir>[^>]*)>)?, )?"(?P<path>(?:[^"\\]|\\.)*)"')
_FD_PATH = re.compile(r"\d+<(?P<fd>/[^>]*)>")


def strace_argv(log: Path) -> list[str]:
    """strace logging every path-taking system call of a process, all its threads and
    children (``-f``), to ``log``, with full strings (``-s``) and fd paths (``-y``); followed by
    a command line, or ``-p PID`` to attach to a process that runs one (the interop suite's
    forked commands: hf_export_support.run_cli)."""
    assert STRACE, "strace is not installed"
    return [STRACE, "-f", "-qq", "-y", "-s", "65535", "-e", "trace=%file", "-o", str(log)]


def attach(trace: Sequence[str], pid: int) -> subprocess.Popen:
    """``trace -p PID`` (`strace_argv`) attached to a forked child that stopped itself before
    its command (a fork server's ``"stop"`` job); then the child resumed (SIGCONT), traced
    from its first step. The tracer ends with its tracee, its log complete."""
    _wait_for(pid, lambda: _proc_field(pid, "State") == "T", "stop")
    tracer = subprocess.Popen([*trace, "-p", str(pid)], stdin=subprocess.DEVNULL)
    _wait_for(pid, lambda: _proc_field(pid, "TracerPid") not in (None, "0"), "tracer")
    os.kill(pid, signal.SIGCONT)
    return tracer


def _proc_field(pid: int, name: str) -> str | None:
    """A field of ``/proc/PID/status`` (None once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split(":", 1)[1].split()[0]
    except OSError:
        return None
    return None


def _wait_for(pid: int, ready, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if _proc_field(pid, "State") in (None, "Z", "X"):
            raise RuntimeError(f"child {pid} ended before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"child {pid}: no {what} in {timeout} s")
        time.sleep(0.005)


def traced(
    argv: Sequence[str], log: Path, *, cwd: Path, env: dict | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    """``argv`` under ``strace -f`` (all threads and children), every path-taking system call
    logged to ``log`` with full strings (``-s``) and fd paths (``-y``)."""
    assert STRACE, "strace is not installed"
    cmd = [*strace_argv(log), *argv]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def logged_paths(log: Path, *, cwd: Path):
    """``(line, paths)`` of each logged system call: the paths it named (normalised as the
    kernel resolves ``..``; a relative one against its directory fd, or ``cwd``) and the files
    its fds were opened on."""
    for line in Path(log).read_text(errors="replace").splitlines():
        paths = [m.group("fd") for m in _FD_PATH.finditer(line)]
        for m in _CALL.finditer(line):
            path = m.group("path").encode().decode("unicode_escape", "replace")
            paths.append(os.path.join(m.group("dir") or str(cwd), path))
        yield line.strip(), [os.path.normpath(p) for p in paths]


def touched(log: Path, bait: Sequence[Path], *, cwd: Path) -> list[str]:
    """The logged system calls that named a bait file, or anything under a bait directory
    (`logged_paths`)."""
    bait = [os.path.normpath(str(b)) for b in bait]
    return [
        line
        for line, paths in logged_paths(log, cwd=cwd)
        if any(_under(p, b) for p in paths for b in bait)
    ]


def _under(path: str, bait: str) -> bool:
    return path == bait or path.startswith(bait + "/")
