"""`hooks_by_box.PieceFn`: a function of a whole array applied to boxes of it, bit for bit.

The functions are built like MaxText's Hugging Face hooks (llama's query chain: a float32
scaling, the RoPE permutation by strided slices and a concatenation, the transposing
reshape; gemma's division of the embedding by a constant), in bfloat16 and float32. Every
box of a grid, put through `PieceFn.apply` and placed at the start it returns, must give
exactly what the function gives on the whole array under JAX.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from orbax_maxtext_layout.hf.hooks_by_box import PieceFn


def scale(x):
    return (x.astype(np.float32) * np.float32(np.sqrt(64))).astype(x.dtype)


def rope(x):
    return jnp.concatenate((x[..., ::2], x[..., 1::2]), axis=x.ndim - 1)


def flip_t(target):
    return lambda x: x.reshape(tuple(np.flip(np.array(target)))).transpose()


def query(x):  # (emb, heads, head_dim) -> (heads * head_dim, emb)
    return flip_t((64, 48))(rope(scale(x)))


def rope_in(x):  # MaxText's import of RoPE's order: the halves interleaved (``jnp.stack``)
    half = x.shape[-1] // 2
    return jnp.stack([x[..., :half], x[..., half:]], axis=-1).reshape(x.shape)


def query_in(x):  # (heads * head_dim, emb) -> (emb, heads, head_dim), as to_maxtext imports it
    return scale(rope_in(x.T.reshape(48, 4, 16)))


def embedding(x):  # XLA divides by multiplying with the reciprocal
    return x / np.float32(5.65625)


CASES = {
    "query": (query, (48, 4, 16), ml_dtypes.bfloat16, (64, 48), [(8, 4, 16), (1, 4, 16)]),
    "kernel": (flip_t((96, 48)), (48, 96), ml_dtypes.bfloat16, (96, 48), [(8, 96), (48, 12)]),
    "out": (flip_t((48, 64)), (4, 16, 48), np.float32, (48, 64), [(1, 16, 48), (4, 16, 12)]),
    "query import": (query_in, (64, 48), np.float32, (48, 4, 16), [(64, 1), (16, 48), (64, 8)]),
    "embedding": (embedding, (64, 32), np.float32, (64, 32), [(7, 32), (64, 5), (9, 11)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_boxes_give_the_whole_function_bit_for_bit(case):
    fn, shape, dtype, target, boxes = CASES[case]
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    want = np.asarray(fn(jnp.asarray(x)))
    pf = PieceFn.trace(fn, shape, np.dtype(dtype), [target])
    assert pf is not None and pf.held >= 1
    for box_shape in boxes:
        out = np.zeros(target, want.dtype)
        seen = np.zeros(target, np.int8)
        for start in itertools.product(
            *(range(0, n, b) for n, b in zip(shape, box_shape, strict=False))
        ):
            box = tuple(slice(s, s + b) for s, b in zip(start, box_shape, strict=False))
            got = pf.apply(start, x[box])
            assert got is not None, (case, box_shape)
            [(at, part)] = got
            place = tuple(slice(s, s + n) for s, n in zip(at, part.shape, strict=False))
            out[place] = part
            seen[place] += 1
        assert (seen == 1).all(), (case, box_shape)
        assert out.tobytes() == want.tobytes(), (case, box_shape)


def test_a_box_that_cannot_go_through_is_refused_never_approximated():
    pf = PieceFn.trace(rope, (8, 16), np.dtype(np.float32), [(8, 16)])
    x = np.ones((8, 4), np.float32)  # cuts the axis the strided slices read
    assert pf.apply((0, 4), x) is None
    # a box of a transposing reshape that is not one run of the reshaped axes
    pf = PieceFn.trace(flip_t((64, 48)), (48, 4, 16), np.dtype(np.float32), [(64, 48)])
    assert pf.apply((0, 1, 0), np.ones((48, 2, 8), np.float32)) is None


def test_a_function_with_a_gather_is_not_traced_for_boxes():
    perm = np.random.default_rng(0).permutation(16)
    assert PieceFn.trace(lambda x: x[:, perm], (8, 16), np.dtype(np.float32), [(8, 16)]) is None
