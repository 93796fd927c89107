"""Going on after ranks die: shrink a group to its survivors, grow it back with newcomers.

A rank that sees peers die raises :class:`~colls.errors.PeerFailedError` (``failed_ranks``: the
ones it knows of). Survivors then call :func:`shrink_group`; replacements started with
``COLLS_JOIN=1`` (colls-run ``--on-failure replace``) call ``init_process_group`` and wait until
the members call :func:`grow_group`. Both agree through the job's store (:mod:`colls.agreement`),
which must outlive the ranks: colls-run's launcher store.

**Shrink**, in rounds until one succeeds. Each survivor checks in; a decision is written once
every member of the round has checked in or is known dead (seen by this rank's group health,
recorded by another rank, or exited according to colls-run), or at the group's timeout: the
survivors are those checked in, in the old order, renumbered from 0. Each then builds its part
of a fresh backend over a new store prefix (the same plugin, so tcp ranks of one host share
memory again) and commits; a member that dies before the commit sends everyone to the next
round, without it. A backend with a ``shrink`` hook (mpi: ULFM) does all this itself.

**Grow** (the default group only), at a point of the program where every member calls it:
the members agree on the tickets that joiners took from the store since the last grow, and, if
there are any, build a group where members keep their ranks and joiners get the next ones in
ticket order. Group rank 0 (a member before) is the agreed source of state
(``ProcessGroup.joined_ranks`` says who is new). A joiner that dies on the way is left out and
the members keep the group they had.

Shrinking or growing the default group renumbers the world: the result becomes the default
group, every other group is invalidated (as in torch's ``shrink_group``), and the world's
generation goes up by one, so that failure records of the old world never break the new one.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import time
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

from colls import agreement, plugin_manager
from colls import dispatch as d
from colls.agreement import KEY_ROOT, Build, CommitFailed, Liveness, RankSet
from colls.errors import (
    BackendError,
    CollsTimeoutError,
    NetworkError,
    PeerFailedError,
    StoreTimeoutError,
)
from colls.lifecycle import WORLD_GROUP_NAME
from colls.options import BackendOptions
from colls.process_group import ProcessGroup
from colls.registry import REGISTRY
from colls.store import PrefixStore
from colls.store.base import Store

logger = logging.getLogger("colls.resize")

#: Counter of the tickets joiners take, and the root of each ticket's keys.
JOIN_TICKETS = KEY_ROOT + "join/tickets"
JOIN_ROOT = KEY_ROOT + "join/"
#: Read-only short wait when collecting the registered processes of a group.
PROCESSES_WAIT_S = 0.5


# -- shrink ------------------------------------------------------------------------------------


def shrink_group(ranks_to_exclude: Sequence[int] | None = None, group: Any = None
                 ) -> ProcessGroup:
    """Return a new group of the survivors of ``group`` (default: the default group).

    Only survivors call it. They keep their order and are renumbered from 0. Shrinking the
    default group makes the result the new default group and invalidates every other group.
    The old group's resources are released by abort: nothing waits on the dead.

    Args:
        ranks_to_exclude: group ranks to leave out, the same list on every caller (torch's
            meaning); None leaves out the ranks the survivors agree are dead (colls').
        group: the group to shrink; None or ``group.WORLD`` for the default group.

    Raises:
        ValueError: ``ranks_to_exclude`` is empty, out of range, repeats a rank, names the
            caller, or leaves nobody; or the callers passed different lists.
        PeerFailedError: a rank not in ``ranks_to_exclude`` is dead too.
        BackendError: this rank was left out by the agreement (it came too late), or the job's
            store cannot be reached (it must outlive the ranks), or the group's backend neither
            declares ``BackendSpec.shrink`` nor has a ``shrink`` hook.
    """
    pg = _member(group, "shrink_group")
    explicit = _check_exclusions(ranks_to_exclude, pg, _where("shrink_group"))
    hook = getattr(pg.backend, "shrink", None)
    if callable(hook):
        backend, dropped = hook(explicit, _options(pg, _successor_name(pg), pg.timeout))
        survivors = [r for r in range(pg.size) if r not in set(dropped)]
        return _install(pg, survivors, backend, pg.store, joined=())
    _check_resizable(pg, "shrink_group")
    store = _job_store("shrink_group")
    try:
        survivors, backend, group_store = _shrink_through_store(pg, store, explicit)
    except (NetworkError, OSError) as exc:
        raise agreement.store_failure(exc, store) from exc
    return _install(pg, survivors, backend, group_store, joined=())


def _check_resizable(pg: ProcessGroup, caller: str) -> None:
    """Refuse a group whose backend does not declare that the core may rebuild it."""
    spec = plugin_manager.resolve_backend(pg.backend_name)
    if not spec.shrink:
        raise BackendError(
            f"{caller}: backend {spec.name!r} (plugin {spec.plugin or '?'!r}) of group "
            f"{pg.name!r} does not support shrinking or growing: its BackendSpec does not "
            "declare shrink=True and its backend has no shrink hook (see docs/plugins.md, "
            "'Shrinking and growing')"
        )


def _shrink_through_store(pg: ProcessGroup, store: Store, explicit: list[int] | None
                          ) -> tuple[list[int], Any, Store]:
    """Agree on the survivors and build their backend, round after round (module docstring)."""
    root = f"{KEY_ROOT}world{pg.generation}/{pg.name}/shrink"
    processes = _processes_of(pg, store)
    liveness = Liveness(store, processes)
    candidates = list(range(pg.size))
    suspects: set[int] = set()
    for round_no in itertools.count():
        if round_no > pg.size + 1:
            raise BackendError(f"shrink_group of group {pg.name!r}: no round succeeded")
        key = f"{root}/{round_no}"
        deadline = time.monotonic() + pg.timeout
        survivors = _agree_on_survivors(store, key, pg, candidates, explicit, suspects,
                                        liveness, deadline)
        if pg.rank not in survivors:
            raise BackendError(
                f"colls: shrink_group of group {pg.name!r}: group rank {pg.rank} was left out "
                f"by the survivors' agreement (round {round_no}: it checked in after the "
                "decision, or was cut off from the store); this process must stop"
            )
        try:
            # The build has a timeout of its own: a decision taken at the round's deadline (the
            # absent were cut off, not seen dead) would leave no time to commit, and the first
            # member to look would drop the others as late.
            backend, group_store = _build_survivors(pg, store, key, survivors, processes,
                                                    time.monotonic() + pg.timeout)
        except CommitFailed as failure:
            logger.warning("colls: shrink_group round %d of group %r failed: %s", round_no,
                           pg.name, failure.reason)
            suspects |= {survivors[i] for i in failure.missing}
            candidates = survivors
            continue
        return survivors, backend, group_store
    raise AssertionError("unreachable")


def _build_survivors(pg: ProcessGroup, store: Store, key: str, survivors: list[int],
                     processes: Callable[[], dict[int, str]], deadline: float
                     ) -> tuple[Any, Store]:
    """Build and commit this survivor's part of the round's group (raises CommitFailed)."""
    new_rank = survivors.index(pg.rank)
    if pg is REGISTRY.default:
        agreement.register_process(store, pg.generation + 1, new_rank)
    options = _options(pg, _successor_name(pg), pg.timeout,
                       [_world_rank_after(pg, survivors, i) for i in range(len(survivors))])
    group_store = PrefixStore(f"{key}/group", store)
    spec = plugin_manager.resolve_backend(pg.backend_name)
    build = Build(lambda: spec.create(group_store, new_rank, len(survivors), options))
    members = Liveness(store, lambda: {i: processes()[r] for i, r in enumerate(survivors)
                                       if r in processes()})

    def describe(i: int) -> str:
        return f"group rank {survivors[i]} (world rank {pg.global_rank(survivors[i])})"

    backend = agreement.commit(store, f"{key}/commit", new_rank, len(survivors), build,
                               members, deadline, describe)
    return backend, group_store


def _agree_on_survivors(store: Store, key: str, pg: ProcessGroup, candidates: list[int],
                        explicit: list[int] | None, suspects: set[int], liveness: Liveness,
                        deadline: float) -> list[int]:
    """Check in and return the round's decision: the sorted group ranks that go on."""
    dead = _DeadRanks(store, key, pg, suspects, liveness)
    dead.publish()
    checked_in = RankSet(store, f"{key}/in", pg.size)
    checked_in.add(pg.rank)
    decision_key = f"{key}/decision"
    while True:
        decision = agreement.read_decision(store, decision_key)
        if decision is None:
            dead.publish()
            proposal = _proposal(set(candidates), checked_in.read(), explicit, dead, deadline)
            if proposal is not None:
                decision = agreement.decide(store, decision_key, proposal)
        if decision is not None:
            return _survivors_of(decision, pg, explicit)
        agreement.wait_for(store, decision_key, agreement.POLL_S)


class _DeadRanks:
    """What a survivor knows of a round's dead: its group's health and the earlier rounds'
    suspects (here), what the other survivors know (one key per dead rank, which each publishes),
    and colls-run's exit records. Every rank hears of a death at its own pace (a rank's failure
    records are read one by one); sharing what each knew lets the last to check in decide."""

    def __init__(self, store: Store, key: str, pg: ProcessGroup, suspects: set[int],
                 liveness: Liveness) -> None:
        self._store, self._key, self._pg = store, key, pg
        self._suspects = suspects
        self._liveness = liveness
        self._published: set[int] = set()

    def _local(self) -> set[int]:
        return self._suspects | _group_ranks(self._pg, self._pg.health.dead)

    def publish(self) -> None:
        """Tell the other survivors the dead ranks this one learnt of since it last did."""
        for rank in self._local() - self._published:
            self._store.set(f"{self._key}/dead/{rank}", b"1")
            self._published.add(rank)

    def is_dead(self, rank: int) -> bool:
        return (rank in self._local() or self._store.check([f"{self._key}/dead/{rank}"])
                or bool(self._liveness.dead_among([rank])))

    def all_dead(self, ranks: set[int]) -> bool:
        """Return whether every rank of ``ranks`` is known dead (stops at the first that is not:
        early on most are only slow)."""
        return all(self.is_dead(rank) for rank in sorted(ranks))

    def among(self, ranks: set[int]) -> set[int]:
        return {rank for rank in ranks if self.is_dead(rank)}


def _proposal(candidates: set[int], present: set[int], explicit: list[int] | None,
              dead: _DeadRanks, deadline: float) -> dict[str, Any] | None:
    """Return this rank's proposal for the round, or None while it must wait for more."""
    present &= candidates
    absent = candidates - present
    late = time.monotonic() > deadline
    if explicit is not None:
        missing = candidates - set(explicit) - present
        lost = dead.among(missing) or (missing if late else set())
        if lost:
            return {"lost": sorted(lost), "explicit": explicit}
        if missing:
            return None
        return {"survivors": sorted(candidates - set(explicit)), "explicit": explicit}
    if late or dead.all_dead(absent):
        return {"survivors": sorted(present), "left_out": sorted(absent)}
    return None


def _survivors_of(decision: dict[str, Any], pg: ProcessGroup, explicit: list[int] | None
                  ) -> list[int]:
    """Return the survivors of ``decision``, or raise what it means for this caller."""
    if decision.get("explicit") != explicit:
        raise ValueError(
            f"{_where('shrink_group')}: group rank {pg.rank} of group {pg.name!r} passed "
            "ranks_to_exclude="
            f"{explicit}, but another survivor passed {decision.get('explicit')}; every caller "
            "must pass the same list (or None to agree on the dead)"
        )
    if "lost" in decision:
        lost = decision["lost"]
        raise PeerFailedError(
            f"shrink_group of group {pg.name!r}: group ranks {lost} are dead or unreachable "
            f"but not in ranks_to_exclude={explicit}",
            frozenset(pg.global_rank(r) for r in lost),
        )
    return list(decision["survivors"])


def _check_exclusions(ranks: Sequence[int] | None, pg: Any, where: str) -> list[int] | None:
    """Return ``ranks_to_exclude`` sorted, after torch's checks, or None; errors start with
    ``where`` (the call and this rank)."""
    if ranks is None:
        return None
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"{where}: ranks_to_exclude must be a list of group ranks or None, "
                        f"got {type(ranks).__name__}")
    chosen = list(ranks)
    if not chosen:
        raise ValueError(f"{where}: ranks_to_exclude cannot be empty (None agrees on the dead "
                         "ranks)")
    for r in chosen:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < pg.size:
            raise ValueError(f"{where}: ranks_to_exclude holds {r!r}, expected ranks of group "
                             f"{pg.name!r} (0..{pg.size - 1})")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"{where}: ranks_to_exclude repeats a rank: {chosen}")
    if len(chosen) == pg.size:
        raise ValueError(f"{where}: ranks_to_exclude={chosen} leaves nobody in group "
                         f"{pg.name!r}")
    if pg.rank in chosen:
        raise ValueError(f"{where}: group rank {pg.rank} of group {pg.name!r} is in "
                         f"ranks_to_exclude={sorted(chosen)}; only the ranks that stay call it")
    return sorted(chosen)


# -- grow --------------------------------------------------------------------------------------


def grow_group(group: Any = None) -> ProcessGroup:
    """Let the joiners waiting in the job's store into the default group; return the group.

    Every member calls it at the same point of the program (a step boundary). Without joiners
    it returns the group unchanged (a few store requests per member). With joiners, members keep
    their ranks, joiners get the next ones, the result becomes the default group, the other
    groups are invalidated, and ``result.joined_ranks`` names the newcomers: they take their
    state from rank 0, e.g. ``broadcast(params, src=0)`` on every rank.

    Raises:
        ValueError: ``group`` is not the default group.
        PeerFailedError: a member died meanwhile (shrink first).
    """
    pg = _member(group, "grow_group")
    if pg is not REGISTRY.default:
        raise ValueError(f"{_where('grow_group')}: group must be the default group (only the "
                         f"world grows), got group {pg.name!r}; make subgroups of the grown "
                         "world with new_group")
    hook = getattr(pg.backend, "grow", None)
    if callable(hook):
        return hook(pg)
    _check_resizable(pg, "grow_group")
    store = _job_store("grow_group")
    key = f"{KEY_ROOT}world{pg.generation}/grow/{pg.grow_calls}"
    pg.grow_calls += 1
    try:
        decision = _agree_on_joiners(store, key, pg)
        if not decision["tickets"]:
            return pg
        return _grow(pg, store, key, decision)
    except (NetworkError, OSError) as exc:
        raise agreement.store_failure(exc, store) from exc


def _agree_on_joiners(store: Store, key: str, pg: ProcessGroup) -> dict[str, Any]:
    decision = agreement.read_decision(store, f"{key}/decision")
    if decision is None:
        taken = store.add(JOIN_TICKETS, 0)
        waiting = list(range(pg.next_join_ticket, taken))
        joiners = Liveness(store, lambda: _joiner_processes(store, waiting))
        gone = joiners.dead_among(waiting) if waiting else set()
        proposal = {"tickets": [t for t in waiting if t not in gone], "next": taken}
        decision = agreement.decide(store, f"{key}/decision", proposal)
    pg.next_join_ticket = decision["next"]
    return decision


def _grow(pg: ProcessGroup, store: Store, key: str, decision: dict[str, Any]) -> ProcessGroup:
    tickets = decision["tickets"]
    size = pg.size + len(tickets)
    assignment = {"generation": pg.generation + 1, "size": size, "key": key,
                  "members": pg.size, "tickets": tickets, "backend": pg.backend_name,
                  "timeout": pg.timeout, "next": decision["next"],
                  "extra": _portable(pg.backend_extra)}
    for i, ticket in enumerate(tickets):  # every member writes them: any may die meanwhile
        store.set(f"{JOIN_ROOT}{ticket}/assigned", json.dumps({**assignment, "rank": pg.size + i}))
    agreement.register_process(store, pg.generation + 1, pg.rank)
    try:
        backend, group_store = _build_grown(store, assignment, pg.rank)
    except CommitFailed as failure:
        lost = [r for r in failure.missing if r < pg.size]
        if lost:
            raise PeerFailedError(
                f"{_where('grow_group')}: members {lost} of the default group died "
                f"({failure.reason})",
                frozenset(pg.global_rank(r) for r in lost),
            ) from None
        logger.warning("colls: grow_group: the joiners were left out (%s); the group stays "
                       "as it was", failure.reason)
        return pg
    return _install(pg, list(range(pg.size)), backend, group_store,
                    joined=tuple(range(pg.size, size)), grown_to=size)


def _build_grown(store: Store, assignment: dict[str, Any], rank: int) -> tuple[Any, Store]:
    """Build and commit this process's part of the grown world (members and joiners alike)."""
    members, size, key = assignment["members"], assignment["size"], assignment["key"]
    generation, tickets, timeout = (assignment["generation"], assignment["tickets"],
                                    assignment["timeout"])
    group_store = PrefixStore(f"{key}/group", store)
    spec = plugin_manager.resolve_backend(assignment["backend"])
    options = BackendOptions(timeout=timeout, group_name=WORLD_GROUP_NAME,
                             global_ranks=tuple(range(size)),
                             extra=MappingProxyType(assignment["extra"]))
    build = Build(lambda: spec.create(group_store, rank, size, options))

    def processes() -> dict[int, str]:
        known = _read_processes(store, [agreement.process_key(generation - 1, r)
                                        for r in range(members)])
        joiners = _joiner_processes(store, tickets)
        known.update({members + i: joiners[t] for i, t in enumerate(tickets) if t in joiners})
        return known

    def describe(r: int) -> str:
        return f"rank {r}" + (" (a joiner)" if r >= members else "")

    deadline = time.monotonic() + timeout
    backend = agreement.commit(store, f"{key}/commit", rank, size, build,
                               Liveness(store, processes), deadline, describe)
    return backend, group_store


def join(backend_name: str, store: Store, timeout: float) -> None:
    """Join the running job through ``store`` as a new rank of its default group
    (init_process_group under ``COLLS_JOIN=1``): take a ticket, wait until the members'
    grow_group assigns it a rank, build and commit with them, and become a member.

    Raises:
        CollsTimeoutError: no grow_group took this joiner within ``timeout`` seconds.
        BackendError: the members use another backend, or the new group was not built.
    """
    ticket = store.add(JOIN_TICKETS, 1) - 1
    store.set(f"{JOIN_ROOT}{ticket}/process", agreement.process_id())
    assigned_key = f"{JOIN_ROOT}{ticket}/assigned"
    try:
        store.wait([assigned_key], timeout)
    except StoreTimeoutError as exc:
        raise CollsTimeoutError(
            f"init_process_group (COLLS_JOIN=1): no member called grow_group within "
            f"{timeout:.0f} s (join ticket {ticket})"
        ) from exc
    assignment = json.loads(store.get(assigned_key))
    if plugin_manager.resolve_backend(backend_name).name != assignment["backend"]:
        raise BackendError(
            f"init_process_group (COLLS_JOIN=1): backend {backend_name!r} cannot join a group "
            f"running on {assignment['backend']!r}"
        )
    rank, generation = assignment["rank"], assignment["generation"]
    agreement.register_process(store, generation, rank)
    try:
        backend, group_store = _build_grown(store, assignment, rank)
    except CommitFailed as failure:
        raise BackendError(f"init_process_group (COLLS_JOIN=1): the grown group was not built "
                           f"({failure.reason})") from None
    pg = ProcessGroup(
        name=WORLD_GROUP_NAME, global_ranks=range(assignment["size"]), my_global_rank=rank,
        backend_name=assignment["backend"], backend=backend, store=group_store,
        timeout=assignment["timeout"], generation=generation,
        joined_ranks=range(assignment["members"], assignment["size"]),
        backend_extra=MappingProxyType(assignment["extra"]),
    )
    pg.next_join_ticket = assignment["next"]
    with REGISTRY.lock:
        _become_world(pg, store)


# -- the new group in place of the old --------------------------------------------------------


def _install(old: ProcessGroup, survivors: list[int], backend: Any, group_store: Store, *,
             joined: tuple[int, ...], grown_to: int | None = None) -> ProcessGroup:
    """Make the group that replaces ``old`` (its ``survivors``, plus joiners when grown)."""
    default = old is REGISTRY.default
    size = grown_to if grown_to is not None else len(survivors)
    new = ProcessGroup(
        name=_successor_name(old),
        global_ranks=[_world_rank_after(old, survivors, i) for i in range(size)],
        my_global_rank=_world_rank_after(old, survivors, survivors.index(old.rank)),
        backend_name=old.backend_name, backend=backend, store=group_store, timeout=old.timeout,
        generation=old.generation + 1 if default else old.generation, joined_ranks=joined,
        backend_extra=old.backend_extra,
    )
    new.next_join_ticket = old.next_join_ticket
    how = "grow_group" if grown_to is not None else "shrink_group"
    with REGISTRY.lock:
        if default:
            store = REGISTRY.job_store
            assert store is not None
            replaced = list(REGISTRY.groups.values())
            _become_world(new, store)
            change = ("renumbered the world's ranks" if grown_to is None
                      else "made a new world with the joiners")
            for other in replaced:
                _retire(other, f"invalidated by {how} of the default group, which {change}; "
                               "use the group it returned")
        else:
            REGISTRY.groups.pop(old.name, None)
            REGISTRY.groups[new.name] = new
            _retire(old, f"replaced by the group {how} returned")
    return new


def _become_world(pg: ProcessGroup, store: Store) -> None:
    """Make ``pg`` the default group of a new world generation (REGISTRY.lock held)."""
    REGISTRY.groups.clear()
    REGISTRY.groups[pg.name] = pg
    REGISTRY.default = pg
    REGISTRY.job_store = store
    REGISTRY.world_store = PrefixStore(f"world{pg.generation}", store)
    REGISTRY.world_rank, REGISTRY.world_size = int(pg.rank), int(pg.size)
    REGISTRY.generation = pg.generation
    REGISTRY.group_count = 0


def _retire(pg: ProcessGroup, because: str) -> None:
    """Release ``pg``'s resources by abort (nothing waits on its dead) and close it."""
    abort = getattr(pg.backend, "abort", None)
    if callable(abort) and pg.health.error is None:
        try:
            abort(BackendError(f"colls: group {pg.name!r} {because}"))
        except Exception:  # noqa: BLE001 - being discarded; never mask the caller's result
            logger.exception("colls: abort of group %r failed", pg.name)
    try:
        pg.close()
    except Exception:  # noqa: BLE001
        logger.exception("colls: closing group %r failed", pg.name)
    pg.destroyed_because = because


# -- small helpers -----------------------------------------------------------------------------


def _where(caller: str) -> str:
    """How errors of ``caller`` name the call and this rank (as :mod:`colls.dispatch`'s do)."""
    return f"{caller} on rank {d.my_rank()}"


def _member(group: Any, caller: str) -> ProcessGroup:
    pg = d.resolve_group(group)
    if pg is None:
        raise ValueError(f"{_where(caller)}: group must be a group this process is a member "
                         "of, got GroupMember.NON_GROUP_MEMBER")
    return pg


def _job_store(caller: str) -> Store:
    store = REGISTRY.job_store
    if store is None:
        raise BackendError(f"{caller}: this world has no job store to agree through (it was "
                           "made without a rendezvous, e.g. the mpi backend under mpiexec)")
    return store


def _successor_name(pg: ProcessGroup) -> str:
    return WORLD_GROUP_NAME if pg is REGISTRY.default else f"{pg.name}/shrunk"


def _world_rank_after(old: ProcessGroup, survivors: list[int], new_rank: int) -> int:
    """World rank of ``new_rank`` of the group replacing ``old``: the world is renumbered when
    ``old`` is the default group; otherwise world ranks stay (joiners exist only for the
    default)."""
    if old is REGISTRY.default:
        return new_rank
    return old.global_rank(survivors[new_rank])


def _options(pg: ProcessGroup, name: str, timeout: float,
             global_ranks: Sequence[int] | None = None) -> BackendOptions:
    return BackendOptions(timeout=timeout, group_name=name,
                          global_ranks=tuple(global_ranks if global_ranks is not None
                                             else pg.global_ranks),
                          extra=pg.backend_extra)


def _portable(extra: Any) -> dict[str, Any]:
    """Return the backend options a joiner can be given through the store (JSON): all of them,
    or none when one is not JSON (members and joiners must build with the same)."""
    try:
        json.dumps(dict(extra))
    except (TypeError, ValueError):
        logger.warning("colls: grow_group builds the grown group without its pg_options, "
                       "which cannot be sent to joiners as JSON")
        return {}
    return dict(extra)


def _group_ranks(pg: ProcessGroup, world_ranks: set[int]) -> set[int]:
    return {pg.group_rank(w) for w in set(world_ranks)} - {-1}


def _processes_of(pg: ProcessGroup, store: Store) -> Callable[[], dict[int, str]]:
    """Return a callable giving ``{group rank: "host:pid"}`` of ``pg``'s registered members."""
    @functools.cache
    def read() -> dict[int, str]:
        keys = [agreement.process_key(pg.generation, w) for w in pg.global_ranks]
        return _read_processes(store, keys)
    return read


def _read_processes(store: Store, keys: list[str]) -> dict[int, str]:
    """Return ``{i: value of keys[i]}`` for the keys that are set."""
    try:
        values = store.multi_get(keys, PROCESSES_WAIT_S)
    except StoreTimeoutError:
        return {i: store.get(k).decode() for i, k in enumerate(keys) if store.check([k])}
    return {i: v.decode() for i, v in enumerate(values)}


def _joiner_processes(store: Store, tickets: Sequence[int]) -> dict[int, str]:
    """Return ``{ticket: "host:pid"}`` of the joiners holding ``tickets``."""
    found = _read_processes(store, [f"{JOIN_ROOT}{t}/process" for t in tickets])
    return {tickets[i]: process for i, process in found.items()}


__all__ = ["grow_group", "join", "shrink_group"]
