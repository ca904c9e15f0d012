"""Test support: tiny Flax NNX models and real Orbax writers in Tunix / MaxText layouts.

Nothing here is mocked. The models are small MaxText-shaped decoders, the optimizers are
the optax chains the post-training recipes build, and the writers call Orbax the way
google-tunix 0.1.7's ``CheckpointManager`` and MaxText's ``save_checkpoint`` do.

State paths of the model (``base/`` prefix when ``adapter=True``)::

    token_embedder/embedding                      Param (vocab, emb)
    decoder/rngs/{params,dropout}/{count,key}     RngCount () / RngKey key<fry>[]
    decoder/decoder_norm/scale                    Param (emb,)
    decoder/logits_dense/kernel                   Param (emb, vocab)
    decoder/layers_<i>/...                        unscanned, or decoder/layers/... scanned:
      pre_self_attention_layer_norm/scale         Param (emb,)          -> (emb, L)
      mlp/wi/kernel                               Param (emb, mlp)      -> (emb, L, mlp)
      mlp/wo/kernel                               Param (mlp, emb)      -> (mlp, L, emb)
      dropout/rngs/dropout/{count,key}            RngCount () / RngKey  -> (L,) / key<fry>[L]
      routing_table                               RoutingTable (4, 2) int32 -> (L, 4, 2)

(scanned shapes shown for ``param_scan_axis=1``; non-Param Variables stack on axis 0).
Layer ``i``'s dropout stream has been drawn ``i`` times, so its count is ``i``: mis-sliced
RNG state is detectable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

__all__ = [
    "Decoder",
    "DecoderLayer",
    "OptimizerKind",
    "RoutingTable",
    "Transformer",
    "TunixMaxTextAdapter",
    "abstract_model",
    "add_intermediate",
    "get_decoder",
    "make_model",
    "make_optimizer",
    "make_tx",
    "opt_state_to_linen",
    "stack_model",
    "train_steps",
    "write_maxtext_step",
    "write_tunix_step",
]

MLP_DIM = 16
ROUTING_SHAPE = (4, 2)
DROPOUT_RATE = 0.1

OptimizerKind = Literal["rl", "sft", "sft_schedule", "multisteps"]


# --------------------------------------------------------------------------- models


class RoutingTable(nnx.Variable):
    """A custom non-Param Variable (like MaxText's ``moe.Tid2EidVar``)."""


class Dense(nnx.Module):
    """A bias-free projection holding one ``kernel`` Param."""

    def __init__(self, kernel: jax.Array) -> None:
        self.kernel = nnx.Param(kernel)


class RMSNorm(nnx.Module):
    """A norm holding one ``scale`` Param."""

    def __init__(self, scale: jax.Array) -> None:
        self.scale = nnx.Param(scale)


class Mlp(nnx.Module):
    """``wi`` / ``wo`` projections."""

    def __init__(self, emb: int, mlp: int, rngs: nnx.Rngs) -> None:
        self.wi = Dense(jax.random.normal(rngs.params(), (emb, mlp), jnp.float32))
        self.wo = Dense(jax.random.normal(rngs.params(), (mlp, emb), jnp.float32))


class DecoderLayer(nnx.Module):
    """One decoder layer: norm, mlp, optional dropout with its own ``Rngs``, optional custom Variable."""

    def __init__(
        self,
        *,
        emb: int,
        mlp: int,
        layer_index: int,
        rngs: nnx.Rngs,
        dropout: bool,
        custom_var: bool,
    ) -> None:
        scale = 1.0 + 0.1 * jax.random.normal(rngs.params(), (emb,), jnp.float32)
        self.pre_self_attention_layer_norm = RMSNorm(scale)
        self.mlp = Mlp(emb, mlp, rngs)
        if dropout:
            self.dropout = nnx.Dropout(DROPOUT_RATE)
            # A full Rngs (not a forked RngStream) gives dropout/rngs/dropout/{count,key}.
            self.dropout.rngs = nnx.Rngs(dropout=rngs.params())
            for _ in range(layer_index):
                self.dropout.rngs.dropout()
        if custom_var:
            table = jax.random.randint(rngs.params(), ROUTING_SHAPE, 0, 100, jnp.int32)
            self.routing_table = RoutingTable(table)


class Decoder(nnx.Module):
    """Layers (``layers_<i>`` or stacked ``layers``), final norm, logits projection, shared Rngs."""

    def __init__(
        self,
        *,
        emb: int,
        vocab: int,
        num_layers: int,
        rngs: nnx.Rngs,
        dropout: bool,
        custom_var: bool,
    ) -> None:
        self.num_layers = num_layers
        self.scanned = False
        self.param_scan_axis: int | None = None
        for i in range(num_layers):
            layer = DecoderLayer(
                emb=emb,
                mlp=MLP_DIM,
                layer_index=i,
                rngs=rngs,
                dropout=dropout,
                custom_var=custom_var,
            )
            setattr(self, f"layers_{i}", layer)
        scale = 1.0 + 0.1 * jax.random.normal(rngs.params(), (emb,), jnp.float32)
        self.decoder_norm = RMSNorm(scale)
        self.logits_dense = Dense(jax.random.normal(rngs.params(), (emb, vocab), jnp.float32))
        self.rngs = nnx.Rngs(params=rngs.params(), dropout=rngs.params())


class Embed(nnx.Module):
    """Token embedding table (Param ``embedding``)."""

    def __init__(self, vocab: int, emb: int, rngs: nnx.Rngs) -> None:
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (vocab, emb), jnp.float32))


class Transformer(nnx.Module):
    """A bare MaxText-like model: ``token_embedder`` + ``decoder``."""

    def __init__(
        self,
        *,
        emb: int,
        vocab: int,
        num_layers: int,
        rngs: nnx.Rngs,
        dropout: bool,
        custom_var: bool,
    ) -> None:
        self.token_embedder = Embed(vocab, emb, rngs)
        self.decoder = Decoder(
            emb=emb,
            vocab=vocab,
            num_layers=num_layers,
            rngs=rngs,
            dropout=dropout,
            custom_var=custom_var,
        )


class TunixMaxTextAdapter(nnx.Module):
    """Tunix's wrapper around a MaxText model: a single attribute ``base``."""

    def __init__(self, base: Transformer) -> None:
        self.base = base


def get_decoder(model: nnx.Module) -> Decoder:
    """Returns the ``Decoder`` of a bare or adapter-wrapped model."""
    inner = model.base if isinstance(model, TunixMaxTextAdapter) else model
    assert isinstance(inner, Transformer)
    return inner.decoder


def _stack_variable(variables: Sequence[nnx.Variable], param_scan_axis: int) -> nnx.Variable:
    """Stacks one Variable across layers the way MaxText's ``create_scanned_layers`` does."""
    first = variables[0]
    values = [v.get_value() for v in variables]
    if isinstance(first, nnx.Param):
        return first.copy(jnp.stack(values, axis=param_scan_axis), param_scan_axis=param_scan_axis)
    if isinstance(first, nnx.Intermediate):  # sown tuples: stack each element
        stacked = tuple(jnp.stack(parts, axis=0) for parts in zip(*values, strict=True))
        return first.copy(stacked)
    return first.copy(jnp.stack(values, axis=0))


def _stack_layers(layers: Sequence[DecoderLayer], param_scan_axis: int) -> DecoderLayer:
    """Builds one ``DecoderLayer`` whose Variables hold the stacked per-layer values."""
    graphdef, _ = nnx.split(layers[0])
    states = [nnx.state(layer) for layer in layers]
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    stacked = jax.tree.map(
        lambda *vs: _stack_variable(vs, param_scan_axis), *states, is_leaf=is_var
    )
    return nnx.merge(graphdef, stacked)


def stack_model(model: nnx.Module, *, param_scan_axis: int = 1) -> nnx.Module:
    """Returns a scanned copy of an unscanned model holding exactly the same weights.

    Slice ``i`` of every stacked Param (at ``param_scan_axis``) and of every other stacked
    Variable (at axis 0) equals the corresponding Variable of ``layers_<i>``.
    """
    scanned = nnx.clone(model)
    decoder = get_decoder(scanned)
    if decoder.scanned:
        raise ValueError("model is already scanned")
    layers = [getattr(decoder, f"layers_{i}") for i in range(decoder.num_layers)]
    for i in range(decoder.num_layers):
        delattr(decoder, f"layers_{i}")
    decoder.layers = _stack_layers(layers, param_scan_axis)
    decoder.scanned = True
    decoder.param_scan_axis = param_scan_axis
    return scanned


def make_model(
    *,
    scanned: bool,
    adapter: bool = False,
    custom_var: bool = True,
    dropout: bool = True,
    seed: int = 0,
    num_layers: int = 3,
    emb: int = 8,
    vocab: int = 32,
    param_scan_axis: int = 1,
) -> nnx.Module:
    """Builds a tiny float32 decoder; the scanned form is ``stack_model`` of the unscanned one.

    The same ``seed`` gives the same weights in both forms, layer by layer.
    """
    rngs = nnx.Rngs(params=seed)
    model: nnx.Module = Transformer(
        emb=emb,
        vocab=vocab,
        num_layers=num_layers,
        rngs=rngs,
        dropout=dropout,
        custom_var=custom_var,
    )
    if scanned:
        model = stack_model(model, param_scan_axis=param_scan_axis)
    if adapter:
        model = TunixMaxTextAdapter(model)
    return model


def abstract_model(
    *,
    scanned: bool,
    adapter: bool = False,
    custom_var: bool = True,
    dropout: bool = True,
    seed: int = 0,
    num_layers: int = 3,
    emb: int = 8,
    vocab: int = 32,
    param_scan_axis: int = 1,
) -> nnx.Module:
    """``make_model`` under ``nnx.eval_shape``: same structure and metadata, no data."""
    return nnx.eval_shape(
        lambda: make_model(
            scanned=scanned,
            adapter=adapter,
            custom_var=custom_var,
            dropout=dropout,
            seed=seed,
            num_layers=num_layers,
            emb=emb,
            vocab=vocab,
            param_scan_axis=param_scan_axis,
        )
    )


def add_intermediate(model: nnx.Module) -> nnx.Module:
    """Sows ``max_logits`` (``nnx.Intermediate``) on the decoder and its layers, as a forward pass would.

    ``sow`` stores a tuple, so on disk the paths are ``.../max_logits/value/0``. The decoder
    gets a float32 scalar; each unscanned layer a scalar; the scanned ``layers`` an ``(L,)``.
    Returns ``model`` (modified in place).
    """
    decoder = get_decoder(model)
    decoder.sow(nnx.Intermediate, "max_logits", jnp.float32(1.5))
    if decoder.scanned:
        values = jnp.arange(decoder.num_layers, dtype=jnp.float32)
        decoder.layers.sow(nnx.Intermediate, "max_logits", values)
    else:
        for i in range(decoder.num_layers):
            layer = getattr(decoder, f"layers_{i}")
            layer.sow(nnx.Intermediate, "max_logits", jnp.float32(i))
    return model


# ----------------------------------------------------------------------- optimizers


def make_tx(kind: OptimizerKind) -> optax.GradientTransformation:
    """The optax transformation a post-training recipe builds (see DOMAIN.md section 1.1)."""

    def rl() -> optax.GradientTransformation:
        return optax.inject_hyperparams(
            lambda learning_rate: optax.chain(
                optax.clip_by_global_norm(1.0), optax.adamw(learning_rate)
            )
        )(learning_rate=optax.linear_schedule(1e-3, 1e-4, 10))

    if kind == "rl":
        return rl()
    if kind == "sft":
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    if kind == "sft_schedule":
        return optax.chain(
            optax.clip_by_global_norm(1.0), optax.adamw(optax.linear_schedule(1e-3, 1e-4, 10))
        )
    if kind == "multisteps":
        return optax.MultiSteps(rl(), every_k_schedule=2).gradient_transformation()
    raise ValueError(f"unknown optimizer kind {kind!r}")


def make_optimizer(model: nnx.Module, kind: OptimizerKind) -> nnx.Optimizer:
    """``nnx.Optimizer(model, make_tx(kind), wrt=nnx.Param)``."""
    return nnx.Optimizer(model, make_tx(kind), wrt=nnx.Param)


def _param_loss(model: nnx.Module) -> jax.Array:
    params = nnx.state(model, nnx.Param)
    return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(params))


@nnx.jit
def _train_step(model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    optimizer.update(model, nnx.grad(_param_loss)(model))


def train_steps(model: nnx.Module, optimizer: nnx.Optimizer, n: int) -> None:
    """Runs ``n`` real optimizer updates (loss = sum of squares of all Params), jitted.

    Only Params change; RNG counts/keys and custom Variables are left as built.
    """
    for _ in range(n):
        _train_step(model, optimizer)


# -------------------------------------------------------------------------- writers


def _absolute(path: str | epath.PathLike) -> epath.Path:
    path = epath.Path(path)
    return path if path.is_absolute() else path.absolute()


def write_tunix_step(
    root: str | epath.PathLike,
    step: int,
    model: nnx.Module,
    optimizer: nnx.Optimizer | None = None,
    *,
    role: str | None = None,
    custom_metadata: Mapping[str, Any] | None = None,
    use_zarr3: bool = False,
    use_ocdbt: bool = True,
) -> epath.Path:
    """Writes one step like google-tunix 0.1.7's ``CheckpointManager.save``; returns the step dir.

    Items: ``model_params`` = ``nnx.state(model)`` (every Variable type) and, when an
    optimizer is given, ``optimizer_state`` = ``nnx.state(optimizer, OptState)``. RL roles
    (``actor``/``critic``) add a directory level: ``<root>/<role>/<step>``.
    """
    directory = _absolute(root)
    if role is not None:
        directory = directory / role
    items: dict[str, ocp.args.CheckpointArgs] = {
        "model_params": ocp.args.PyTreeSave(nnx.state(model))
    }
    if optimizer is not None:
        opt_state = nnx.state(optimizer, nnx.optimizer.OptState)
        items["optimizer_state"] = ocp.args.PyTreeSave(opt_state)
    handlers = {
        name: ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
        for name in items
    }
    manager = ocp.CheckpointManager(
        directory,
        item_handlers=handlers,
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
    )
    try:
        manager.save(
            step,
            args=ocp.args.Composite(**items),
            custom_metadata=dict(custom_metadata) if custom_metadata is not None else None,
            force=True,
        )
        manager.wait_until_finished()
    finally:
        manager.close()
    return directory / str(step)


def _as_chain_index(key: Any) -> int | None:
    if isinstance(key, int):
        return key
    if isinstance(key, str) and key.isdigit():
        return int(key)
    return None


def _wrap_mu_nu(state: Any) -> Any:
    if not isinstance(state, dict):
        return state
    return {
        k: {"params": v} if k in ("mu", "nu") and isinstance(v, dict) else v
        for k, v in state.items()
    }


def opt_state_to_linen(opt_state: Any) -> Any:
    """MaxText's (non-recursive) ``_opt_state_to_linen``, DOMAIN.md section 5.

    A top-level int-keyed chain becomes a list with ``None`` gaps, each member's top-level
    ``mu``/``nu`` wrapped as ``{"params": ...}``; anything else stays a dict with only its
    top-level ``mu``/``nu`` wrapped. Nested chains and the inject shell are left untouched.
    """
    if not isinstance(opt_state, dict):
        return opt_state
    indices = [_as_chain_index(k) for k in opt_state]
    if not indices or any(i is None for i in indices):
        return _wrap_mu_nu(opt_state)
    chain: list[Any] = [None] * (max(i for i in indices if i is not None) + 1)
    for key, index in zip(opt_state, indices, strict=True):
        assert index is not None
        chain[index] = _wrap_mu_nu(opt_state[key])
    return chain


def write_maxtext_step(
    root: str | epath.PathLike,
    step: int,
    model: nnx.Module,
    optimizer: nnx.Optimizer | None = None,
    *,
    scan_layers: bool = True,
    use_zarr3: bool = True,
) -> epath.Path:
    """Writes one MaxText pre-training step (single ``items`` PyTree); returns the step dir.

    ``items = {params: {params: <Params>}, opt_state: <Linen form>, step: int32,
    nnx_aux: {model: <non-Param, non-Intermediate/Cache Variables>}}``, all pure dicts
    (no ``value`` level); step-level ``custom_metadata = {"scan_layers": scan_layers}``.
    ``opt_state`` is omitted without an optimizer; ``step`` is then the directory step.
    The model must be bare (MaxText has no ``base`` adapter level).
    """
    if isinstance(model, TunixMaxTextAdapter):
        raise ValueError("MaxText layout has no adapter level: pass model.base")
    params, _dropped, aux = nnx.state(model, nnx.Param, (nnx.Intermediate, nnx.Cache), ...)
    item: dict[str, Any] = {
        "params": {"params": params.to_pure_dict()},
        "nnx_aux": {"model": aux.to_pure_dict()},
    }
    if optimizer is not None:
        opt = nnx.state(optimizer, nnx.optimizer.OptState).to_pure_dict()
        item["opt_state"] = opt_state_to_linen(opt["opt_state"])
        item["step"] = jnp.asarray(opt["step"], jnp.int32)
    else:
        item["step"] = jnp.asarray(step, jnp.int32)
    directory = _absolute(root)
    manager = ocp.CheckpointManager(
        directory,
        item_handlers={"items": ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=use_zarr3)},
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
    )
    try:
        manager.save(
            step,
            args=ocp.args.Composite(items=ocp.args.PyTreeSave(item)),
            custom_metadata={"scan_layers": scan_layers},
            force=True,
        )
        manager.wait_until_finished()
    finally:
        manager.close()
    return directory / str(step)
