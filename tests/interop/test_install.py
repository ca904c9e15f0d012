"""`orbax_maxtext_layout.maxtext.install()` in a process with MaxText 0.2.5."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("maxtext.common.checkpointing")

from maxtext.common import checkpointing as mcp

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.maxtext import install
from orbax_maxtext_layout.training import Checkpointer


@pytest.fixture
def pristine_maxtext():
    """install() patches MaxText for the whole process: undo it, so that the other interop
    tests (which pin stock MaxText's own behaviour) see stock MaxText."""
    create, load = mcp.create_orbax_checkpoint_manager, mcp.load_params_from_path
    yield create, load
    mcp.create_orbax_checkpoint_manager, mcp.load_params_from_path = create, load


def test_install_patches_two_functions_once_and_logs_it(tmp_path, caplog, pristine_maxtext):
    original_create, original_load = pristine_maxtext
    caplog.set_level(logging.INFO, "orbax_maxtext_layout.maxtext")
    install()
    create, load = mcp.create_orbax_checkpoint_manager, mcp.load_params_from_path
    assert create is not original_create and load is not original_load
    install()  # idempotent: nothing wrapped twice, logged once
    assert mcp.create_orbax_checkpoint_manager is create and mcp.load_params_from_path is load
    assert sum("now builds" in r.getMessage() for r in caplog.records) == 1
    # MaxText's own factory, with its own arguments, builds the library's Checkpointer...
    manager = mcp.create_orbax_checkpoint_manager(str(tmp_path / "ckpt"), True, False, 1)
    try:
        assert isinstance(manager, Checkpointer) and manager.use_async is False
    finally:
        manager.close()
    # ...and the module's Orbax is the stock one again outside that call.
    assert mcp.ocp.training.Checkpointer is not Checkpointer
    assert oml.Layout  # the package stays importable beside MaxText


def test_runner_installs_the_module_importable_by_name(tmp_path):
    """``python -m orbax_maxtext_layout.maxtext`` runs the file as ``__main__``; what it
    installs into MaxText must come from ``orbax_maxtext_layout.maxtext`` (one copy)."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\n"
        "from maxtext.common import checkpointing as c\n"
        "import orbax_maxtext_layout.maxtext as m\n"
        "print('PROBE', c.create_orbax_checkpoint_manager.__module__, "
        "c.load_params_from_path.__module__)\n"
        "print('PROBE', '__main__' in {f.__module__ for f in (m.install, m.main)}, "
        "sys.modules['orbax_maxtext_layout.maxtext'] is m)\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "orbax_maxtext_layout.maxtext", script.stem],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout.split("\n")
    out = [line for line in out if line.startswith("PROBE ")]
    assert out[0] == "PROBE orbax_maxtext_layout.maxtext orbax_maxtext_layout.maxtext", out
    assert out[1] == "PROBE False True", out
