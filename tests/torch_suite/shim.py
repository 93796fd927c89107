"""The test-side shim that hands colls to the tests torch wrote for gloo.

torch's suite (``torch.testing._internal.distributed.distributed_test``) chooses its tests by the
environment variable ``BACKEND``: most CPU tests run only for ``"gloo"``. Run under the name
``"colls"`` it skips about two thirds of them. So the suite runs with ``BACKEND=gloo`` (the
tests written for gloo are selected), and :func:`install` makes every group those tests create a
``colls`` group instead: ``init_process_group``, ``new_group``, ``new_subgroups`` and
``new_subgroups_by_enumeration`` get ``backend="colls"`` where they were given ``"gloo"`` (or a
device map naming gloo). Nothing else is changed: the tests call torch.distributed as they
would on gloo, torch's default group is a ``ProcessGroupColls``, and ``get_backend()`` honestly
answers ``"colls"`` (the tests that check for the name ``"gloo"`` fail, and are listed in
:mod:`exclusions`). Only the processes the suite spawns install the shim (the module that
defines the test class does, when ``COLLS_TORCH_SUITE_BACKEND=colls``).
"""

from __future__ import annotations

import functools
from typing import Any

GLOO = "gloo"
COLLS = "colls"


def to_colls(backend: Any) -> Any:
    """Return ``backend`` with gloo replaced by colls ("gloo", Backend("gloo"), "cpu:gloo,...")."""
    if backend is None:
        return None
    name = str(backend)
    if name.lower() == GLOO:
        return COLLS
    if ":" in name:  # a device map such as "cpu:gloo,cuda:nccl"
        pairs = (entry.split(":", 1) for entry in name.split(","))
        return ",".join(f"{dev}:{COLLS if b.lower() == GLOO else b}" for dev, b in pairs)
    return backend


def _mapped(func: Any, position: int) -> Any:
    """Wrap ``func`` so its ``backend`` argument (keyword, or positional at ``position``) maps."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = to_colls(kwargs["backend"])
        elif len(args) > position:
            args = (*args[:position], to_colls(args[position]), *args[position + 1 :])
        return func(*args, **kwargs)

    wrapper.__colls_shim__ = True  # type: ignore[attr-defined]
    return wrapper


#: The functions that take a backend name, and the position of ``backend`` in their signature.
_BACKEND_ARGS = {
    "init_process_group": 0,
    "new_group": 2,
    "new_subgroups": 3,
    "new_subgroups_by_enumeration": 2,
}


def install() -> None:
    """Map gloo to colls in torch.distributed's group constructors (once per process).

    Both names are patched: ``torch.distributed.X`` (what the suite calls) and
    ``torch.distributed.distributed_c10d.X`` (what torch calls inside, e.g. ``new_subgroups``
    calling ``new_group``). ``import colls_torch`` registers the colls backend (the
    ``torch.backends`` entry point would too).
    """
    import colls_torch  # noqa: F401  (registers the "colls" c10d backend)
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name, position in _BACKEND_ARGS.items():
        original = getattr(c10d, name)
        if getattr(original, "__colls_shim__", False):
            continue
        wrapped = _mapped(original, position)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
