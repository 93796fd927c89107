"""Per-rank inputs and NumPy references of the colls_jax tests (no colls, no JAX arithmetic).

Inputs are small integers stored in the tested dtype, so sums, products, minima and maxima over
a few ranks are exact even in bfloat16; only AVG and PREMUL_SUM need a tolerance. Every rank can
rebuild every other rank's input from (rank, dtype, shape, salt), which is how the references
are computed.
"""

from __future__ import annotations

import zlib
from typing import Any

import ml_dtypes
import numpy as np

DTYPES = ("float32", "int32", "bfloat16", "bool", "float16", "uint8", "complex64")
#: The dtypes also checked under jit (each is one more compile of a 40-callback program per
#: rank, which is what the time of these tests is made of).
JIT_DTYPES = ("float32", "int32", "bfloat16", "bool")
FLOATS = ("float32", "bfloat16", "float16", "complex64")

#: The reductions each dtype allows (torch's rules: no bitwise on floats, no AVG on integers,
#: no MIN/MAX on complex).
REDUCTIONS = {
    "float32": ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"),
    "bfloat16": ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"),
    "float16": ("SUM", "AVG", "PRODUCT", "MIN", "MAX"),
    "complex64": ("SUM", "AVG", "PRODUCT"),
    "int32": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
    "uint8": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
    "bool": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
}
PREMUL_FACTOR = 0.5  # a power of two: exact in every float dtype

TOLERANCE = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2, "complex64": 1e-6}


def np_dtype(name: str) -> np.dtype:
    """Return the NumPy dtype of a test dtype name (ml_dtypes for bfloat16)."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def data(rank: int, dtype: str, shape: tuple[int, ...], salt: int = 0) -> np.ndarray:
    """Return rank ``rank``'s deterministic input: small integers in ``dtype``."""
    seed = zlib.crc32(f"{rank}/{dtype}/{shape}/{salt}".encode())
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    low = 0 if dtype in ("uint8", "bool") else -3
    values = rng.integers(low, 4, size=shape)
    if dtype == "complex64":
        values = values + 1j * rng.integers(-3, 4, size=shape)
    return values.astype(np_dtype(dtype))


def all_data(size: int, dtype: str, shape: tuple[int, ...], salt: int = 0) -> list[np.ndarray]:
    """Return every rank's input."""
    return [data(r, dtype, shape, salt) for r in range(size)]


def reduce(arrays: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    """Return the reduction of per-rank arrays as torch/colls define it, computed in NumPy."""
    stack = np.stack([a.astype(np.complex128 if dtype == "complex64" else np.float64)
                      if dtype != "bool" and dtype not in ("int32", "uint8") else a
                      for a in arrays])
    if dtype == "bool":
        logical = {"SUM": np.any, "MAX": np.any, "BOR": np.any, "PRODUCT": np.all,
                   "MIN": np.all, "BAND": np.all}
        if op == "BXOR":
            return np.logical_xor.reduce(stack, axis=0)
        return logical[op](stack, axis=0)
    if op in ("BAND", "BOR", "BXOR"):
        ufunc = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
        return ufunc.reduce(stack, axis=0)
    if dtype in ("int32", "uint8"):
        wide = stack.astype(np.int64)
        result = {"SUM": wide.sum(0), "PRODUCT": wide.prod(0), "MIN": wide.min(0),
                  "MAX": wide.max(0)}[op]
        return result.astype(np_dtype(dtype))  # wraps like the integer op
    result = {
        "SUM": lambda: stack.sum(0), "AVG": lambda: stack.sum(0) / len(arrays),
        "PRODUCT": lambda: stack.prod(0), "MIN": lambda: stack.min(0),
        "MAX": lambda: stack.max(0), "PREMUL_SUM": lambda: (stack * PREMUL_FACTOR).sum(0),
    }[op]()
    return result


def assert_equal(got: Any, expected: np.ndarray, dtype: str, what: str) -> None:
    """Compare a result with its reference: exact for integers and bool, close for floats."""
    got = np.asarray(got)
    if got.shape != np.shape(expected):
        raise AssertionError(f"{what}: shape {got.shape}, expected {np.shape(expected)}")
    if got.dtype != np_dtype(dtype):
        raise AssertionError(f"{what}: dtype {got.dtype}, expected {np_dtype(dtype)}")
    if dtype in FLOATS:
        wide = np.complex128 if dtype == "complex64" else np.float64
        np.testing.assert_allclose(got.astype(wide), np.asarray(expected).astype(wide),
                                   rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype], err_msg=what)
    else:
        np.testing.assert_array_equal(got, np.asarray(expected).astype(np_dtype(dtype)),
                                      err_msg=what)
