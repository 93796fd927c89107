"""Tensor arguments: torch's type checks, and the hand-over of tensors to colls.

colls imports a CPU tensor through DLPack without copying (bfloat16 included). Two things need
care on the way in, and :class:`Staging` handles both:

* A tensor that requires grad (a ``Parameter``) cannot be exported through DLPack; torch's
  collectives accept it and write into its storage, so colls gets ``tensor.detach()``, which
  shares that storage.
* A CUDA tensor on a transport that only moves host memory (tcp, mpi) is staged: colls works on
  a host copy, and the results are copied back (``copy_``) when the operation completes, before
  its Work does. With a transport whose ``devices`` include "cuda" (mpi over a CUDA-aware
  MPI) the tensor is passed as is.

The checks raise what torch raises: TypeError for a non-tensor, ValueError for mixed dtypes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch


def check_single_tensor(param: Any, param_name: str) -> None:
    """Raise torch's TypeError unless ``param`` is a tensor."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(
            f"Invalid function argument. Expected parameter `{param_name}` of type torch.Tensor "
            f"but got {type(param)} instead."
        )


def check_tensor_list(param: Any, param_name: str) -> None:
    """Raise torch's TypeError unless ``param`` is a list of tensors."""
    if not isinstance(param, list):
        raise TypeError(
            f"Invalid function argument. Expected parameter `{param_name}` of type "
            f"List[torch.Tensor] but got {type(param)} instead."
        )
    if not all(isinstance(p, torch.Tensor) for p in param):
        raise TypeError(
            f"Invalid function argument. Expected parameter `{param_name}` of type "
            f"List[torch.Tensor] but got {type(param)} with elements of type "
            f"{[type(p) for p in param]}."
        )


def _flatten(items: Iterable[Any]) -> Iterable[torch.Tensor]:
    return itertools.chain.from_iterable(i if isinstance(i, list) else (i,) for i in items)


def ensure_same_dtype(*tensors: Any) -> None:
    """Raise torch's ValueError if the tensors (or lists of tensors) mix dtypes.

    As in torch, a complex tensor and its real element type count as the same.
    """
    last: torch.dtype | None = None
    for tensor in _flatten(tensors):
        dtype = tensor.dtype
        if dtype.is_complex:
            dtype = torch.float32 if dtype == torch.complex64 else torch.float64
        if last is None:
            last = dtype
        elif last != dtype:
            raise ValueError(
                f"Invalid usage of tensors with different dtypes: found {last} and {tensor.dtype}"
            )


#: Dtypes whose CPU tensors ``Tensor.numpy()`` shares as NumPy arrays of the same meaning (no
#: bfloat16 or float8: NumPy has none, so those go through DLPack and ml_dtypes).
_NUMPY_DTYPES = frozenset({
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
})


def shared_numpy(tensor: torch.Tensor) -> Any:
    """Return a NumPy array sharing ``tensor``'s memory when that is what colls would import.

    For a contiguous CPU tensor of a dtype in :data:`_NUMPY_DTYPES` (with no lazy conjugate or
    negative bit), ``Tensor.numpy()`` gives the array DLPack would, in about a microsecond
    instead of tens (torch's ``__dlpack__`` runs in Python), and a NumPy array takes the core's
    fast path. Anything else returns None and goes through :class:`Staging` and DLPack.
    """
    if (
        tensor.device.type != "cpu" or tensor.dtype not in _NUMPY_DTYPES
        or tensor.layout is not torch.strided or not tensor.is_contiguous()
        or tensor.is_conj() or tensor.is_neg()
    ):
        return None
    return (tensor.detach() if tensor.requires_grad else tensor).numpy()


class Staging:
    """Turn caller tensors into what colls moves; copy staged results back at the end.

    Args:
        devices: the devices the colls backend moves ("cpu", "cuda"); CUDA tensors are staged
            through host memory unless "cuda" is among them.
    """

    def __init__(self, devices: tuple[str, ...] | list[str]) -> None:
        self._cuda_native = "cuda" in devices
        self._copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: The device of a CUDA tensor handed to colls as it is (None: none was). The call and
        #: its ``wait()`` then run on torch's current stream there (:mod:`colls_torch._streams`).
        self.cuda_device: torch.device | None = None

    def _plain(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_conj():  # torch's collectives view complex tensors as real first
            torch.view_as_real(tensor)  # raises the RuntimeError they raise for a lazy conjugate
        return tensor.detach() if tensor.requires_grad else tensor

    def _needs_host(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type == "cpu":
            return False
        if tensor.device.type == "cuda" and self._cuda_native:
            self.cuda_device = tensor.device
            return False
        return True

    def source(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return what colls reads for an input-only tensor."""
        tensor = self._plain(tensor)
        return tensor.cpu() if self._needs_host(tensor) else tensor

    def target(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return what colls writes for an output (or in-place) tensor; copied back at finish."""
        tensor = self._plain(tensor)
        if not self._needs_host(tensor):
            return tensor
        host = tensor.cpu()
        self._copy_back.append((tensor, host))
        return host

    def sources(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Apply :meth:`source` to each tensor."""
        return [self.source(t) for t in tensors]

    def targets(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Apply :meth:`target` to each tensor."""
        return [self.target(t) for t in tensors]

    @property
    def staged(self) -> bool:
        """Whether anything must be copied back."""
        return bool(self._copy_back)

    def finish(self) -> None:
        """Copy staged results into the caller's tensors."""
        for device_tensor, host in self._copy_back:
            device_tensor.copy_(host)


__all__ = ["Staging", "check_single_tensor", "check_tensor_list", "ensure_same_dtype"]
