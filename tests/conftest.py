"""Shared test helpers. Tests read only the frozen fixtures under tests/fixtures."""

from __future__ import annotations

import functools
import gc
import hashlib
import os
import re
import shutil
import socket
import types
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
MAXTEXT_NATIVE = FIXTURES / "maxtext_native" / "run" / "checkpoints" / "2"

# Every scanned RL actor step among the real fixtures (DOMAIN.md section 2).
RL_ACTOR_STEPS = {
    "tunix017_rl": "tunix017/rl_run/checkpoints/actor/2",
    "tunix017_pathways": "tunix017_pathways_style/actor/1",
    "v1_rl": "tunix_snapshot_v1/rl_run/checkpoints/actor/2",
    "v1_rl_default_opts": "tunix_snapshot_v1/rl_run_default_opts/checkpoints/actor/2",
}
SFT_STEPS = {
    "tunix017_sft": "tunix017/sft_run/checkpoints/1",
    "v1_sft": "tunix_snapshot_v1/sft_run/checkpoints/1",
}


def jax_cache_dir() -> Path | None:
    """Where the test processes keep JAX's persistent compilation cache, or None (off).

    ``OMTL_TEST_JAX_CACHE``: a directory, or ``0`` for none; by default
    ``jax-compilation-cache`` under ``$ORBAX_MAXTEXT_LAYOUT_CACHE`` (else
    ``$XDG_CACHE_HOME/orbax-maxtext-layout``, else ``~/.cache/orbax-maxtext-layout``, the root
    ``.ci/interop.sh`` keeps its venvs in)."""
    chosen = os.environ.get("OMTL_TEST_JAX_CACHE", "")
    if chosen == "0":
        return None
    if chosen:
        return Path(chosen)
    root = os.environ.get("ORBAX_MAXTEXT_LAYOUT_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(xdg) / "orbax-maxtext-layout"
    return Path(root) / "jax-compilation-cache"


def pytest_configure(config):
    """JAX's persistent compilation cache in the processes that run tests (each xdist worker,
    or the one pytest process; not the xdist controller, which runs none): the tests build
    the same small models, optimizers and PRNG keys again and again, and a cached executable
    loads in a fraction of its compile time (tests/test_convert_models.py and
    tests/test_writers.py run in about half the CPU time once the cache is warm).

    Set with ``jax.config``, not the environment, so the CLI and child processes the tests
    start are left as users run them (their stderr is asserted). A cache entry JAX could not
    read (e.g. one another worker was still writing) is compiled again, with a warning.

    Registers the ``needs_sockets`` mark (`pytest_runtest_setup`)."""
    config.addinivalue_line(
        "markers", "needs_sockets(what): skips, saying why, where no socket can be opened"
    )
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # the xdist controller
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return  # the user's own cache settings stand
    cache = jax_cache_dir()
    if cache is None:
        return
    import jax

    cache.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@functools.cache
def sockets_available() -> bool:
    """Whether this host lets a process open a socket: binding ``127.0.0.1:0``. The TPU host
    of issue 45 allows none, not even on loopback, so ``jax.distributed`` (the two- and
    four-process tests) and the GCS emulator (``tests/gcs``) cannot run there."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
    except OSError:
        return False
    return True


NO_SOCKETS = "needs sockets, and this host allows none, not even on loopback (a TPU host)"


def skip_without_sockets(what: str) -> None:
    """Skips the running test or fixture, saying why, when `sockets_available` is false."""
    if not sockets_available():
        pytest.skip(f"{what} {NO_SOCKETS}")


def pytest_runtest_setup(item):
    """``@pytest.mark.needs_sockets("what")``: the test skips, saying that ``what`` needs
    sockets, where none can be opened (`sockets_available`)."""
    mark = item.get_closest_marker("needs_sockets")
    if mark is not None:
        skip_without_sockets(mark.args[0] if mark.args else item.name)


def child_env(env: dict | None = None, *, cpu: bool = True) -> dict[str, str]:
    """The environment of a child process: this process's, updated with ``env``, whose
    ``PYTHONPATH`` goes before this process's (where a host may keep its packages: the TPU
    host's ``/tmp/site``), not instead of it.

    With ``cpu``, ``JAX_PLATFORMS=cpu``: on a TPU host the pytest process holds the chip, and a
    second process that opens it fails ("libtpu multi-process lockfile"). The CLI
    (``python -m orbax_maxtext_layout``) pins the CPU itself where ``JAX_PLATFORMS`` is unset:
    its children may pass ``cpu=False``, so the suite on a TPU host checks that too. A test
    about the default backend builds its own environment."""
    out = {**os.environ, **(env or {})}
    inherited = os.environ.get("PYTHONPATH")
    if env and env.get("PYTHONPATH") and inherited:
        out["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], inherited])
    if cpu:
        out["JAX_PLATFORMS"] = "cpu"
    return out


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler for pyproject's ``-n auto --dist loadgroup``: each test goes
    to whichever worker is free, except that every test of ``tests/gcs`` runs on one worker,
    in collection order. They share one GCS emulator (this session's, or the one ``.ci/run``
    started), and the request and byte counts of its counting proxy, which some of them
    assert, would include another worker's requests.

    The group is named here, by path, rather than by ``xdist_group`` marks: pytest-xdist 3.8
    carries a mark's group in the node id it rewrites, which pytest 9.2's node ids ignore, so
    marked tests are silently spread over the workers (pytest-xdist issue 1386). Any other
    ``--dist`` keeps xdist's own scheduler."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GcsOnOneWorker(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/gcs/"):
                return "gcs"
            return super()._split_scope(nodeid)

    return GcsOnOneWorker(config, log)


_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")


def without_warnings(stderr: str, source: str | None = None) -> str:
    """``stderr`` without the warnings Python printed into it (``file:line: XWarning: ...``
    and the source line after it), or only those raised in a file whose path holds
    ``source``: a TPU host's libtpu warns at every start ("Transparent hugepages are not
    enabled"), even in a child pinned to the CPU. A test compares what the command said,
    never a host's warnings."""
    out, skip = [], False
    for line in stderr.splitlines(keepends=True):
        if _WARNING.match(line) and (source is None or source in line.split(":", 1)[0]):
            skip = True
            continue
        if skip and line.startswith("  "):
            continue
        skip = False
        out.append(line)
    return "".join(out)


def address_space_cap() -> int:
    """The address space (``RLIMIT_AS``) of a child that runs hostile input: 3 GiB on a
    2-core machine, and 512 MiB more a core (2 GiB + 512 MiB a core). Each core brings JAX's,
    tensorstore's and glibc's per-thread reservations (thread stacks, malloc arenas of 64
    MiB, up to 8 a core), which reserve address space without using memory: under a flat 3
    GiB, XLA's CPU client could not start its threads on the 13-core TPU host
    (``pthread_create`` failed, the child aborted). What the cap is for (a forged size that
    asks for terabytes) is refused under any of these caps."""
    return (2 << 30) + len(os.sched_getaffinity(0)) * (512 << 20)


# -- no reference cycle of the package's own (issue 57) -------------------------------------
PACKAGE = "orbax_maxtext_layout"


def pytest_collection_finish(session):
    """In each process that runs tests, what is alive once the tests are collected (JAX,
    Orbax, the test modules) is frozen, and after each test what outlived it, so that
    `package_cycles`' collection after every test walks only what that test made. The
    library never freezes (issue 57); a test process may."""
    if getattr(session.config.option, "numprocesses", None) and not hasattr(
        session.config, "workerinput"
    ):
        return  # the xdist controller runs no test
    if session.items and all(_interop(i) for i in session.items):
        return  # the interop suite runs without the guard (`no_package_cycles`)
    gc.collect()
    gc.freeze()


def _interop(item) -> bool:
    return "interop" in Path(str(item.path)).parts


def _is_package_object(o) -> bool:
    """An object of the package's own types, or a function of its (a closure that calls
    itself, say); not the command line's (argparse's parsers and actions are cycles by
    design, and a command owns its process)."""
    if isinstance(o, types.FunctionType):
        module = o.__module__
    else:
        module = type(o).__dict__.get("__module__")
    return (
        isinstance(module, str)
        and module.startswith(PACKAGE)
        and not module.startswith(f"{PACKAGE}.cli")
    )


def _on_a_cycle(o, garbage: dict[int, object]) -> bool:
    """Whether ``o`` reaches itself through the objects of ``garbage`` (an object only held
    by some other cycle is not on one), never through a frame of code outside the package:
    a test that keeps the error it caught (``pytest.raises(...) as e``) makes a cycle
    through its own frame, which a caller may make with any exception."""
    todo, seen = list(gc.get_referents(o)), set()
    while todo:
        x = todo.pop()
        if x is o:
            return True
        if id(x) in seen or id(x) not in garbage:
            continue
        seen.add(id(x))
        if isinstance(x, types.FrameType) and f"/{PACKAGE}/" not in x.f_code.co_filename:
            continue
        todo.extend(gc.get_referents(x))
    return False


def package_cycles() -> list[str]:
    """The package's own objects found on a reference cycle by a full collection (kept for
    the look with ``gc.DEBUG_SAVEALL``, then dropped): each such cycle kept what it held
    alive until that collection (a restore's shards, a reader's mappings)."""
    debug = gc.get_debug()
    gc.set_debug(debug | gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        garbage = {id(o): o for o in gc.garbage}
        found = [o for o in gc.garbage if _is_package_object(o) and _on_a_cycle(o, garbage)]
        return sorted(
            {
                f"{type(o).__module__}.{getattr(o, '__qualname__', type(o).__qualname__)}"
                for o in found
            }
        )
    finally:
        gc.garbage.clear()
        gc.set_debug(debug)
        gc.collect()  # what was saved is cyclic garbage again: freed now, not found again


@pytest.fixture(autouse=True)
def no_package_cycles(request):
    """After every test of the core suite: no object of the package's on a reference cycle
    (a cycle frees what it holds only at a full collection, which a trainer may not run for
    a long time). Not yet in the interop suite (MaxText's own objects, Python 3.12)."""
    if _interop(request.node):
        yield
        return
    yield
    cycles = package_cycles()
    # What outlived the test (caches, module state) is frozen too: the next test's look walks
    # only what that test made, not the whole process's objects again.
    gc.freeze()
    if cycles:
        pytest.fail(f"reference cycles through the package's objects: {cycles}", pytrace=False)


def copy_fixture(rel: str, dest: Path) -> Path:
    """Copies a frozen fixture step into ``dest`` (writable) and returns the copy."""
    out = dest / rel  # keep the numeric step name and any role level
    shutil.copytree(FIXTURES / rel, out)
    for root, dirs, files in os.walk(out):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o755 if name in dirs else 0o644)
    return out


def tree_digest(root: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root``."""
    out = {}
    root = Path(root)
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_file() and not any(rel == e or rel.startswith(e + "/") for e in exclude):
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def placed_restore_args(item_dir, *, host: bool = False):
    """Restore args for every leaf of the stored item at ``item_dir`` (a tree of the stored
    item's structure, from its metadata) that place each stored ``jax.Array`` explicitly: on
    ``jax.devices()[0]`` (a `SingleDeviceSharding` of the default backend), or with ``host``
    as a host ``np.ndarray``. Other leaves (numpy arrays, scalars, strings, empty nodes) get
    plain `RestoreArgs`, restored as stock restores them.

    Test oracles restore with these, never through the step's recorded ``_sharding``: the
    fixtures record CPU devices, which a TPU host does not have (issue 45). A stored
    ``jax.Array`` is the leaf whose metadata carries a sharding; a typed PRNG key restored
    to the device is a key again, one restored to the host its uint32 key data."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from etils import epath

    meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(item_dir)).tree
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def one(m):
        stored_jax = isinstance(m, ocp.metadata.ArrayMetadata) and m.sharding is not None
        if not stored_jax or isinstance(m, ocp.metadata.ScalarMetadata):
            return ocp.RestoreArgs()
        if host:
            return ocp.RestoreArgs(restore_type=np.ndarray)
        return ocp.ArrayRestoreArgs(sharding=device)

    return jax.tree.map(one, meta, is_leaf=lambda x: isinstance(x, ocp.metadata.Metadata))


def stock_restore(item_dir, *, host: bool = False):
    """Stock Orbax restore of a whole item, placed by `placed_restore_args` (the oracle)."""
    import orbax.checkpoint as ocp
    from etils import epath

    args = ocp.args.PyTreeRestore(restore_args=placed_restore_args(item_dir, host=host))
    return ocp.PyTreeCheckpointHandler().restore(epath.Path(item_dir), args=args)


def recorded_shardings_resolve(item_dir) -> bool:
    """Whether every sharding recorded in the item's ``_sharding`` names devices this process
    has: true on the CPU the fixtures were written on, false on a TPU host (they name
    ``cpu:0``). A restore without restore args, stock's or the library's stock path, places
    leaves there, so it works only then."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(item_dir)).tree
    for m in jax.tree.leaves(meta, is_leaf=lambda x: isinstance(x, ocp.metadata.Metadata)):
        if getattr(m, "sharding", None) is None:
            continue
        try:
            m.sharding.to_jax_sharding()
        except ValueError:
            return False
    return True


RECORDED_DEVICES_ABSENT = "the step's recorded _sharding names devices this host does not have"


def restore_flat(item_dir, *, host: bool = False) -> dict:
    """`stock_restore` of a whole item, flattened to ``{path: array}``."""
    from orbax_maxtext_layout.base.treepaths import flatten, norm_key

    tree = stock_restore(item_dir, host=host)
    flat = flatten(tree, is_leaf=lambda x: hasattr(x, "dtype"))
    return {tuple(norm_key(k) for k in p): v for p, v in flat.items()}


def raw(x):
    """An array's stored values as numpy; typed PRNG keys as their uint32 data."""
    import jax
    import numpy as np

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


@pytest.fixture
def maxtext_target():
    from orbax_maxtext_layout import Target

    return Target.from_checkpoint(MAXTEXT_NATIVE)
