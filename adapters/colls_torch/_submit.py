"""Running one colls call the way torch runs one ProcessGroup call.

Every collective of colls_torch (and every method of the ``colls`` c10d backend) ends in
:func:`submit`: the colls call runs under :func:`~colls_torch._errors.backend_call` (so argument
errors colls finds are RuntimeErrors, as gloo's are, and colls errors are torch's) and, when it
hands colls CUDA tensors, on torch's current stream (:mod:`colls_torch._streams`); a
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
from colls_torch._streams import torch_stream_current
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
        after: a step to run once the call has succeeded and the staged tensors are copied
            back (unflattening a coalesced result). On CUDA tensors that colls moves itself it
            runs at once on torch's current stream, stream-ordered after the call, which then
            runs as a synchronous one: a step chained on another thread would not be.
    """
    device = staging.cuda_device
    if after is not None and device is not None:
        async_op, returned_work = False, async_op
    else:
        returned_work = async_op
    with backend_call(), torch_stream_current(device):
        inner = call(async_op)
        if inner is None and async_op:  # the process is not a member of the group
            return None
        if not async_op:
            staging.finish()
            if after is not None:
                after()
            return Work(colls.Work.completed(None), result) if returned_work else None
    return Work(finish_chain(inner, staging, after), result, cuda_device=device)


def finish_chain(inner: colls.Work, staging: Staging,
                 after: Callable[[], None] | None = None) -> colls.Work:
    """Return ``inner`` followed by the staging copy-back and ``after`` (if there is any)."""
    if after is None and not staging.staged:
        return inner

    def finish(value: Any) -> Any:
        staging.finish()
        if after is not None:
            after()
        return value

    return chain(inner, finish)


__all__ = ["Call", "finish_chain", "submit"]
