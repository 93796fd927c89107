"""Reverse-mode gradients of the collectives, with ``jax.custom_vjp``.

A host callback is opaque to JAX, so every differentiable collective states its VJP here. The
collectives that are linear maps of the inputs of all ranks have an exact transpose that is
itself a collective, run on the cotangents in the backward pass::

    all_reduce SUM / AVG / PREMUL_SUM(f)  ->  the same all_reduce
    all_gather(tiled)                      <-> reduce_scatter(SUM, tiled)
    broadcast(root)                        <-> reduce(SUM, root)
    gather(root)                           <-> scatter(root)
    all_to_all                             ->  all_to_all
    ppermute(perm) / shift(k)              ->  ppermute(inverse perm) / shift(-k)

Convention: ``jax.grad`` on each rank seeds the cotangent of that rank's output, so the
objective being differentiated is the sum over ranks of each rank's output. For y = sum_r x_r
on every rank, d(sum_s y_s)/dx_r is the all_reduce of the cotangents, which is what the VJP
returns.

Collectives that are not linear (MAX, MIN, PRODUCT, bitwise reductions) raise a clear error
when differentiated. Forward mode (``jax.jvp``, ``jacfwd``) is not available: JAX refuses
forward mode on a ``custom_vjp`` function with its own error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from colls_jax import _jit

Fn = Callable[[jax.Array], Any]


def _differentiable(x: jax.Array) -> bool:
    """Only traced floating arrays can carry a gradient; everything else skips custom_vjp."""
    return _jit.is_traced(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def linear(x: jax.Array, forward: Fn, transpose: Fn) -> Any:
    """Return ``forward(x)``, differentiable with VJP ``g -> transpose(g)``."""
    if not _differentiable(x):
        return forward(x)

    @jax.custom_vjp
    def fn(value: jax.Array) -> Any:
        return forward(value)

    def fwd(value: jax.Array) -> tuple[Any, None]:
        return forward(value), None

    def bwd(_: None, cotangent: jax.Array) -> tuple[Any]:
        return (transpose(cotangent),)

    fn.defvjp(fwd, bwd)
    return fn(x)


def not_differentiable(x: jax.Array, forward: Fn, reason: str) -> Any:
    """Return ``forward(x)``; differentiating it raises NotImplementedError(``reason``)."""
    if not _differentiable(x):
        return forward(x)

    @jax.custom_vjp
    def fn(value: jax.Array) -> Any:
        return forward(value)

    def fwd(value: jax.Array) -> tuple[Any, None]:
        raise NotImplementedError(reason)

    def bwd(_: None, cotangent: jax.Array) -> tuple[Any]:
        raise NotImplementedError(reason)

    fn.defvjp(fwd, bwd)
    return fn(x)
