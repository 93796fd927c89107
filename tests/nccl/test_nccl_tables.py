"""The nccl backend's two tables, checked for every entry without a GPU.

* The (dtype, op) table: for every dtype colls has and every op, NCCL is either asked for
  something that gives torch's result, or the pair is refused with torch's error. "Gives torch's
  result" is checked by running the plan on NumPy: each rank's array is prepared by the core
  (PREMUL_SUM scales), viewed or widened as the plan says, reduced with the NCCL op's meaning
  (colls' own kernels for that dtype; NCCL_AVG as NCCL computes it on floating values: each input
  times 1/n in the dtype's precision, then summed, the core not dividing after), narrowed back,
  and compared with the core's reference for the original (dtype, op), which the suite holds to
  torch (for AVG: with NCCL's rounding, 1/n applied before the sum, which torch gets too).
* The constants the table names, pinned to their values in nccl.h (``ncclRedOp_t``,
  ``ncclDataType_t``) as CuPy exports them: at world size 1 NCCL never reduces, so the GPU tests
  would pass with PROD mapped to SUM; this table is what catches that.
* The NCCL result codes: every code becomes the colls error its row names, including 7 and 8,
  for which CuPy 14 raises KeyError instead of NcclError.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from _support import accepted_reductions, op_of

from colls import dtypes
from colls.errors import BackendError, NetworkError
from colls.reduce_ops import RedOpType, make_premul_sum, resolve_op
from colls.testing.arrays import random_array
from colls_plugins.nccl import datatypes, errors

needs_cupy = pytest.mark.skipif(
    importlib.util.find_spec("cupy") is None, reason="needs cupy (pip install cupy-cuda12x)"
)

RANKS = 3
COUNT = 9
# NCCL op name -> the colls kind with the same meaning, on the dtype NCCL is told.
NCCL_MEANING = {"NCCL_SUM": RedOpType.SUM, "NCCL_PROD": RedOpType.PRODUCT,
                "NCCL_MIN": RedOpType.MIN, "NCCL_MAX": RedOpType.MAX, "NCCL_AVG": RedOpType.AVG}
#: ncclRedOp_t and ncclDataType_t in nccl.h (NCCL 2.10 and later).
NCCL_H = {"NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4,
          "NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_UINT32": 3, "NCCL_INT64": 4,
          "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7, "NCCL_FLOAT64": 8,
          "NCCL_BFLOAT16": 9}
NCCL_DTYPES = {"NCCL_INT8": dtypes.INT8, "NCCL_UINT8": dtypes.UINT8, "NCCL_INT32": dtypes.INT32,
               "NCCL_UINT32": dtypes.UINT32, "NCCL_INT64": dtypes.INT64,
               "NCCL_UINT64": dtypes.UINT64, "NCCL_FLOAT16": dtypes.FLOAT16,
               "NCCL_BFLOAT16": dtypes.BFLOAT16, "NCCL_FLOAT32": dtypes.FLOAT32,
               "NCCL_FLOAT64": dtypes.FLOAT64}


PAIRS = accepted_reductions()


def _run_plan(plan: datatypes.NcclReduction, spec, arrays: list[np.ndarray]) -> np.ndarray:
    """Reduce per-rank ``arrays`` as the nccl backend would, with NumPy standing in for NCCL."""
    operands = []
    for array in arrays:
        data = np.array(array, dtype=spec.dtype.numpy, copy=True)
        spec.prepare(data)  # the core's step before the backend (PREMUL_SUM scales)
        if plan.view is not None:
            operands.append(data.view(plan.view))
        elif plan.widen is not None:
            operands.append(data.astype(plan.widen))
        else:
            operands.append(data)
    told = NCCL_DTYPES[plan.nccl_dtype]
    assert operands[0].dtype == told.numpy, (plan, operands[0].dtype)  # NCCL reads these words
    nccl_op = resolve_op(NCCL_MEANING[plan.nccl_op], told, op_name="nccl")
    if nccl_op.kind is RedOpType.AVG:  # ncclDevPreMulSum with 1/n in the dtype, then SUM
        assert told.is_floating, plan  # NCCL would divide integers after, truncating
        scale = resolve_op(make_premul_sum(1.0 / len(arrays)), told, op_name="nccl")
        for operand in operands:
            scale.prepare(operand)
        nccl_op = resolve_op(RedOpType.SUM, told, op_name="nccl")
        spec = spec.averaged_by_backend()  # NcclBackend.reduces_avg: the core does not divide
    acc = operands[0].copy()
    for other in operands[1:]:
        nccl_op.combine(acc, other)
    result = np.empty(len(arrays[0]), dtype=spec.dtype.numpy)
    if plan.view is not None:
        result.view(plan.view)[...] = acc
    else:
        np.copyto(result, acc, casting="unsafe")  # narrowing keeps the low bits
    spec.finish(result, len(arrays))  # the core's step after (AVG divides)
    return result


@pytest.mark.parametrize(("dtype", "kind"), PAIRS, ids=[f"{d.name}-{k.name}" for d, k in PAIRS])
def test_every_pair_gives_torchs_result_or_torchs_error(dtype, kind):
    spec = resolve_op(op_of(kind), dtype, op_name="all_reduce")
    if kind in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR):
        with pytest.raises(ValueError, match=rf"^all_reduce on rank 3: Cannot use "
                                             rf"ReduceOp\.{kind.name} with NCCL$"):
            datatypes.reduction(dtype, kind, op_name="all_reduce", rank=3)
        return
    if dtype.is_complex and kind is RedOpType.PRODUCT:
        with pytest.raises(ValueError, match=r"^reduce on rank 1: reduce does not support "
                                             r"ReduceOp\.PRODUCT on complex tensors with NCCL"):
            datatypes.reduction(dtype, kind, op_name="reduce", rank=1)
        return
    plan = datatypes.reduction(dtype, kind, op_name="all_reduce", rank=0)
    rng = np.random.default_rng(hash((dtype.name, kind.name)) % 2**32)
    if dtype in (dtypes.INT16, dtypes.UINT16) and kind in (RedOpType.SUM, RedOpType.PRODUCT):
        info = np.iinfo(dtype.numpy)  # values that overflow 16 bits: wrapping must survive
        arrays = [rng.integers(info.min, info.max, size=COUNT, endpoint=True).astype(dtype.numpy)
                  for _ in range(RANKS)]
    else:
        arrays = [random_array(dtype, COUNT, rng) for _ in range(RANKS)]
    if kind is RedOpType.AVG:  # NCCL's (and torch's) rounding: 1/n before the sum
        expected = resolve_op(make_premul_sum(1.0 / RANKS), dtype,
                              op_name="all_reduce").numpy_reference(arrays)
    else:
        expected = spec.numpy_reference(arrays)
    got = _run_plan(plan, spec, arrays)
    assert got.tobytes() == expected.tobytes(), (plan, arrays, got, expected)


def test_the_table_is_the_documented_one():
    """Spot checks of the mappings the docs name (bool, complex, narrow ints, scaled ops)."""
    def plan(dtype, kind):
        return datatypes.reduction(dtype, kind, op_name="all_reduce", rank=0)

    assert plan(dtypes.BOOL, RedOpType.SUM) == datatypes.NcclReduction(
        "NCCL_UINT8", "NCCL_MAX", view="uint8")
    assert plan(dtypes.BOOL, RedOpType.PRODUCT).nccl_op == "NCCL_MIN"
    assert plan(dtypes.COMPLEX64, RedOpType.AVG) == datatypes.NcclReduction(
        "NCCL_FLOAT32", "NCCL_AVG", view="float32")
    assert plan(dtypes.COMPLEX128, RedOpType.PREMUL_SUM).view == "float64"
    assert plan(dtypes.INT16, RedOpType.SUM).widen == "uint32"
    assert plan(dtypes.UINT16, RedOpType.MIN) == datatypes.NcclReduction(
        "NCCL_INT32", "NCCL_MIN", widen="int32")
    assert plan(dtypes.BFLOAT16, RedOpType.AVG) == datatypes.NcclReduction(
        "NCCL_BFLOAT16", "NCCL_AVG")
    assert plan(dtypes.FLOAT16, RedOpType.AVG).nccl_op == "NCCL_AVG"
    assert plan(dtypes.FLOAT32, RedOpType.PREMUL_SUM).nccl_op == "NCCL_SUM"
    assert plan(dtypes.INT32, RedOpType.PRODUCT) == datatypes.NcclReduction("NCCL_INT32",
                                                                            "NCCL_PROD")
    assert plan(dtypes.FLOAT64, RedOpType.MIN) == datatypes.NcclReduction("NCCL_FLOAT64",
                                                                          "NCCL_MIN")
    assert plan(dtypes.UINT64, RedOpType.MAX) == datatypes.NcclReduction("NCCL_UINT64",
                                                                         "NCCL_MAX")
    with pytest.raises(ValueError, match=r"^all_reduce on rank 0: ReduceOp\.AVG on int32 is not "
                                         r"supported with NCCL$"):
        plan(dtypes.INT32, RedOpType.AVG)  # the core refuses it first; the table does too


def test_every_constant_the_table_names_has_its_nccl_h_value():
    """Pins each name to nccl.h, so that a wrong name (PROD for SUM) cannot pass at one rank."""
    names = {datatypes.BYTES}
    for d, k in PAIRS:
        try:
            plan = datatypes.reduction(d, k, op_name="all_reduce", rank=0)
        except ValueError:
            continue
        names |= {plan.nccl_dtype, plan.nccl_op}
    assert names <= set(NCCL_H), names - set(NCCL_H)
    ops = {name for name in names if name in NCCL_MEANING}
    assert ops == {"NCCL_SUM", "NCCL_PROD", "NCCL_MIN", "NCCL_MAX", "NCCL_AVG"}
    for name in sorted(names):  # what nccl_constant resolves against, from a stand-in module
        stand_in = type("nccl", (), {name: NCCL_H[name]})
        assert datatypes.nccl_constant(stand_in, name) == NCCL_H[name]


@needs_cupy
def test_cupys_nccl_constants_are_nccl_h():
    from cupy.cuda import nccl

    for name, value in sorted(NCCL_H.items()):
        assert getattr(nccl, name) == value, name


@needs_cupy
def test_every_name_in_the_table_is_a_cupy_nccl_constant():
    from cupy.cuda import nccl

    names = {datatypes.BYTES, *NCCL_DTYPES, *NCCL_MEANING}
    for d, k in PAIRS:
        try:
            plan = datatypes.reduction(d, k, op_name="all_reduce", rank=0)
        except ValueError:
            continue
        names |= {plan.nccl_dtype, plan.nccl_op}
    for name in sorted(names):
        assert isinstance(datatypes.nccl_constant(nccl, name), int), name


# -- result codes ------------------------------------------------------------------------------


def _nccl_error_class():
    if importlib.util.find_spec("cupy") is None:
        return None
    from cupy.cuda import nccl

    return nccl.NcclError


def _raised_for(code: int) -> BaseException:
    """What CuPy raises for result ``code`` (KeyError where its table lacks the code)."""
    nccl_error = _nccl_error_class()
    if nccl_error is None:
        return KeyError(code)  # CuPy absent: the KeyError shape is the one to translate
    try:
        return nccl_error(code)
    except KeyError as exc:  # CuPy 14 for codes 7 and 8
        return exc


@pytest.mark.parametrize("code", sorted(errors.NCCL_CODES))
def test_every_result_code_becomes_its_colls_error(code):
    row = errors.NCCL_CODES[code]
    error = errors.translate(_raised_for(code), _nccl_error_class(), what="all_reduce on rank 4")
    assert type(error) is row.error
    assert str(error).startswith(
        f"nccl: all_reduce on rank 4 failed: {row.name} ({code}): {row.meaning}."), error
    assert (row.error is NetworkError) == (code == 6)
    assert issubclass(row.error, BackendError)


@needs_cupy
def test_cupy_still_raises_key_error_for_7_and_8_and_it_is_translated():
    from cupy.cuda import nccl

    for code in (7, 8):
        try:
            raised: BaseException = nccl.NcclError(code)
        except KeyError as exc:
            raised = exc
        error = errors.translate(raised, nccl.NcclError, what="barrier on rank 0")
        assert error is not None and errors.NCCL_CODES[code].name in str(error)


def test_other_exceptions_are_not_nccl_failures():
    assert errors.translate(ValueError("x"), _nccl_error_class(), what="op") is None
    assert errors.translate(KeyError("name"), _nccl_error_class(), what="op") is None
    unknown = errors.translate(KeyError(42), _nccl_error_class(), what="op on rank 0")
    assert isinstance(unknown, BackendError)
    assert "unknown NCCL result code 42" in str(unknown)
