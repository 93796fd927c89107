"""The rendezvous of a Ray group: colls' :class:`~colls.Store` served by a named Ray actor.

Ray already connects every actor of a job, so a colls group in Ray needs no MASTER_ADDR: one
asyncio actor per group (:class:`StoreServer`, named ``colls-store/<group>``) holds the keys, and
each rank's :class:`RayStore` calls it. Blocking reads (``get``, ``wait``) park on the server's
condition, not in a polling loop, so colls' failure watcher costs one pending call per rank.

The server also holds what a rank's error messages need about its peers (each rank's actor
handle, class, id, pid and node: :meth:`StoreServer.join`), the group's settings (timeout,
transport) and a random auth token, so the group's sockets let in only its own actors.

Ray failures become colls' errors at one boundary (:meth:`RayStore._call`): the server's death is
a :class:`~colls.NetworkError` (the store's host is gone, as a TCPStore's), Ray's timeout a
:class:`~colls.StoreTimeoutError` naming the keys.
"""

from __future__ import annotations

import asyncio
import datetime
import secrets
import time
from typing import Any

import ray
import ray.exceptions

from colls.errors import NetworkError, StoreError
from colls.store import DEFAULT_TIMEOUT, Store
from colls.store.base import INTERNAL_KEY_PREFIX, parse_counter, timeout_error

#: Name of a group's store actor (in the job's Ray namespace).
STORE_ACTOR_PREFIX = "colls-store/"
#: Bytes of the group's auth token (256 bits, as colls-run's).
TOKEN_BYTES = 32
#: Seconds a client waits beyond a blocking call's own timeout for Ray to bring the answer back.
RAY_MARGIN_S = 30.0


def store_actor_name(group_name: str) -> str:
    """Return the name of ``group_name``'s store actor."""
    return STORE_ACTOR_PREFIX + group_name


class _StoreServer:
    """colls' Store operations on a dict, served by one asyncio actor per group.

    No CPU is reserved (it waits, it does not compute), and up to 1000 calls run at once: the
    parked ``get``/``wait`` of every rank's failure watcher, with room for the rest.
    """

    def __init__(self, settings: dict[str, Any]) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = asyncio.Condition()
        self._settings = dict(settings)
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._members: dict[int, dict[str, Any]] = {}

    # -- group metadata ---------------------------------------------------------------------
    async def settings(self) -> tuple[dict[str, Any], bytes, str]:
        """Return the group's settings, its auth token and this actor's node address."""
        return self._settings, self._token, ray.util.get_node_ip_address()

    async def join(self, rank: int, member: dict[str, Any]) -> None:
        """Record what names ``rank`` (its actor handle, class, id, pid, node)."""
        async with self._changed:
            self._members[rank] = member
            self._changed.notify_all()

    async def members(self, world_size: int, timeout: float) -> dict[int, dict[str, Any]]:
        """Return every rank's record once ``world_size`` ranks joined (or what joined by then)."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: len(self._members) >= world_size), timeout)
            except asyncio.TimeoutError:
                pass
            return dict(self._members)

    # -- the Store primitives ---------------------------------------------------------------
    async def set(self, key: str, value: bytes) -> None:
        async with self._changed:
            self._data[key] = value
            self._changed.notify_all()

    async def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        async with self._changed:
            self._data.update(zip(keys, values, strict=True))
            self._changed.notify_all()

    async def wait(self, keys: list[str], timeout: float | None) -> bool:
        """Return whether every key was set within ``timeout`` seconds (None: no limit)."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: all(k in self._data for k in keys)), timeout)
            except asyncio.TimeoutError:
                return False
            return True

    async def multi_get(self, keys: list[str], timeout: float | None) -> list[bytes] | None:
        """Return the values of ``keys`` once all are set, or None past ``timeout``."""
        if not await self.wait(keys, timeout):
            return None
        return [self._data[k] for k in keys]

    async def add(self, key: str, amount: int, description: str) -> int:
        async with self._changed:
            value = parse_counter(description, key, self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        async with self._changed:
            current = self._data.get(key)
            if (current is None and expected == b"") or current == expected:
                self._data[key] = desired
                self._changed.notify_all()
                return desired
            return expected if current is None else current

    async def check(self, keys: list[str]) -> bool:
        return all(k in self._data for k in keys)

    async def missing(self, keys: list[str]) -> list[str]:
        return [k for k in keys if k not in self._data]

    async def delete_keys(self, keys: list[str]) -> int:
        async with self._changed:
            return sum(self._data.pop(k, None) is not None for k in keys)

    async def num_keys(self) -> int:
        return sum(not k.startswith(INTERNAL_KEY_PREFIX) for k in self._data)


_remote: Any = ray.remote
#: The store actor class (``StoreServer.options(name=...).remote(settings)``).
StoreServer: Any = _remote(num_cpus=0, max_concurrency=1000)(_StoreServer)


class RayStore(Store):
    """A colls :class:`~colls.Store` whose keys live in a group's :class:`StoreServer` actor.

    Args:
        server: the store actor's handle.
        name: how errors name the store (the actor's name).
        timeout: default timeout of blocking calls.

    The attributes the tcp backend reads from a job's store: ``host`` (the store actor's node,
    so that a rank advertises the address it reaches that node from), ``auth_token`` (the
    group's, so only its actors get into its mesh) and ``hosted_by`` (named when the store is
    lost).
    """

    def __init__(self, server: Any, name: str,
                 timeout: float | datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self._server = server
        self._name = name
        self.hosted_by = f"the Ray actor {name!r}"
        self.settings, self.auth_token, self.host = self._call(
            "settings", self._server.settings.remote(), None)
        self.port: int | None = None

    @property
    def description(self) -> str:
        """Return ``RayStore 'colls-store/<group>'``."""
        return f"RayStore {self._name!r}"

    def _call(self, op: str, ref: Any, timeout: float | None) -> Any:
        limit = None if timeout is None else timeout + RAY_MARGIN_S
        try:
            return ray.get(ref, timeout=limit)
        except ray.exceptions.GetTimeoutError:
            raise StoreError(
                f"{self.description}: {op} got no answer from the store actor within "
                f"{limit:.0f} s") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise NetworkError(
                f"{self.description}: {op} failed: the store actor is gone ({type(exc).__name__}"
                f": {str(exc).splitlines()[0] if str(exc) else ''})") from exc

    def _set(self, key: str, value: bytes) -> None:
        self._call("set", self._server.set.remote(key, value), None)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._call("multi_set", self._server.multi_set.remote(keys, values), None)

    def _get(self, key: str, timeout: float | None) -> bytes:
        return self._multi_get_named("get", [key], timeout)[0]

    def _multi_get(self, keys: list[str], timeout: float | None) -> list[bytes]:
        return self._multi_get_named("multi_get", keys, timeout)

    def _multi_get_named(self, op: str, keys: list[str], timeout: float | None) -> list[bytes]:
        start = time.monotonic()
        values = self._call(op, self._server.multi_get.remote(keys, timeout), timeout)
        if values is None:
            missing = self._call(op, self._server.missing.remote(keys), None)
            raise timeout_error(self.description, op, missing or keys,
                                time.monotonic() - start, timeout)
        return list(values)

    def _wait(self, keys: list[str], timeout: float | None) -> None:
        start = time.monotonic()
        if not self._call("wait", self._server.wait.remote(keys, timeout), timeout):
            missing = self._call("wait", self._server.missing.remote(keys), None)
            raise timeout_error(self.description, "wait", missing or keys,
                                time.monotonic() - start, timeout)

    def _add(self, key: str, amount: int) -> int:
        return int(self._call("add", self._server.add.remote(key, amount, self.description),
                              None))

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return bytes(self._call("compare_set",
                                self._server.compare_set.remote(key, expected, desired), None))

    def _check(self, keys: list[str]) -> bool:
        return bool(self._call("check", self._server.check.remote(keys), None))

    def _delete_key(self, key: str) -> bool:
        return self._delete_keys([key]) == 1

    def _delete_keys(self, keys: list[str]) -> int:
        return int(self._call("delete_keys", self._server.delete_keys.remote(keys), None))

    def _num_keys(self) -> int:
        return int(self._call("num_keys", self._server.num_keys.remote(), None))

    # -- group metadata ---------------------------------------------------------------------
    def join(self, rank: int, member: dict[str, Any]) -> None:
        """Publish what names this rank to the group's peers."""
        self._call("join", self._server.join.remote(rank, member), None)

    def members(self, world_size: int, timeout: float) -> dict[int, dict[str, Any]]:
        """Return every rank's record (waiting at most ``timeout`` s for all to join)."""
        return dict(self._call("members", self._server.members.remote(world_size, timeout),
                               timeout))


__all__ = ["RayStore", "StoreServer", "store_actor_name"]
