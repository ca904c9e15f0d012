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
