"""The walk of a command through the package: which modules it enters, how many moves it makes
between them, and the path of one array from the command to its first decoded chunk
(issue 42: the house by concern).

    python bench/walk.py -- convert STEP_ROOT --unroll --target-from UNSCANNED_STEP
    python bench/walk.py -- export-hf STEP --out DIR --maxtext-config base.yml KEY=VALUE...
    python bench/walk.py -- restore STEP --target-from MAXTEXT_STEP

``restore`` is not a command: it walks ``oml.load_params_from_path(STEP, params)`` (MaxText's
restore of the params, either layout), the params' shapes from ``MAXTEXT_STEP``'s metadata
(``Target.from_checkpoint``), each on the default device; it also counts how often each
item's ``_METADATA`` is parsed (``parses``), which should be once.

runs the CLI in this process under a profiler (`sys.setprofile`, every thread) that sees
only the package's own functions. A move is a call from a function of one module into a
function of another (each pair counted once: the ``moves`` of the report); ``calls_across``
counts every such call. The path of one array is every module the first array read enters, in
order, from its caller until the decoder returns (or yields) its first values: the first call of
``pieces``, ``read_whole`` or ``read_array`` of the reader (``chunks``/``tskv`` before the
house, ``reader`` after). Run it against another checkout with
``PYTHONPATH=<that checkout>`` to compare before and after. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

# The calls that read an array's values, old names and new: the walk of the first one is kept.
READS = ("pieces", "read_whole", "read_array")
READERS = ("chunks", "tskv", "reader")
DECODES = ("_decode", "_tensorstore_pieces", "read_array")  # where values come out


def _module(filename: str, root: str) -> str | None:
    if not filename.startswith(root) or not filename.endswith(".py"):
        return None
    rel = filename[len(root) :].removesuffix(".py").removesuffix("/__init__")
    return rel.replace("/", ".") or "__init__"


def _restore(argv: list[str]):
    """``restore STEP --target-from MAXTEXT_STEP``: MaxText's params restore of ``STEP``, as a
    call to walk (its params' shapes read before)."""
    import jax

    import orbax_maxtext_layout as oml

    step, ref = argv[1], argv[argv.index("--target-from") + 1]
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params: dict = {}
    for path, spec in oml.Target.from_checkpoint(ref).abstract.items():
        if tuple(path[:2]) == ("params", "params"):  # MaxText's params: nested dicts
            node = params
            for k in ("params", *path[2:-1]):
                node = node.setdefault(k, {})
            node[path[-1]] = jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=device)
    return lambda _: oml.load_params_from_path(step, params) and 0


def _parses() -> tuple[list[str], object]:
    """A count of `_METADATA` parses (``json.loads`` of a text holding ``tree_metadata``)."""
    import json as json_module

    seen: list[str] = []
    loads = json_module.loads

    def counting(text, *args, **kwargs):
        out = loads(text, *args, **kwargs)
        if isinstance(out, dict) and "tree_metadata" in out:
            seen.append(str(len(out["tree_metadata"])))
        return out

    json_module.loads = counting
    return seen, lambda: setattr(json_module, "loads", loads)


def main(argv: list[str]) -> int:
    from _internal import run_cli

    import orbax_maxtext_layout

    root = str(Path(orbax_maxtext_layout.__file__).parent) + "/"
    entered: set[str] = set()
    moves: set[tuple[str, str]] = set()
    across = [0]

    reading: list = []  # the frame of the first array read, while it runs
    sequence: list[str] = []

    def profile(frame, event, arg):
        if event == "return" and len(reading) == 1 and frame.f_code.co_name in DECODES:
            reading.append(None)  # its first values are out: the first array's walk is recorded
            return
        if event != "call":
            return
        here = _module(frame.f_code.co_filename, root)
        if here is None or frame.f_code.co_name == "<module>":  # an import, not the walk
            return
        entered.add(here)
        caller = frame.f_back
        while caller is not None and _module(caller.f_code.co_filename, root) is None:
            caller = caller.f_back
        if caller is not None:
            there = _module(caller.f_code.co_filename, root)
            if there != here:
                moves.add((there, here))
                across[0] += 1
        if not reading and frame.f_code.co_name in READS and here.endswith(READERS):
            reading.append(frame)
            sequence.append(there if caller is not None else "?")
        if len(reading) == 1 and (not sequence or sequence[-1] != here):
            sequence.append(here)

    command = _restore(argv) if argv[0] == "restore" else run_cli
    parses, unpatch = _parses()
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        code = command(argv)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        unpatch()
    path = sequence
    print(
        json.dumps(
            {
                "command": argv[0],
                "exit": code,
                "modules_entered": len(entered),
                "moves": len(moves),
                "calls_across": across[0],
                "one_array": " -> ".join(path),
                "one_array_moves": max(len(path) - 1, 0),
                "metadata_parses": len(parses),
                "entered": sorted(entered) if "-v" in sys.argv else None,
            }
        )
    )
    return code  # the command's own exit status: a walk of a failed command fails


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args[args.index("--") + 1 :] if "--" in args else args))
