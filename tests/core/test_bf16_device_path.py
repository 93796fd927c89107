"""bfloat16 rounding on device arrays never asks the host whether a NaN is present.

``float32_to_bf16`` runs once per 65,536-element block of a bfloat16 PREMUL_SUM or AVG on a CUDA
array; ``nan.any()`` there was a host synchronisation per block (issue 31, item 11). A NumPy
array that presents itself as device memory, and whose ``any``/``all``/``__bool__`` fail, stands
in for CuPy: the function must take its device path and still give the canonical NaN.
"""

from __future__ import annotations

import numpy as np

from colls import dtypes


class _DeviceLike(np.ndarray):
    """NumPy memory posing as CUDA memory; asking it for a host-side answer fails."""

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3}

    def any(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        raise AssertionError("host synchronisation: any() on a device array")

    def all(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        raise AssertionError("host synchronisation: all() on a device array")

    def __bool__(self) -> bool:
        raise AssertionError("host synchronisation: bool() of a device array")


def test_device_arrays_get_canonical_nans_without_a_host_check():
    values = np.array([1.0, np.nan, -np.nan, 3.5, np.inf, np.float32(1.00390625)],
                      dtype=np.float32)
    expected = dtypes.float32_to_bf16(values)  # the host path
    assert expected[1] == expected[2] == dtypes.BF16_CANONICAL_NAN
    got = dtypes.float32_to_bf16(values.view(_DeviceLike))
    assert np.asarray(got).tolist() == expected.tolist()
    out = np.zeros(values.shape, dtype=np.uint16).view(_DeviceLike)
    assert dtypes.float32_to_bf16(values.view(_DeviceLike), out=out) is out
    assert np.asarray(out).tolist() == expected.tolist()
