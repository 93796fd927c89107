"""Running one colls call the way torch runs one ProcessGroup call.

Every collective of colls_torch (and every method of the ``colls`` c10d backend) ends in
:func:`submit`: the colls call runs under :func:`~colls_torch._errors.backend_call` (so argument
errors colls finds are RuntimeErrors, as gloo's are, and colls errors are torch's); a
synchronous call copies staged CUDA results back and returns None; an asynchronous one returns a
:class:`~colls_torch._work.Work` whose inner colls Work copies them back before it completes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import colls
from colls.work import chain
from colls_torch._errors import backend_call
from colls_torch._tensors import Staging
from colls_torch._work import Work

#: A colls call, given ``async_op``: returns a colls Work (async) or None.
Call = Callable[[bool], Any]


def submit(staging: Staging, call: Call, result: list[torch.Tensor], async_op: bool,
           after: Callable[[], None] | None = None) -> Work | None:
    """Run ``call`` and return what torch returns: None, or a Work when ``async_op``.

    Args:
        staging: the staged CUDA tensors of the call (copied back at the end).
        call: the colls call.
        result: the output tensors (``Work.result()`` and the Work's future value).
        async_op: torch's flag.
        after: a step to run once the call has succeeded (unflattening a coalesced result),
            before the staged tensors are copied back.
    """
    with backend_call():
        inner = call(async_op)
    if inner is None and async_op:  # the process is not a member of the group
        return None
    if not async_op:
        if after is not None:
            after()
        staging.finish()
        return None
    return Work(finish_chain(inner, staging, after), result)


def finish_chain(inner: colls.Work, staging: Staging,
                 after: Callable[[], None] | None = None) -> colls.Work:
    """Return ``inner`` followed by ``after`` and the staging copy-back (if there is any)."""
    if after is None and not staging.staged:
        return inner

    def finish(value: Any) -> Any:
        if after is not None:
            after()
        return staging.finish(value)

    return chain(inner, finish)


__all__ = ["Call", "finish_chain", "submit"]
