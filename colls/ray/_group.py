"""The ``colls`` backend of ``ray.util.collective``: :class:`CollsGroup`, a ``BaseGroup``.

Ray's group manager builds a group in each actor as ``CollsGroup(world_size, rank, group_name)``
and calls its methods with Ray's conventions: every array argument wrapped in a list (one array
per device; longer lists are the ``*_multigpu`` forms), the settings in Ray's options objects
(``AllReduceOptions.reduceOp``, ``BroadcastOptions.root_rank``, ...). Each method unwraps them
and runs colls' own collective on colls' world: the tcp backend by default (shared memory
between actors on one node, sockets across nodes) or any colls backend named in the group's
settings. Arrays are anything colls takes (NumPy, torch, CuPy, ...), in place.

One colls group per actor process: the group is colls' world in that process
(:func:`colls.init_process_group` over a :class:`~colls.ray._store.RayStore`), so an actor is in
at most one ``colls`` group at a time; destroy it before joining another.

A failure of a collective (a peer that died, a timeout) raises :class:`PeerActorError`, whose
message names the actors Ray reports dead, with their rank, class, actor id, pid and node.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import ray
import ray.exceptions
from ray.util.collective.collective_group.base_collective_group import BaseGroup
from ray.util.collective.types import ReduceOp as RayReduceOp

import colls
from colls import BackendError, CollsError
from colls.ray._store import RayStore, store_actor_name

#: The name the backend is registered under (Ray upper-cases it: ``Backend.COLLS``).
BACKEND_NAME = "colls"
#: Ray's reduce ops, as colls'.
REDUCE_OPS = {
    RayReduceOp.SUM: colls.ReduceOp.SUM,
    RayReduceOp.PRODUCT: colls.ReduceOp.PRODUCT,
    RayReduceOp.MIN: colls.ReduceOp.MIN,
    RayReduceOp.MAX: colls.ReduceOp.MAX,
}
#: Seconds a failed rank gives Ray to say which peer actors died before it raises.
DEATH_PROBE_S = 5.0
#: Seconds it still listens once one peer is known dead (two may have died together).
DEATH_GRACE_S = 0.5
#: Counter of the ranks that left a group whose store actor no driver owns.
LEFT_KEY = "colls.ray/left"


class PeerActorError(BackendError):
    """A collective of a Ray ``colls`` group failed; the message names the dead peer actors.

    Attributes:
        dead_ranks: the group ranks whose actors Ray reports dead (empty when none is).
    """

    def __init__(self, message: str, dead_ranks: list[int]) -> None:
        super().__init__(message)
        self.dead_ranks = dead_ranks


def _store_server(group_name: str) -> Any:
    """Return the handle of the group's store actor, created here if the driver did not."""
    from colls.ray._store import StoreServer

    name = store_actor_name(group_name)
    # init_collective_group in each actor, without colls.ray.create_collective_group: the first
    # rank to get here creates the store (detached: it must outlive whichever rank made it).
    return StoreServer.options(name=name, get_if_exists=True, lifetime="detached").remote({})


def _describe(member: dict[str, Any]) -> str:
    return (f"actor {member.get('class', '?')} {member.get('actor_id', '?')} (pid "
            f"{member.get('pid', '?')} on node {member.get('node', '?')})")


class CollsGroup(BaseGroup):
    """A ``ray.util.collective`` group whose collectives are colls' (backend ``"colls"``)."""

    def __init__(self, world_size: int, rank: int, group_name: str) -> None:
        super().__init__(world_size, rank, group_name)
        if colls.is_initialized():
            raise RuntimeError(
                f"colls.ray: cannot join group {group_name!r} as rank {rank}: this actor "
                f"(pid {os.getpid()}) is already in a colls group (colls' world, rank "
                f"{colls.get_rank()} of {colls.get_world_size()}); a process is in one colls "
                "group at a time: destroy_collective_group() the other first")
        self._server = _store_server(group_name)
        self._store = RayStore(self._server, store_actor_name(group_name))
        settings = self._store.settings
        timeout = float(settings.get("timeout_s") or colls_timeout_s())
        self._store.set_timeout(timeout)
        self._store.join(rank, _this_member())
        colls.init_process_group(
            backend=settings.get("transport") or "tcp", store=self._store, rank=rank,
            world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        self._members: dict[int, dict[str, Any]] | None = None

    # -- Ray's class methods ----------------------------------------------------------------
    @classmethod
    def backend(cls) -> str:
        """Return ``"COLLS"``, the name Ray's registry knows this backend by."""
        return BACKEND_NAME.upper()

    @classmethod
    def check_backend_availability(cls) -> bool:
        """Return True: colls needs nothing beyond NumPy (its other backends say what they lack)."""
        return True

    def destroy_group(self) -> None:
        """Leave colls' world (Ray's destroy_collective_group).

        A store actor that a rank created (no driver helper) is detached: the last rank to
        leave ends it.
        """
        if colls.is_initialized():
            colls.destroy_process_group()
        if self._store.settings.get("owner") == "driver":
            return
        try:
            left = ray.get(self._server.add.remote(LEFT_KEY, 1, "colls.ray"))
            if int(left) >= self._world_size:
                ray.kill(self._server)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            pass

    # -- failures ---------------------------------------------------------------------------
    def _run(self, op: str, call: Callable[[], Any]) -> None:
        try:
            call()
        except CollsError as exc:
            raise self._peer_error(op, exc) from exc

    def _peer_error(self, op: str, exc: CollsError) -> PeerActorError:
        """Return the error of a failed ``op``: which peers Ray reports dead, then colls' reason."""
        members = self._peer_members()
        dead = _dead_ranks({r: m for r, m in members.items() if r != self._rank})
        where = f"colls.ray: {op} in group {self._group_name!r} failed on rank {self._rank}"
        if dead:
            names = "; ".join(f"rank {r}: {_describe(members[r])}" for r in dead)
            return PeerActorError(f"{where}: the actor of {names} died. {exc}", dead)
        return PeerActorError(f"{where}: {exc}", [])

    def _peer_members(self) -> dict[int, dict[str, Any]]:
        if self._members is None:
            try:
                self._members = self._store.members(self._world_size, DEATH_PROBE_S)
            except CollsError:
                return {}
        return self._members

    # -- collectives --------------------------------------------------------------------------
    def allreduce(self, tensors: list[Any], allreduce_options: Any = None) -> None:
        """Reduce ``tensors`` (a list of one array, or one per device) across the group."""
        op, tensors = _reduce_op(allreduce_options), _arrays(tensors, "allreduce")
        if len(tensors) == 1:
            self._run("allreduce", lambda: colls.all_reduce(tensors[0], op=op))
        else:
            self._run("allreduce", lambda: colls.all_reduce_multigpu(tensors, op=op))

    def barrier(self, barrier_options: Any = None) -> None:
        """Wait until every rank of the group got here."""
        self._run("barrier", colls.barrier)

    def reduce(self, tensors: list[Any], reduce_options: Any = None) -> None:
        """Reduce into ``tensors[root_tensor]`` of ``root_rank``; other ranks' arrays unchanged."""
        op, root = _reduce_op(reduce_options), _option(reduce_options, "root_rank", 0)
        tensors = _arrays(tensors, "reduce")
        if len(tensors) == 1:
            self._run("reduce", lambda: colls.reduce(tensors[0], dst=root, op=op))
        else:
            index = _option(reduce_options, "root_tensor", 0)
            self._run("reduce", lambda: colls.reduce_multigpu(tensors, dst=root, op=op,
                                                              dst_tensor=index))

    def broadcast(self, tensors: list[Any], broadcast_options: Any = None) -> None:
        """Copy ``root_rank``'s array into every rank's."""
        root, tensors = _option(broadcast_options, "root_rank", 0), _arrays(tensors, "broadcast")
        if len(tensors) == 1:
            self._run("broadcast", lambda: colls.broadcast(tensors[0], src=root))
        else:
            index = _option(broadcast_options, "root_tensor", 0)
            self._run("broadcast", lambda: colls.broadcast_multigpu(tensors, src=root,
                                                                    src_tensor=index))

    def allgather(self, tensor_lists: list[list[Any]], tensors: list[Any],
                  allgather_options: Any = None) -> None:
        """Fill ``tensor_lists[0]`` with every rank's ``tensors[0]``, in rank order."""
        tensors = _arrays(tensors, "allgather")
        tensor_lists = [_arrays(outputs, "allgather") for outputs in tensor_lists]
        if len(tensors) == 1:
            self._run("allgather", lambda: colls.all_gather(tensor_lists[0], tensors[0]))
        else:
            self._run("allgather", lambda: colls.all_gather_multigpu(tensor_lists, tensors))

    def reducescatter(self, tensors: list[Any], tensor_lists: list[list[Any]],
                      reducescatter_options: Any = None) -> None:
        """Reduce ``tensor_lists[0][r]`` over the group into rank r's ``tensors[0]``."""
        op, tensors = _reduce_op(reducescatter_options), _arrays(tensors, "reducescatter")
        tensor_lists = [_arrays(inputs, "reducescatter") for inputs in tensor_lists]
        if len(tensors) == 1:
            self._run("reducescatter",
                      lambda: colls.reduce_scatter(tensors[0], tensor_lists[0], op=op))
        else:
            self._run("reducescatter",
                      lambda: colls.reduce_scatter_multigpu(tensors, tensor_lists, op=op))

    def send(self, tensors: list[Any], send_options: Any) -> None:
        """Send ``tensors[0]`` (its first ``n_elements`` when that is > 0) to ``dst_rank``."""
        dst = _option(send_options, "dst_rank", 0)
        tensor = _first_elements(_arrays(tensors, "send")[0], send_options)
        self._run("send", lambda: colls.send(tensor, dst=dst))

    def recv(self, tensors: list[Any], recv_options: Any) -> None:
        """Receive ``src_rank``'s message into ``tensors[0]`` (its first ``n_elements``)."""
        src = _option(recv_options, "src_rank", 0)
        tensor = _first_elements(_arrays(tensors, "recv")[0], recv_options)
        self._run("recv", lambda: colls.recv(tensor, src=src))


# -- helpers ---------------------------------------------------------------------------------
def colls_timeout_s() -> float:
    """Return colls' default timeout (``COLLS_TIMEOUT``) in seconds."""
    from colls import env  # the one module that reads COLLS_* variables

    return float(env.get("COLLS_TIMEOUT"))


def _this_member() -> dict[str, Any]:
    context = ray.get_runtime_context()
    actor_id = context.get_actor_id()
    handle = context.current_actor if actor_id else None
    name = getattr(handle, "_ray_actor_creation_function_descriptor", None)
    return {
        "handle": handle,
        "actor_id": actor_id,
        "class": getattr(name, "class_name", None) or "?",
        "pid": os.getpid(),
        "node": ray.util.get_node_ip_address(),
    }


def _dead_ranks(members: dict[int, dict[str, Any]]) -> list[int]:
    """Return the ranks among ``members`` whose actors Ray reports dead within DEATH_PROBE_S."""
    probes = {}
    for rank, member in members.items():
        handle = member.get("handle")
        if handle is not None:
            probes[rank] = handle.__ray_ready__.remote()
    dead: list[int] = []
    start = time.monotonic()
    deadline = start + DEATH_PROBE_S
    while probes and time.monotonic() < deadline:
        # A live peer busy in a method answers only when it is done: never wait for all.
        ready, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=0.1)
        for rank in [r for r, ref in probes.items() if ref in ready]:
            try:
                ray.get(probes.pop(rank), timeout=0)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                dead.append(rank)
            except Exception:  # noqa: BLE001 - a probe failing otherwise says nothing of death
                continue
        if dead:  # others that died at the same moment are known by now, or soon
            deadline = min(deadline, time.monotonic() + DEATH_GRACE_S)
    return sorted(dead)


def _arrays(tensors: Any, op: str) -> list[Any]:
    """Return Ray's list of arrays, torch CPU tensors as NumPy views of the same memory."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise TypeError(
            f"colls.ray: {op} takes a non-empty list of arrays (ray.util.collective wraps the "
            f"array in a list), got {type(tensors).__name__}")
    return [_host_view(t) for t in tensors]


def _host_view(array: Any) -> Any:
    """Return a torch CPU tensor as a NumPy view of its memory (else ``array`` unchanged).

    colls takes torch tensors through DLPack, which costs about 0.1 ms a call; Ray's small
    messages are latency-bound, and ``Tensor.numpy()`` shares the memory for a fraction of that.
    bfloat16 (no NumPy dtype) and other devices keep the DLPack path.
    """
    if type(array).__module__.partition(".")[0] != "torch":
        return array
    import torch

    if array.device.type != "cpu" or array.dtype is torch.bfloat16 or array.is_conj():
        return array
    return array.detach().numpy()


def _option(options: Any, name: str, default: Any) -> Any:
    return default if options is None else getattr(options, name, default)


def _reduce_op(options: Any) -> Any:
    op = _option(options, "reduceOp", RayReduceOp.SUM)
    try:
        return REDUCE_OPS[op]
    except (KeyError, TypeError):
        raise ValueError(
            f"colls.ray: unknown reduce op {op!r}; ray.util.collective.ReduceOp has "
            f"{', '.join(o.name for o in REDUCE_OPS)}") from None


def _first_elements(tensor: Any, options: Any) -> Any:
    """Return ``tensor``, or a flat view of its first ``n_elements`` (Ray's send/recv option)."""
    count = int(_option(options, "n_elements", 0) or 0)
    if count <= 0:
        return tensor
    flat = tensor.reshape(-1)
    if count > flat.shape[0]:
        raise ValueError(f"colls.ray: n_elements={count} but the array has {flat.shape[0]}")
    return flat[:count]


__all__ = ["BACKEND_NAME", "CollsGroup", "PeerActorError"]
