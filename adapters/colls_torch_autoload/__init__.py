"""Registers the ``colls`` backend with torch.distributed when torch is imported.

torch (2.5+) calls every ``torch.backends`` entry point at the end of ``import torch``
(switched off by ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). colls' entry point is :func:`register`:
it only tells torch.distributed that a backend named ``colls`` exists, with a creator that
imports colls_torch when a group of it is first made. So a program or a configuration file
(Lightning's ``process_group_backend: colls``) can name the backend without importing
colls_torch, and ``import torch`` pays for nothing else.

This package imports neither colls nor colls_torch at load time, and :func:`register` never
raises: a broken colls installation must not break ``import torch``. What went wrong is
reported as a warning here, and again, as an error, when a ``colls`` group is made.
"""

from __future__ import annotations

import warnings
from typing import Any

BACKEND_NAME = "colls"


def create(dist_backend_opts: Any, backend_options: Any) -> Any:
    """torch's creator for a ``colls`` group: colls_torch's, imported now."""
    from colls_torch._c10d import create as colls_create

    return colls_create(dist_backend_opts, backend_options)


def register() -> None:
    """Register the ``colls`` backend with torch.distributed, lazily; never raise."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or BACKEND_NAME in dist.Backend.backend_list:
            return
        dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True,
                                      devices=["cpu", "cuda"])
    except Exception as exc:  # noqa: BLE001 - import torch must survive any failure here
        warnings.warn(f"colls: the 'colls' torch.distributed backend was not registered: "
                      f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)


__all__ = ["BACKEND_NAME", "create", "register"]
