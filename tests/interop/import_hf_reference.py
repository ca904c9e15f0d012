"""The reference of issue 43 for test_import_hf.py: MaxText 0.2.5's own
``python -m maxtext.checkpoint_conversion.to_maxtext``, run stock (its ``__main__`` block,
through ``runpy``, with the same ``sys.argv``), with ONE change:

    before it builds its mappings, MaxText's Hugging Face config for ``model_name``
    (``HF_MODEL_CONFIGS[model_name]``, the full-size config to_maxtext maps with) gets the
    MaxText config's sizes through MaxText's own
    ``to_huggingface._validate_or_update_architecture(hf_config, config, override=True)``.

The change is made where to_maxtext builds its MaxText config: ``pyconfig.initialize`` (which
``to_maxtext.main`` calls once, before ``HF_MODEL_CONFIGS[model_key]``) is wrapped so that,
with the config it returns, a resized deep copy of ``HF_MODEL_CONFIGS[model_name]`` replaces
the entry of that (shared) dict. Nothing else is touched: the mapping, the hooks, the lazy
loader, the dtype conversion and the save are to_maxtext's.

    python import_hf_reference.py <to_maxtext's arguments, as for python -m ...to_maxtext>

Prints ``import_hf_reference: resized <model_name>: {...}`` (the sizes it set) to stdout.
Top-level imports are the standard library only.
"""

from __future__ import annotations

import copy
import gc
import json
import runpy
import sys

MODULE = "maxtext.checkpoint_conversion.to_maxtext"
MARK = "import_hf_reference: resized"


def _install() -> None:
    from maxtext.checkpoint_conversion.utils import hf_model_configs
    from maxtext.configs import pyconfig

    initialize = pyconfig.initialize
    done = []

    def resized_initialize(*args, **kwargs):
        config = initialize(*args, **kwargs)
        if not done:  # to_maxtext.main calls it once; only its config resizes
            done.append(True)
            from maxtext.checkpoint_conversion.to_huggingface import (
                _validate_or_update_architecture,
            )

            name = config.model_name
            configs = hf_model_configs.HF_MODEL_CONFIGS
            hf_config = copy.deepcopy(configs[name])
            before = hf_config.to_dict()
            _validate_or_update_architecture(hf_config, config, override=True)
            after = hf_config.to_dict()
            configs[name] = hf_config
            was = _flat(before)
            changed = {k: [was.get(k), v] for k, v in _flat(after).items() if was.get(k) != v}
            print(f"{MARK} {name}: {json.dumps(changed, default=str)}", flush=True)
        return config

    pyconfig.initialize = resized_initialize


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def main(argv: list[str]) -> None:
    _install()
    sys.argv = [MODULE, *argv]
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:  # a clean exit, without walking the heap MaxText left (1.2 s)
        gc.freeze()
