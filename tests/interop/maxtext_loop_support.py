"""Support for test_maxtext_loop.py: MaxText 0.2.5's real ``train`` main, run as a subprocess.

Each run is exactly the command a user types, on CPU, for the tiny model of the frozen
fixtures in tests/fixtures/maxtext025 (the generator's own config keys, so the Tunix steps of
MaxText's own model fit):

- through the library: ``python -m orbax_maxtext_layout.maxtext maxtext.trainers.pre_train.train
  <base.yml> key=value ...``;
- stock: ``python -m maxtext.trainers.pre_train.train <base.yml> key=value ...``.

**The probe.** To see the state MaxText really starts training from (after its restore and its
overlay onto the initialized state), every child gets a ``sitecustomize`` that, when MaxText
imports ``maxtext.utils.train_utils``, wraps ``setup_train_loop`` (which ``train_loop`` calls
through the module) to write that state, in MaxText's own on-disk form
(``train_state_nnx.to_checkpoint_dict``), to ``<run base>/probe.{npz,json}``, with the class of
the checkpoint manager MaxText built and whether this library was imported at all. It only
observes: it copies the arrays to the host and returns MaxText's values unchanged. Nothing of
it is imported before MaxText imports ``train_utils``.

This module's top-level imports are the standard library only, because the probe imports it at
interpreter start in the children; JAX, NumPy and Orbax are imported inside the functions.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib.abc
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS_DIR = HERE.parent
REPO = TESTS_DIR.parent
FIXTURE = TESTS_DIR / "fixtures" / "maxtext025"
GENERATORS = TESTS_DIR / "fixtures" / "generators"

SFT_STEP = FIXTURE / "sft_run" / "checkpoints" / "2"
RL_STEP = FIXTURE / "rl_run" / "checkpoints" / "actor" / "2"
PRETRAIN_STEP = FIXTURE / "pretrain_run" / "checkpoints" / "1"
TUNIX_STEPS = {"sft": SFT_STEP, "rl": RL_STEP}
UPDATES = 2  # both Tunix steps hold the state after 2 optimizer updates

TRAIN_MODULE = "maxtext.trainers.pre_train.train"
RUNNER_MODULE = "orbax_maxtext_layout.maxtext"
RUNNER_BANNER = "orbax_maxtext_layout: MaxText reads Tunix-layout checkpoints in this run"
STOCK_CHECKPOINTER = "orbax.checkpoint.experimental.v1._src.training.checkpointer.Checkpointer"
LIBRARY_CHECKPOINTER = "orbax_maxtext_layout.training.Checkpointer"
PROBE_ENV = "MAXTEXT_LOOP_PROBE"
RUN_TIMEOUT_S = 600
# The fixtures were written with init_weights_seed=0; these runs initialize with another seed.
# MaxText derives every RNG stream's key from it (maxtext_utils_nnx: fold_in(PRNGKey(seed), i)),
# and a restore overlays the initialized state, keeping the init value of anything it does
# not restore. The Tunix runs never drew from these streams, so their keys are seed 0's init
# keys: only a different seed makes a restored key distinguishable from an initialized one.
INIT_SEED = 1
# MaxText keeps JAX's persistent compilation cache in ~/jax_cache (base.yml's jax_cache_dir);
# JAX stores there only what took a second or more to compile. Its children here (the runs,
# the exports, the references) compile the same small programs of the tiny models in every
# suite run, so they keep every one (a run of `train` spends about 10% less CPU once warm).
# An executable is the compiled program of its HLO, whatever the checkpoint it then runs on.
COMPILE_CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


@functools.cache
def generator() -> Any:
    """The fixture generator module (one source for the model config, LoRA keys and parts)."""
    spec = importlib.util.spec_from_file_location(
        "gen_maxtext025", GENERATORS / "gen_maxtext025.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generator_keys() -> tuple[list[str], list[str]]:
    """The fixture generator's MODEL_KEYS and RUN_KEYS."""
    return list(generator().MODEL_KEYS), list(generator().RUN_KEYS)


def base_yml() -> Path:
    spec = importlib.util.find_spec("maxtext")
    return Path(spec.origin).parent / "configs" / "base.yml"


# ----------------------------------------------------------------------------- the probe


def _probe_dump(state: Any, manager: Any, out: str) -> None:
    """Writes MaxText's starting state (its checkpoint form) and who checkpoints, to ``out``."""
    import jax
    import numpy as np
    from maxtext.common import train_state_nnx

    tree = train_state_nnx.to_checkpoint_dict(state)
    paths, arrays, dtypes, impls = [], {}, [], []
    for i, (path, x) in enumerate(jax.tree_util.tree_leaves_with_path(tree)):
        paths.append(path_str(path))
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impls.append(str(jax.random.key_impl(x)))
            dtypes.append("key")
            arrays[f"a{i}"] = np.array(jax.random.key_data(x))  # a host copy
        else:
            impls.append(None)
            dtypes.append(str(x.dtype))
            arrays[f"a{i}"] = np.array(x)
    np.savez(out + ".npz", **arrays)
    kind = type(manager)
    meta = {
        "paths": paths,
        "dtypes": dtypes,
        "key_impls": impls,
        "checkpoint_manager": f"{kind.__module__}.{kind.__qualname__}" if manager else None,
        "library_imported": "orbax_maxtext_layout" in sys.modules,
        # Which copy of the library the child imported (the checkout under test, see _env).
        "library_file": getattr(sys.modules.get("orbax_maxtext_layout"), "__file__", None),
    }
    Path(out + ".json").write_text(json.dumps(meta))


def _wrap_train_utils(train_utils: Any, out: str) -> None:
    setup = train_utils.setup_train_loop

    def setup_train_loop(*args: Any, **kwargs: Any) -> Any:
        result = setup(*args, **kwargs)
        # (init_rng, checkpoint_manager, ..., eval_data_iterator, state)
        _probe_dump(result[-1], result[1], out)
        return result

    train_utils.setup_train_loop = setup_train_loop


class _ProbeFinder(importlib.abc.MetaPathFinder):
    """Wraps ``setup_train_loop`` right after MaxText itself imports ``train_utils``."""

    TARGET = "maxtext.utils.train_utils"

    def __init__(self, out: str) -> None:
        self.out = out

    def find_spec(self, name, path, target=None):
        if name != self.TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module
        out = self.out

        def exec_then_wrap(module: Any) -> None:
            exec_module(module)
            _wrap_train_utils(module, out)

        spec.loader.exec_module = exec_then_wrap
        return spec


def install_probe_from_env() -> None:
    """Called by the children's ``sitecustomize``; a no-op without ``$MAXTEXT_LOOP_PROBE``."""
    out = os.environ.get(PROBE_ENV)
    if out:
        sys.meta_path.insert(0, _ProbeFinder(out))


def probe_site_dir(root: Path) -> Path:
    """A directory holding the children's ``sitecustomize.py`` (put first on PYTHONPATH)."""
    site = root / "probe_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import maxtext_loop_support\nmaxtext_loop_support.install_probe_from_env()\n"
    )
    return site


# ----------------------------------------------------------------------------- runs


@dataclasses.dataclass
class Run:
    """One finished MaxText ``train`` process: its command, exit code, log and probe."""

    name: str
    base: Path  # base_output_directory
    argv: list[str]
    returncode: int
    log: str
    seconds: float

    @property
    def checkpoints(self) -> Path:
        return self.base / "run" / "checkpoints"

    def _ints(self, pattern: str) -> list[int]:
        return [int(m) for m in re.findall(pattern, self.log)]

    @property
    def restored_from(self) -> list[int]:
        """MaxText's step numbers it logged restoring this run's directory from."""
        return self._ints(r"restoring from this run's directory step (\d+)")

    @property
    def saved(self) -> list[int]:
        """``Saved a checkpoint at step N.`` (checkpointing.print_save_message)."""
        return self._ints(r"Saved a checkpoint at step (\d+)\.")

    @property
    def skipped(self) -> list[int]:
        """``Checkpoint for step N already exists, skipping save.``"""
        return self._ints(r"Checkpoint for step (\d+) already exists, skipping save")

    @property
    def completed(self) -> list[int]:
        """The steps MaxText's metric logger reports (``completed step: N``)."""
        return self._ints(r"completed step: (\d+),")

    @property
    def lost_saves(self) -> list[int]:
        """Skipped saves of a step this run never saved: a state that is nowhere on disk.

        With ``checkpoint_period=1`` MaxText's end-of-run save (``save_checkpoint_on_completion``,
        on by default) always re-offers the last step, already saved in the loop, and logs it as
        skipped; that skip loses nothing. Any other skip is a lost save.
        """
        return [s for s in self.skipped if s not in self.saved]

    def probe(self) -> dict[str, Leaf]:
        """The state MaxText started training from (see the module docstring)."""
        import numpy as np

        meta = json.loads(self.probe_meta_path.read_text())
        with np.load(str(self.base / "probe.npz")) as z:
            return {
                p: Leaf(d, k, z[f"a{i}"].shape, z[f"a{i}"].tobytes(), z[f"a{i}"])
                for i, (p, d, k) in enumerate(
                    zip(meta["paths"], meta["dtypes"], meta["key_impls"], strict=True)
                )
            }

    @property
    def probe_meta_path(self) -> Path:
        return self.base / "probe.json"

    def probe_meta(self) -> dict[str, Any]:
        return json.loads(self.probe_meta_path.read_text())

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.splitlines()[-lines:])

    def why(self) -> str:
        return f"{self.name}: exit {self.returncode}; argv {self.argv}\n--- log tail ---\n{self.tail()}"


@dataclasses.dataclass(frozen=True)
class Spec:
    """A MaxText run to start: ``<base>/run/checkpoints`` is its checkpoint directory."""

    name: str
    base: Path
    steps: int
    runner: bool  # through `python -m orbax_maxtext_layout.maxtext`, else stock MaxText
    extra: tuple[str, ...] = ()
    # The model's MaxText keys (a family's, e.g. the generator's GEMMA3_MODEL_KEYS); default:
    # the generator's MODEL_KEYS, the tiny llama.
    model_keys: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        model_keys, run_keys = generator_keys()
        model_keys = list(self.model_keys) or model_keys
        assert "init_weights_seed=0" in model_keys
        model_keys = [k for k in model_keys if not k.startswith("init_weights_seed=")]
        model_keys.append(f"init_weights_seed={INIT_SEED}")
        lead = [RUNNER_MODULE, TRAIN_MODULE] if self.runner else [TRAIN_MODULE]
        return [
            sys.executable,
            "-m",
            *lead,
            str(base_yml()),
            *model_keys,
            *run_keys,
            "dataset_type=synthetic",
            f"steps={self.steps}",
            "checkpoint_period=1",
            f"base_output_directory={self.base}",
            "run_name=run",
            *self.extra,
        ]


def _env(site: Path, probe_out: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(
        {
            "JAX_PLATFORMS": "cpu",
            "PYTHONHASHSEED": "0",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            # The checkout these tests belong to comes before any installed copy, so the
            # runner's children import the library under test (stock runs never import it).
            "PYTHONPATH": os.pathsep.join([str(site), str(HERE), str(REPO)]),
            PROBE_ENV: str(probe_out),
            **COMPILE_CACHE_ENV,
        }
    )
    return env


def run(spec: Spec, site: Path) -> Run:
    """``spec``'s MaxText process, to its end. Stock MaxText's runs are forked from the suite's
    MaxText fork server (`hf_export_support.run`: MaxText imported once per test process; the
    child imports the probe's ``sitecustomize`` as a fresh interpreter would, and everything
    from ``train`` on); the runner's (this library's entry point) start a fresh interpreter."""
    spec.base.mkdir(parents=True, exist_ok=True)
    argv = spec.argv()
    log_path = spec.base / "maxtext.log"
    env = _env(site, spec.base / "probe")
    start = time.monotonic()
    if not spec.runner:
        import hf_export_support as S

        extra = tuple((k, env[k]) for k in ("PYTHONPATH", PROBE_ENV))
        job = S.Job("maxtext", spec.base, tuple(argv), env_extra=extra, timeout=RUN_TIMEOUT_S)
        returncode = S.run(job).returncode
    else:
        with open(log_path, "wb") as log:
            returncode = subprocess.run(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=spec.base,
                timeout=RUN_TIMEOUT_S,
                check=False,
            ).returncode
    seconds = time.monotonic() - start
    text = log_path.read_text(errors="replace")
    return Run(spec.name, spec.base, argv, returncode, text, seconds)


def run_all(specs: list[Spec], site: Path, workers: int = 2) -> dict[str, Run]:
    """Runs independent MaxText processes, ``workers`` at a time (2 cores: compile overlaps I/O)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {s.name: pool.submit(run, s, site) for s in specs}
        return {name: f.result() for name, f in futures.items()}


def cli(*args: str) -> subprocess.CompletedProcess:
    """``orbax-maxtext-layout ARGS`` that must succeed: the command line (``python -m
    orbax_maxtext_layout``, this checkout's library), forked from the suite's fork server
    (`hf_export_support.run_cli`; test_maxtext_config.py runs the console script itself)."""
    import hf_export_support as S

    proc = S.run_cli(*args)
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def copy_tree(src: Path, dst: Path) -> Path:
    """A writable copy (the fixtures are read-only data)."""
    shutil.copytree(src, dst)
    for root, dirs, files in os.walk(dst):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    return dst


def step_dirs(checkpoints: Path) -> list[int]:
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.is_dir() and p.name.isdigit())


def leftovers(checkpoints: Path) -> list[str]:
    """Anything that is not a committed numeric step (interrupted saves, moved-away dirs)."""
    return sorted(
        p.name
        for p in checkpoints.iterdir()
        if not (p.is_dir() and p.name.isdigit() and (p / "commit_success.txt").is_file())
    )


# ----------------------------------------------------------------------------- trees


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array, reduced to what bit-identity means: dtype (``key`` + impl for typed PRNG keys),
    shape and raw bytes."""

    dtype: str
    key_impl: str | None
    shape: tuple[int, ...]
    data: bytes
    array: Any = dataclasses.field(compare=False, repr=False)

    @classmethod
    def of(cls, x: Any) -> Leaf:
        import jax
        import numpy as np

        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            raw = np.asarray(jax.random.key_data(x))
            return cls("key", str(jax.random.key_impl(x)), raw.shape, raw.tobytes(), raw)
        raw = np.asarray(x)
        return cls(str(raw.dtype), None, raw.shape, raw.tobytes(), raw)

    def value(self) -> Any:
        return self.array.item()


def path_str(path: Any) -> str:
    """``"a/b/0/c"`` for a JAX key path (dict keys, sequence indices, attributes)."""
    out = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return "/".join(out)


def read_item(item: Path) -> dict[str, Leaf]:
    """Stock Orbax (v0 ``PyTreeCheckpointHandler``) restore of a whole item, no target."""
    import warnings

    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sharding info not provided")
        tree = ocp.PyTreeCheckpointHandler().restore(epath.Path(item))
    return {path_str(p): Leaf.of(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def expected_items(step: Path, kind: str) -> dict[str, Leaf]:
    """MaxText items a Tunix step stands for, read from the Tunix source with stock Orbax.

    The map (tests/test_maxtext025_fixtures.py, the fixture README): weights to
    ``params/params/...``, RNG state to ``nnx_aux/model/...``, Adam's count and moments to
    ``opt_state/0``, the schedule count to ``opt_state/2/count`` (for RL, whose schedule lives
    in ``inject_hyperparams``, the Adam count), and ``step``. Tunix paths end in ``/value``; RL
    adds the adapter's ``base/`` level.
    """
    base = "base/" if kind == "rl" else ""
    params = read_item(step / "model_params")
    opt = read_item(step / "optimizer_state")
    out = {}
    for p, x in params.items():
        model = p.removeprefix(base).removesuffix("/value")
        dest = "nnx_aux/model/" if "/rngs/" in model else "params/params/"
        out[dest + model] = x
    adam = "opt_state/inner_state/1/0/" if kind == "rl" else "opt_state/1/0/"
    for p, x in opt.items():
        if not p.startswith(adam):
            continue
        rest = p.removeprefix(adam).removesuffix("/value")
        if rest == "count":
            out["opt_state/0/count"] = x
        else:
            moment, model = rest.split("/", 1)
            out[f"opt_state/0/{moment}/params/{model.removeprefix(base)}"] = x
    schedule = "opt_state/1/2/count/value" if kind == "sft" else adam + "count/value"
    out["opt_state/2/count"] = opt[schedule]
    out["step"] = opt["step/value"]
    return out


def weights(tree: dict[str, Leaf]) -> dict[str, Leaf]:
    return {p: x for p, x in tree.items() if p.startswith("params/")}


def groups(tree: dict[str, Leaf]) -> dict[str, int]:
    """How many leaves a flat items tree holds under each of its first two path levels."""
    out: dict[str, int] = {}
    for p in tree:
        group = "/".join(p.split("/")[:2]) if "/" in p else p
        out[group] = out.get(group, 0) + 1
    return out


def diff(got: dict[str, Leaf], want: dict[str, Leaf], *, step_by_value: bool = False) -> list[str]:
    """Paths whose leaves differ (missing or extra paths included). ``step_by_value``: compare
    ``step`` by its integer value only (Tunix stores it as uint32, MaxText as int32)."""
    out = [f"missing {p}" for p in sorted(set(want) - set(got))]
    out += [f"unexpected {p}" for p in sorted(set(got) - set(want))]
    for p in sorted(set(got) & set(want)):
        if step_by_value and p == "step":
            if got[p].value() != want[p].value():
                out.append(f"step {got[p].value()} != {want[p].value()}")
        elif got[p] != want[p]:
            g, w = got[p], want[p]
            out.append(f"{p}: {g.dtype}/{g.key_impl}{g.shape} vs {w.dtype}/{w.key_impl}{w.shape}")
    return out


def step_metadata(step: Path) -> dict[str, Any]:
    return json.loads((step / "_CHECKPOINT_METADATA").read_text())
