"""The host-only backend of the device-check tests, and their point-to-point ranks.

tcp moves CUDA arrays (it stages them through the host), so the core's refusal of a device a
backend does not serve is shown on ``hostonly``: the tcp backend declaring ``devices = ("cpu",)``,
as a third-party backend that moves only host memory would.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np

import colls
from colls import _dlpack_ctypes as dlc
from colls import plugin_manager
from colls.backend import BackendSpec
from colls.hookspecs import hookimpl
from colls.testing.arrays import CtypesDLPackArray
from colls_plugins.tcp.backend import TcpBackend

HOST_ONLY = "hostonly"


class HostOnlyBackend(TcpBackend):
    """The tcp backend, declaring that it moves host memory only."""

    devices = ("cpu",)


class HostOnlyPlugin:
    @hookimpl
    def colls_backends(self) -> list[BackendSpec]:
        return [BackendSpec(name=HOST_ONLY, devices=("cpu",), create=HostOnlyBackend)]


def register_host_only() -> None:
    """Make ``hostonly`` a backend name in this process (once)."""
    with contextlib.suppress(ValueError):  # already registered
        plugin_manager.register_plugin(HostOnlyPlugin(), name=HOST_ONLY)


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
