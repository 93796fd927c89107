"""Rank functions of the tests in this folder (module level, so spawn can import them)."""

from __future__ import annotations

from typing import Any

import numpy as np

import colls

COUNT = 1000


def zero_copy_numpy(rank: int, world_size: int) -> dict[str, Any]:
    """all_reduce a NumPy array; report whether a view taken before the call sees the result."""
    array = np.full(COUNT, rank + 1, dtype=np.float32)
    alias = array[:]
    address = array.ctypes.data
    colls.all_reduce(array)
    return {"address_kept": array.ctypes.data == address, "alias": alias.copy()}


def zero_copy_torch(rank: int, world_size: int) -> dict[str, Any]:
    """all_reduce a torch CPU tensor; report its data_ptr and a pre-taken NumPy view."""
    import torch

    tensor = torch.full((COUNT,), float(rank + 1), dtype=torch.float64)
    before = tensor.data_ptr()
    shared = tensor.numpy()  # shares memory with the tensor
    colls.all_reduce(tensor)
    return {"address_kept": tensor.data_ptr() == before, "alias": shared.copy(),
            "tensor": tensor.numpy().copy()}
