"""Interop: this library's ``CheckpointManager`` inside google-tunix 0.1.7, where Tunix's own
``CheckpointManager`` looks up ``ocp.CheckpointManager`` (issue 47).

Tunix declares its items (``model_params``, ``optimizer_state``, ``custom_metadata``): such a
caller must get the stock manager, its steps keeping the numbers it wrote them with. Before,
the manager presented Tunix directory ``N`` as MaxText step ``N - 1`` to Tunix itself: a
``PeftTrainer`` resumed one step behind (``_train_steps`` 1 while ``optimizer.step`` was 2), and
its next save renamed the directories. Here a tiny ``PeftTrainer`` trains 2 steps and a fresh one
resumes, once with the stock manager and once with ours, side by side: the same
``_train_steps``, ``optimizer.step``, ``all_steps()``, directory listing and bit-identical values.
The same directory read by a MaxText consumer (a manager declaring no Tunix item) still gets
MaxText's numbering.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import orbax_maxtext_layout as oml

peft_trainer = pytest.importorskip("tunix.sft.peft_trainer")
STOCK = ocp.CheckpointManager


class Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.a = nnx.Linear(4, 8, rngs=rngs)
        self.b = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.b(jax.nn.relu(self.a(x)))


def _loss(model: Tiny, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def _data(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(2, 4)).astype(np.float32),
            "y": rng.normal(size=(2, 2)).astype(np.float32),
        }
        for _ in range(n)
    ]


def _trainer(root: Path, max_steps: int) -> peft_trainer.PeftTrainer:
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=100,
        max_steps=max_steps,
        checkpoint_root_directory=str(root),
        checkpointing_options=ocp.CheckpointManagerOptions(
            save_interval_steps=1, max_to_keep=5, enable_async_checkpointing=False
        ),
    )
    trainer = peft_trainer.PeftTrainer(Tiny(nnx.Rngs(0)), optax.adam(1e-2), config)
    return trainer.with_loss_fn(_loss)


def _run(root: Path, manager_class: type, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Train 2 steps, close, resume in a fresh trainer: what the resumed trainer sees."""
    monkeypatch.setattr(ocp, "CheckpointManager", manager_class)
    trainer = _trainer(root, max_steps=2)
    trainer.train(_data(2))
    trainer.close()
    saved = sorted(os.listdir(root))
    resumed = _trainer(root, max_steps=3)
    out = {
        "saved": saved,
        "train_steps": resumed._train_steps,
        "optimizer_step": int(resumed.optimizer.step.value),
        "all_steps": resumed.checkpoint_manager._checkpoint_manager.all_steps(),
        "state": jax.tree.map(np.asarray, nnx.state(resumed.model)),
    }
    resumed.train(_data(3))  # one more update, saved as Tunix numbers it
    resumed.close()
    out["after"] = sorted(os.listdir(root))
    monkeypatch.setattr(ocp, "CheckpointManager", STOCK)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("tunix_drop_in")
    with pytest.MonkeyPatch.context() as mp:
        return {
            "stock": _run(work / "stock", STOCK, mp),
            "ours": _run(work / "ours", oml.CheckpointManager, mp),
            "work": work,
        }


def test_a_resumed_peft_trainer_sees_what_it_sees_with_the_stock_manager(runs):
    stock, ours = runs["stock"], runs["ours"]
    assert stock["saved"] == ["1", "2"] and stock["train_steps"] == 2  # what Tunix itself does
    for key in ("saved", "train_steps", "optimizer_step", "all_steps", "after"):
        assert ours[key] == stock[key], key
    assert ours["after"] == ["1", "2", "3"]  # no renames
    flat_stock = jax.tree_util.tree_leaves_with_path(stock["state"])
    flat_ours = dict(jax.tree_util.tree_leaves_with_path(ours["state"]))
    for path, value in flat_stock:
        assert np.asarray(flat_ours[path]).tobytes() == value.tobytes(), path


def test_the_same_directory_read_by_a_maxtext_consumer_gets_maxtext_numbering(runs):
    root = runs["work"] / "ours"
    with oml.CheckpointManager(root) as m:  # declares no Tunix item: MaxText's numbering
        assert m.numbering == "maxtext"
        assert m.all_steps() == [0, 1, 2]  # Tunix directories 1, 2, 3
    assert sorted(os.listdir(root)) == ["1", "2", "3"]  # listing moves nothing
