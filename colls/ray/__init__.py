"""colls as a ``ray.util.collective`` backend, named ``"colls"`` (extra ``colls[ray]``).

On the driver::

    import colls.ray
    colls.ray.create_collective_group(actors, group_name="default")

and in the actors, Ray's own calls (``ray.util.collective.allreduce(array)``, ...) run colls'
collectives. :func:`create_collective_group` registers the backend in the driver and in every
actor, creates the group's store actor (the rendezvous, through Ray: no MASTER_ADDR) and joins
every actor to the group at once, so a failure to join is raised here, not at the first
collective. The plain Ray way works too: :func:`register` in the driver and in each actor, then
``ray.util.collective.init_collective_group(..., backend="colls")`` in each actor.

Needs Ray >= 2.60 (``register_collective_backend``, an alpha API of Ray). See docs/ray.md.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

#: The first Ray release with ``ray.util.collective.register_collective_backend``.
MIN_RAY_VERSION = (2, 60)

try:
    import ray
except ImportError as _exc:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "colls.ray needs Ray (ray>=2.60): pip install -e '.[ray]' in a checkout of colls, or "
        "pip install 'ray>=2.60'") from _exc


#: The store actors this driver created, by group name: a non-detached actor lives while its
#: creator holds a handle, so the driver keeps one until destroy_collective_group.
_DRIVER_STORES: dict[str, Any] = {}


def _ray_version() -> tuple[int, ...]:
    parts = []
    for piece in ray.__version__.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _registry_function() -> Any:
    register_collective_backend: Any = None
    try:
        from ray.util.collective import register_collective_backend
    except ImportError:
        pass
    if register_collective_backend is None or _ray_version() < MIN_RAY_VERSION:
        wanted = ".".join(map(str, MIN_RAY_VERSION))
        raise RuntimeError(
            f"colls.ray needs Ray >= {wanted}, whose ray.util.collective has "
            f"register_collective_backend; Ray {ray.__version__} is installed: "
            f"pip install 'ray>={wanted}' (or pip install -e '.[ray]' in a checkout of colls)")
    return register_collective_backend


def register() -> None:
    """Register the ``"colls"`` backend with ``ray.util.collective`` in this process.

    Idempotent: a second call does nothing. Call it in the driver and in every actor (Ray's
    registry is per process); :func:`create_collective_group` does both for you.

    Raises:
        RuntimeError: Ray is older than 2.60 (the message names the version needed), or
            another class is registered as ``"colls"``.
    """
    register_backend = _registry_function()
    from ray.util.collective import is_backend_available

    from colls.ray._group import BACKEND_NAME, CollsGroup

    if is_backend_available(BACKEND_NAME):
        registered = _registered_class(BACKEND_NAME)
        if registered is not None and registered is not CollsGroup:
            raise RuntimeError(
                f"colls.ray: ray.util.collective already has a backend named {BACKEND_NAME!r}: "
                f"{registered.__module__}.{registered.__qualname__}")
        return
    register_backend(BACKEND_NAME, CollsGroup)


def _registered_class(name: str) -> Any:
    try:
        from ray.util.collective.backend_registry import _global_registry
    except ImportError:
        return None
    try:
        return _global_registry.get(name)
    except ValueError:
        return None


def _join(actor: Any, world_size: int, rank: int, group_name: str) -> None:
    """Run in each actor (``__ray_call__``): register the backend and join the group."""
    del actor
    register()
    from ray.util.collective import init_collective_group

    from colls.ray._group import BACKEND_NAME

    backend: Any = BACKEND_NAME  # Ray's annotation says Backend; its registry takes the name
    init_collective_group(world_size, rank, backend=backend, group_name=group_name)


def _leave(actor: Any, group_name: str) -> None:
    del actor
    from ray.util.collective import destroy_collective_group, is_group_initialized

    if is_group_initialized(group_name):
        destroy_collective_group(group_name)


def create_collective_group(
    actors: Sequence[Any],
    *,
    ranks: Sequence[int] | None = None,
    group_name: str = "default",
    timeout: float | datetime.timedelta | None = None,
    transport: str = "tcp",
) -> None:
    """Make ``actors`` a ``ray.util.collective`` group on colls (call it on the driver).

    Args:
        actors: the actor handles, one per rank.
        ranks: each actor's rank (a permutation of ``0..len(actors)-1``); default: list order.
        group_name: the ``group_name`` the actors pass to ``ray.util.collective``'s calls.
        timeout: seconds (or a timedelta) that every blocking call of the group may take;
            default ``COLLS_TIMEOUT`` (1800 s).
        transport: the colls backend underneath: ``"tcp"`` (shared memory within a node,
            sockets across nodes), ``"mpi"``, or a plugin's.

    Raises:
        ValueError: bad ranks, or a group of that name exists (its store actor does).
        RuntimeError: Ray older than 2.60.
        ray.exceptions.RayTaskError: an actor could not join (wrapping colls' error).
    """
    register()
    from colls.ray._group import colls_timeout_s
    from colls.ray._store import StoreServer, store_actor_name

    order = list(range(len(actors))) if ranks is None else list(ranks)
    if not actors:
        raise ValueError("colls.ray.create_collective_group: no actors given")
    if sorted(order) != list(range(len(actors))):
        raise ValueError(
            f"colls.ray.create_collective_group: ranks must be a permutation of "
            f"0..{len(actors) - 1} (one per actor), got {order}")
    seconds = (timeout.total_seconds() if isinstance(timeout, datetime.timedelta)
               else float(timeout) if timeout is not None else colls_timeout_s())
    if seconds <= 0:
        raise ValueError(f"colls.ray.create_collective_group: timeout must be > 0, got {timeout}")
    name = store_actor_name(group_name)
    try:
        ray.get_actor(name)
    except ValueError:
        pass
    else:
        raise ValueError(
            f"colls.ray.create_collective_group: group {group_name!r} exists (its store actor "
            f"{name!r} is alive); destroy_collective_group it first or pick another name")
    server = StoreServer.options(name=name).remote(
        {"timeout_s": seconds, "transport": transport, "owner": "driver"})
    ray.get(server.settings.remote())
    _DRIVER_STORES[group_name] = server
    ray.get([actor.__ray_call__.remote(_join, len(actors), rank, group_name)
             for actor, rank in zip(actors, order, strict=True)])


def destroy_collective_group(actors: Sequence[Any], group_name: str = "default") -> None:
    """Make every live actor leave ``group_name`` and end its store actor (on the driver).

    Actors that died are skipped: destroying the group of a failed job is how it is cleaned up.
    """
    from colls.ray._store import store_actor_name

    refs = [actor.__ray_call__.remote(_leave, group_name) for actor in actors]
    for ref in refs:
        try:
            ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            continue
    server = _DRIVER_STORES.pop(group_name, None)
    try:
        ray.kill(server if server is not None else ray.get_actor(store_actor_name(group_name)))
    except ValueError:
        pass


def __getattr__(name: str) -> Any:
    if name in ("CollsGroup", "PeerActorError", "BACKEND_NAME"):
        from colls.ray import _group

        return getattr(_group, name)
    if name == "RayStore":
        from colls.ray._store import RayStore

        return RayStore
    raise AttributeError(f"module 'colls.ray' has no attribute {name!r}")


__all__ = [
    "BACKEND_NAME",
    "MIN_RAY_VERSION",
    "CollsGroup",
    "PeerActorError",
    "RayStore",
    "create_collective_group",
    "destroy_collective_group",
    "register",
]
