"""The point-to-point ranks of the device-check tests, on the ``hostonly`` backend.

tcp moves CUDA arrays (it stages them through the host), so the core's refusal of a device a
backend does not serve is shown on ``hostonly`` (:mod:`colls.testing.host_only`): the tcp backend
declaring ``devices = ("cpu",)``, as a third-party backend that moves only host memory would.
"""

from __future__ import annotations

import sys

import numpy as np

import colls
from colls import _dlpack_ctypes as dlc
from colls.testing.arrays import CtypesDLPackArray
from colls.testing.host_only import HOST_ONLY, register_host_only


def p2p_refusals(rank: int, world_size: int) -> list[str]:
    """Return the errors of every p2p call given a CUDA array, then prove the group still works.

    CuPy is blocked (``sys.modules["cupy"] = None``): the refusal must not need it.
    """
    sys.modules["cupy"] = None  # type: ignore[assignment]
    register_host_only()
    colls.init_process_group(HOST_ONLY)
    peer = 1 - rank
    host = np.arange(4, dtype=np.float32)
    cuda = CtypesDLPackArray(host, device_type=dlc.KDL_CUDA)
    calls = {
        "isend": lambda: colls.isend(cuda, dst=peer),
        "irecv": lambda: colls.irecv(cuda, src=peer),
        "send": lambda: colls.send(cuda, dst=peer),
        "recv": lambda: colls.recv(cuda, src=peer),
        "recv_any": lambda: colls.recv(cuda),
        "batch_isend_irecv": lambda: colls.batch_isend_irecv(
            [colls.P2POp(colls.isend, cuda, peer), colls.P2POp(colls.irecv, cuda, peer)]
        ),
    }
    messages = []
    for name, call in calls.items():
        try:
            call()
        except TypeError as exc:
            messages.append(f"{name}: {exc}")
        else:
            raise AssertionError(f"{name} accepted a CUDA array on {HOST_ONLY}")
    assert np.array_equal(host, np.arange(4, dtype=np.float32)), "a refused call wrote"
    # Nothing was sent: the next message between the two ranks is this one.
    value = np.full(3, 7.0 + rank)
    got = np.empty(3)
    if rank == 0:
        colls.send(value, dst=1)
        colls.recv(got, src=1)
    else:
        colls.recv(got, src=0)
        colls.send(value, dst=0)
    assert np.array_equal(got, np.full(3, 7.0 + peer)), got
    colls.destroy_process_group()
    return messages
