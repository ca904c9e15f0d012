"""Support for the interop suite's children: MaxText 0.2.5's own exporter and SFT trainer
(first written for test_scan_layers_metadata.py), run as subprocesses on CPU, offline, for the
tiny model of tests/fixtures/maxtext025, and the fork server every module's children come from
where they can (`run`, `run_cli`, maxtext_zygote.py).

- ``to_huggingface``: ``python -m maxtext.checkpoint_conversion.to_huggingface <base.yml>
  <the generator's model keys without scan_layers> load_parameters_path=<items>
  base_output_directory=<out> --override_model_architecture --hf_model_path=<local tokenizer>``
  (the tiny sizes differ from the HF config of ``llama3.1-8b``, hence the override flag; the
  tokenizer is a local 64-token one, written by `write_tokenizer`, so nothing is fetched).
- ``train_sft``: ``train_sft.main`` under absl's ``app.run`` (what its ``__main__`` does),
  through the fixture generator's ``_train_sft`` (the one substitution it documents: MaxText
  0.2.5's synthetic iterator is run un-jitted, as ``train_sft`` cannot jit it with its
  unhashable config). Run as ``python hf_export_support.py train_sft OUT LOAD [KEY=VALUE ...]``.

**The fork server.** A child that imports MaxText spends 10 s of CPU on the imports and their
garbage collections before it does anything; the suite's children are MaxText's own programs
(the references: ``to_huggingface``, ``to_maxtext``, the logits children, the SFT trainer and
stock pre-training runs) and this library's command line where the test is of what the command
does, not of its process (`run_cli`). `run` forks each from one server per test process
(maxtext_zygote.py), which imported MaxText once and froze that heap, where its command line
allows (`forkable`); this library's own entry points (the runner, the console script), kills of
a real process and processes side by side stay fresh interpreters, as do all with
``OMTL_INTEROP_ZYGOTE=0``.

Top-level imports are the standard library and ``maxtext_loop_support`` only (itself standard
library at import), so the children start with nothing loaded.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import maxtext_loop_support as L

HERE = Path(__file__).resolve().parent
EXPORT_MODULE = "maxtext.checkpoint_conversion.to_huggingface"
TIMEOUT_S = 600
VOCAB = 64  # the tiny model's vocab_size
SYNCED_FROM_METADATA = "Setting scan_layers={} loaded from checkpoint metadata."


def model_keys(*, scan_layers: bool | None = None, seed: int | None = None) -> list[str]:
    """The fixture generator's MODEL_KEYS, with no ``scan_layers`` key unless one is given
    (``init_weights_seed`` replaced when ``seed`` is given)."""
    keys = [k for k in L.generator().MODEL_KEYS if not k.startswith("scan_layers=")]
    if seed is not None:
        keys = [k for k in keys if not k.startswith("init_weights_seed=")]
        keys.append(f"init_weights_seed={seed}")
    if scan_layers is not None:
        keys.append(f"scan_layers={str(scan_layers).lower()}")
    return keys


def write_tokenizer(directory: Path) -> Path:
    """A local Hugging Face tokenizer (``tokenizer.json``, ``tokenizer_config.json``) with the
    tiny model's 64 tokens, for ``--hf_model_path``; read back with ``AutoTokenizer``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(special)}
    vocab.update({f"t{i}": i for i in range(len(special), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.save_pretrained(str(directory))
    assert len(AutoTokenizer.from_pretrained(str(directory))) == VOCAB
    return directory


# ----------------------------------------------------------------------------- processes


@dataclasses.dataclass
class Proc:
    """One finished child: its command, exit code, combined output and wall time."""

    name: str
    cwd: Path
    argv: list[str]
    returncode: int
    log: str
    seconds: float

    def why(self) -> str:
        tail = "\n".join(self.log.splitlines()[-40:])
        return f"{self.name}: exit {self.returncode}; argv {self.argv}\n--- log tail ---\n{tail}"


@dataclasses.dataclass(frozen=True)
class Job:
    """A command line to run in ``cwd``, with `env` updated by ``env_extra``."""

    name: str
    cwd: Path
    argv: tuple[str, ...]
    env_extra: tuple[tuple[str, str], ...] = ()
    timeout: float = TIMEOUT_S

    def environ(self) -> dict[str, str]:
        return {**env(), **dict(self.env_extra)}


def env() -> dict[str, str]:
    """The children's environment (the fork server's too): on CPU, offline, ``PYTHONHASHSEED``
    0, this directory on ``PYTHONPATH`` and not the library (stock MaxText), and every XLA
    compilation kept in MaxText's persistent cache (`L.COMPILE_CACHE_ENV`)."""
    out = dict(os.environ)
    out.pop("PYTHONPATH", None)  # stock MaxText: this library is not on the path
    out.update(
        {
            "JAX_PLATFORMS": "cpu",
            "PYTHONHASHSEED": "0",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": str(HERE),
            **L.COMPILE_CACHE_ENV,
        }
    )
    return out


# read when an interpreter, JAX or XLA starts: a forked child keeps the fork server's
STARTUP = re.compile(r"^(PYTHON|JAX_|XLA_|TPU_|LIBTPU|TF_|LD_|MALLOC_|OMP_|OPENBLAS_|MKL_)")


def forkable(job: Job) -> bool:
    """Whether ``job`` runs in a child of the fork server (`maxtext_zygote.py`): a command
    line of this interpreter (``-m MODULE``, a script or ``-c CODE``) whose environment sets
    every variable read at start-up (but ``PYTHONPATH``) as the server's does."""
    if not _ZYGOTE.enabled() or len(job.argv) < 2 or job.argv[0] != sys.executable:
        return False
    if job.argv[1].startswith("-") and job.argv[1] not in ("-m", "-c"):
        return False
    theirs, ours = job.environ(), _ZYGOTE.environ()
    keys = {k for k in (*theirs, *ours) if STARTUP.match(k) and k != "PYTHONPATH"}
    return all(theirs.get(k) == ours.get(k) for k in keys)


def run(job: Job) -> Proc:
    """``job`` run to its end: in a child forked from the fork server (`maxtext_zygote.py`:
    MaxText imported once per test process) where `forkable`, else (and every one, with
    ``OMTL_INTEROP_ZYGOTE=0``) as a fresh process."""
    job.cwd.mkdir(parents=True, exist_ok=True)
    log_path = job.cwd / f"{job.name}.log"
    start = time.monotonic()
    if forkable(job):
        returncode = _ZYGOTE.run(list(job.argv[1:]), job.cwd, log_path, job.environ(), job.timeout)
    else:
        with open(log_path, "wb") as log:
            returncode = subprocess.run(
                list(job.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=job.environ(),
                cwd=job.cwd,
                timeout=job.timeout,
                check=False,
            ).returncode
    seconds = time.monotonic() - start
    return Proc(
        job.name,
        job.cwd,
        list(job.argv),
        returncode,
        log_path.read_text(errors="replace"),
        seconds,
    )


def library_env() -> dict[str, str]:
    """`env` with this checkout's library first on ``PYTHONPATH``, for this library's own
    command line and children that import it."""
    return {"PYTHONPATH": os.pathsep.join([str(L.REPO), str(HERE)])}


def run_cli(
    *args: object,
    argv: tuple[str, ...] | None = None,
    env_extra: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = TIMEOUT_S,
    trace: list[str] | None = None,
) -> subprocess.CompletedProcess:
    """``python -m orbax_maxtext_layout ARGS`` (or ``python ARGV``) with this checkout's
    library, in `env` (on CPU, offline) updated by ``env_extra``, in ``cwd`` (default: the
    repository), as ``subprocess.run(..., capture_output=True, text=True)`` returns it: for a
    test of what a command does (its exit code, output and files), not of the process it runs
    in. A child forked from the fork server where `forkable` (the command does what it does in
    a fresh interpreter; MaxText is not imported again), else a fresh process. ``trace``: a
    tracer's command line (hostile_support.strace_argv), attached to the forked child with
    ``-p PID`` before it starts the command, or run with the fresh process's."""
    import tempfile

    cmd = (sys.executable, *(argv or ("-m", "orbax_maxtext_layout", *map(str, args))))
    extra = {**library_env(), **(env_extra or {})}
    job = Job("cli", Path(cwd or L.REPO), cmd, tuple(extra.items()), timeout)
    if not forkable(job):
        return subprocess.run(
            [*(trace or ()), *cmd],
            capture_output=True,
            text=True,
            env=job.environ(),
            cwd=job.cwd,
            timeout=timeout,
            check=False,
        )
    with tempfile.TemporaryDirectory(prefix="omtl-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        rc = _ZYGOTE.run(list(cmd[1:]), job.cwd, None, job.environ(), timeout, out, err, trace)
        return subprocess.CompletedProcess(
            list(cmd), rc, out.read_text(errors="replace"), err.read_text(errors="replace")
        )


class _Zygote:
    """This process's `maxtext_zygote.py` server, started at its first job, stopped at exit;
    one request at a time (jobs run from a pool's threads)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.started: dict[str, str] = {}
        self.lock = threading.Lock()

    @staticmethod
    def enabled() -> bool:
        return os.environ.get("OMTL_INTEROP_ZYGOTE", "1") != "0"

    def environ(self) -> dict[str, str]:
        """The server's environment: what it was started with, or will be."""
        with self.lock:
            alive = self.proc is not None and self.proc.poll() is None
            return dict(self.started) if alive else env()

    def _ask(self, req: dict) -> dict:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.started = env()
                self.proc = subprocess.Popen(
                    [sys.executable, str(HERE / "maxtext_zygote.py")],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=self.started,
                    text=True,
                )
                atexit.register(self.stop)
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the MaxText fork server died (its stderr is the test's)")
        return json.loads(line)

    def run(
        self,
        args: list[str],
        cwd: Path,
        log: Path | None,
        environ: dict[str, str],
        timeout: float,
        stdout: Path | None = None,
        stderr: Path | None = None,
        trace: list[str] | None = None,
    ) -> int:
        """``python ARGS`` in a forked child: its exit code (-9 where it was killed at
        ``timeout``); its output in ``log``, or in ``stdout`` and ``stderr`` apart; ``trace``
        (a tracer's command line) attached to it before it starts."""
        req = {"op": "start", "argv": args, "cwd": str(cwd), "env": environ, "stop": bool(trace)}
        if log is not None:
            req["log"] = str(log)
        else:
            req["stdout"], req["stderr"] = str(stdout), str(stderr)
        pid = self._ask(req)["pid"]
        tracer = None
        if trace:
            from hostile_support import attach  # tests/: on the path of the suite's processes

            tracer = attach(trace, pid)
        try:
            deadline = time.monotonic() + timeout
            while (rc := self._ask({"op": "poll", "pid": pid})["rc"]) is None:
                if time.monotonic() > deadline:
                    return self._ask({"op": "kill", "pid": pid})["rc"]
                time.sleep(0.05 if trace else 0.1)
            return rc
        finally:
            if tracer is not None:
                tracer.wait(timeout=60)  # it ends with its tracee, the log complete

    def stop(self) -> None:
        with self.lock:
            proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


_ZYGOTE = _Zygote()


def run_all(jobs: list[Job], workers: int = 2) -> dict[str, Proc]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {j.name: pool.submit(run, j) for j in jobs}
        return {name: f.result() for name, f in futures.items()}


def export_job(
    name: str,
    items: Path,
    out: Path,
    tokenizer: Path,
    *,
    scan_layers: bool | None = None,
    keys: list[str] | None = None,
) -> Job:
    """MaxText's ``to_huggingface`` in Base mode on ``items``, writing to ``out``; ``keys``:
    the model's keys (default `model_keys`, the tiny llama), without ``scan_layers``."""
    if keys is not None and scan_layers is not None:
        keys = [*keys, f"scan_layers={str(scan_layers).lower()}"]
    argv = (
        sys.executable,
        "-m",
        EXPORT_MODULE,
        str(L.base_yml()),
        *(model_keys(scan_layers=scan_layers) if keys is None else keys),
        "hardware=cpu",
        "skip_jax_distributed_system=true",
        f"load_parameters_path={items.resolve()}",
        f"base_output_directory={out.resolve()}",
        "--override_model_architecture",
        f"--hf_model_path={tokenizer.resolve()}",
    )
    return Job(name, out.parent, argv)


def train_sft_job(name: str, out: Path, load: Path, *extra: str) -> Job:
    """MaxText's SFT trainer (see the module docstring), run ``run`` under ``out``."""
    argv = (sys.executable, str(Path(__file__)), "train_sft", str(out), str(load), *extra)
    return Job(name, out, argv)


# ----------------------------------------------------------------------------- outputs


def read_hf(directory: Path) -> dict[str, object]:
    """``{tensor name: numpy array}`` of every ``*.safetensors`` file in ``directory``."""
    from safetensors.numpy import load_file

    out: dict[str, object] = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors = load_file(str(f))
        assert not set(tensors) & set(out), f"{f}: a tensor in two files"
        out.update(tensors)
    return out


def hf_diff(got: dict, want: dict) -> list[str]:
    """Names, shapes, dtypes and bytes of two exports: the names of what differs."""
    out = [f"missing {n}" for n in sorted(set(want) - set(got))]
    out += [f"unexpected {n}" for n in sorted(set(got) - set(want))]
    for n in sorted(set(got) & set(want)):
        g, w = got[n], want[n]
        if (g.dtype, g.shape) != (w.dtype, w.shape) or g.tobytes() != w.tobytes():
            out.append(f"{n}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}")
    return out


def hf_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


# ----------------------------------------------------------------------------- the child


def train_sft_main(out: str, load: str, *extra: str) -> None:
    """``train_sft.main`` (via the generator's ``_train_sft``) under ``app.run``: steps=2,
    checkpoint_period=2, ``load_parameters_path=load``, no ``scan_layers`` key, init seed 1
    (so weights it did not load would not pass for loaded ones)."""
    from absl import app

    gen = L.generator()
    keys = model_keys(seed=L.INIT_SEED)

    def main(_argv: list[str]) -> None:
        gen._train_sft(Path(out), "run", keys, [f"load_parameters_path={load}", *extra])

    app.run(main, argv=["train_sft"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["train_sft"] and len(sys.argv) >= 4:
        try:
            train_sft_main(*sys.argv[2:])
        finally:  # app.run exits by SystemExit: still without walking the heap (1.2 s)
            gc.freeze()
    else:
        sys.exit(f"usage: {sys.argv[0]} train_sft OUT LOAD [KEY=VALUE ...]")
