"""Loading and initialising MPI through mpi4py, lazily, and what the loaded MPI can do.

Nothing here runs at import: the plugin module must stay cheap, and merely listing backends
(``colls.available_backends()``) must not start MPI. So :func:`unavailable_reason` imports
``mpi4py.MPI`` *without* initialising it (mpi4py's ``rc.initialize = False``), which proves that
mpi4py is installed and that libmpi loads; :func:`initialized_mpi` initialises MPI with
``MPI_THREAD_MULTIPLE`` when a group is actually created (or the world is asked for), and asks
mpi4py to finalise it at exit as it would have done itself. An MPI that the application already
initialised (``from mpi4py import MPI`` before colls) is used as it is, provided its thread level
is ``MPI_THREAD_MULTIPLE``: colls calls MPI from the group's executor thread and from the
backend's progress thread at the same time as from the caller's.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import sys
import threading
import time
from typing import Any, Final

from colls import env
from colls.errors import BackendUnavailableError
from colls_plugins.mpi import ulfm

#: What brings the mpi extra (mpi4py plus the MPICH wheel), as written from a checkout of colls.
INSTALL_HINT: Final = "pip install -e '.[mpi]' in a checkout of colls, or pip install mpi4py mpich"
_THREAD_LEVEL_NAMES: Final = ("MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED",
                              "MPI_THREAD_SERIALIZED", "MPI_THREAD_MULTIPLE")
#: Words in the MPI-4.1 ``mpi_memory_alloc_kinds`` info value that mean CUDA device memory.
_CUDA_KINDS: Final = ("cuda", "cuda:device")

_lock = threading.Lock()
#: Requests MPI may still write into after their group gave up on them (a timed-out collective,
#: a receive cancelled at close), each with its buffers: they stay referenced until exit.
abandoned: list[Any] = []
#: Seconds a rank that is about to end the job waits after its last line to stderr. The
#: launcher forwards each rank's output, and MPICH's hydra proxy stopped reading it once it
#: handled the abort: once in a CI run the line naming the rank never arrived.
OUTPUT_GRACE_S: Final = 0.2


def _thread_level_name(level: int) -> str:
    if 0 <= level < len(_THREAD_LEVEL_NAMES):
        return _THREAD_LEVEL_NAMES[level]
    return f"thread level {level}"


def _import_mpi() -> Any:
    """Import ``mpi4py.MPI`` without initialising MPI (if nobody has imported it yet).

    Raises:
        BackendUnavailableError: mpi4py is missing or libmpi cannot be loaded.
    """
    loaded = sys.modules.get("mpi4py.MPI")
    if loaded is not None:
        return loaded
    try:
        import mpi4py
    except ImportError as exc:
        raise BackendUnavailableError(
            f"mpi: mpi4py is not installed ({INSTALL_HINT}): {exc}"
        ) from exc
    rc = mpi4py.rc
    saved = (rc.initialize, rc.finalize)
    # Load libmpi now, initialise later (initialized_mpi); still finalise at exit if we did.
    rc.initialize = False
    if rc.finalize is None:
        rc.finalize = True
    try:
        from mpi4py import MPI
    except Exception as exc:  # ImportError (missing libmpi), OSError, RuntimeError
        raise BackendUnavailableError(
            f"mpi: mpi4py failed to load libmpi: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        rc.initialize, rc.finalize = saved
    return MPI


def unavailable_reason() -> str | None:
    """Return None when the mpi backend can run here, else exactly why not.

    Cheap after the first call and never initialises MPI. An MPI that is already initialised
    with a thread level below ``MPI_THREAD_MULTIPLE`` is reported as unusable.
    """
    try:
        MPI = _import_mpi()
        if MPI.Is_initialized() and not MPI.Is_finalized():
            _check_thread_level(MPI)
        if MPI.Is_finalized():
            return "mpi: MPI has already been finalized in this process"
    except BackendUnavailableError as exc:
        return str(exc)
    return None


def _check_thread_level(MPI: Any) -> None:
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        raise BackendUnavailableError(
            f"mpi: MPI provides {_thread_level_name(provided)} but colls needs "
            "MPI_THREAD_MULTIPLE (it calls MPI from its executor and progress threads); leave "
            "mpi4py.rc.thread_level at 'multiple' or initialise MPI with "
            "MPI.Init_thread(MPI.THREAD_MULTIPLE)"
        )


def initialized_mpi() -> Any:
    """Return the ``mpi4py.MPI`` module with MPI initialised at ``MPI_THREAD_MULTIPLE``.

    Raises:
        BackendUnavailableError: mpi4py/libmpi is missing, MPI is finalised, or its thread
            level is too low.
    """
    MPI = _import_mpi()
    with _lock:
        if MPI.Is_finalized():
            raise BackendUnavailableError("mpi: MPI has already been finalized in this process")
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
    _check_thread_level(MPI)
    return MPI


_hook_installed = False


def abort_on_uncaught_exception(MPI: Any) -> None:
    """Make an uncaught exception on this rank stop the whole MPI job (idempotent).

    Under plain ``mpiexec``, a rank that dies of an exception leaves its peers blocked in their
    next collective until an outer kill: MPI_Finalize, run at exit, waits for them. Like
    ``python -m mpi4py``, colls replaces ``sys.excepthook`` (when the mpi backend is first
    created) with one that prints the traceback as before, adds a line naming the rank, and
    calls ``MPI_Abort`` on ``MPI_COMM_WORLD``, which makes mpiexec end every rank. An
    application that wants another policy sets its own ``sys.excepthook`` after
    ``init_process_group``.

    Under ULFM (``mpiexec --with-ft ulfm``, see :mod:`.ulfm`) the survivors must live: the hook
    then ends only this process, at once and without ``MPI_Finalize`` (which would wait for
    the others), so MPI reports it to them as a failed process.
    """
    global _hook_installed
    with _lock:
        if _hook_installed:
            return
        _hook_installed = True
    previous = sys.excepthook

    def abort_hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        try:
            previous(exc_type, exc, tb)  # the traceback, once, as without colls
        finally:
            if MPI.Is_initialized() and not MPI.Is_finalized():
                survive = ulfm.active(MPI)
                world = MPI.COMM_WORLD
                what = (
                    "leaving the MPI job without MPI_Abort: fault tolerance is on (ULFM, "
                    "mpiexec --with-ft ulfm), so the other ranks see this rank fail and may "
                    "shrink their groups" if survive else
                    "aborting the MPI job (MPI_Abort) so the other ranks stop too"
                )
                sys.stderr.write(
                    f"colls: rank {world.Get_rank()} of {world.Get_size()} stopped on an "
                    f"uncaught {exc_type.__name__}; {what}\n"
                )
                sys.stderr.flush()
                time.sleep(OUTPUT_GRACE_S)  # the launcher passes the lines on first
                end = _die if survive else functools.partial(world.Abort, 1)
                if sys.stderr is sys.__stderr__:
                    end()
                else:
                    # An outer hook captured stderr (torch.distributed's, to prefix each line
                    # with the rank) and prints it only once this hook has returned: abort at
                    # exit instead, which comes next, before MPI_Finalize could wait for the
                    # other ranks (atexit runs the handler registered last first).
                    atexit.register(end)

    sys.excepthook = abort_hook


def _die() -> None:
    """End this process now, as a failed MPI process (no MPI_Finalize, no further atexit).

    By SIGKILL, not ``os._exit(1)``: Open MPI 5's runtime (PRRTE, ``--with-ft ulfm``) reports a
    process killed by a signal to the survivors as failed, but not one that exits with a
    non-zero status (they then waited in their collective until the group timeout).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def world() -> tuple[int, int]:
    """Return ``(rank, size)`` of ``MPI_COMM_WORLD`` (initialising MPI if needed)."""
    comm = initialized_mpi().COMM_WORLD
    return comm.Get_rank(), comm.Get_size()


def cuda_aware() -> bool:
    """Return whether MPI may be handed CUDA device pointers.

    ``COLLS_MPI_CUDA_AWARE`` decides when set (1/0); otherwise the MPI library is asked:
    ``MPIX_Query_cuda_support()``, the extension MPICH and Open MPI both export (mpi4py does
    not wrap it: :func:`_mpix_cuda_support` calls it in the loaded library), else the MPI-4.1
    ``mpi_memory_alloc_kinds`` info of ``MPI_COMM_WORLD``. Anything that cannot be determined
    counts as not CUDA-aware, so device memory is staged through the host instead of risking a
    crash inside MPI.
    """
    forced = _forced_cuda_awareness()
    if forced is not None:
        return forced
    MPI = initialized_mpi()
    answer = _mpix_cuda_support()
    if answer is not None:
        return answer
    try:
        kinds = MPI.COMM_WORLD.Get_info().Get("mpi_memory_alloc_kinds") or ""
    except Exception:  # MPI older than 4.1
        return False
    return any(kind.strip() in _CUDA_KINDS for kind in kinds.split(","))


def _mpix_cuda_support() -> bool | None:
    """Return what the loaded MPI library's ``MPIX_Query_cuda_support()`` says, or None.

    None: no MPI library is mapped into the process under a name holding "libmpi", or it lacks
    the symbol (an MPI built without CUDA support may).
    """
    import ctypes

    query = libmpi_function("MPIX_Query_cuda_support")
    if query is None:
        return None
    query.restype, query.argtypes = ctypes.c_int, []
    return bool(query())


def libmpi_function(name: str) -> Any:
    """Return the function ``name`` of the MPI library loaded in this process, or None.

    None: no library is mapped into the process under a name holding "libmpi" (read from
    ``/proc/self/maps``; not Linux), or none of them exports ``name``.
    """
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and "/" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            function = getattr(ctypes.CDLL(path), name, None)
        except OSError:
            continue
        if function is not None:
            return function
    return None


def _forced_cuda_awareness() -> bool | None:
    value = env.get("COLLS_MPI_CUDA_AWARE").lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(
        f"environment variable COLLS_MPI_CUDA_AWARE={value!r}: expected auto, 1 or 0"
    )


def error_text(exc: Exception) -> str:
    """Return MPI's error text on one line: the class, and the innermost frame of a stack.

    MPICH reports "Message truncated, error stack:" followed by one line per internal call, the
    last being the specific one ("MPIDIG_recv_type_init(74): Message from rank 0 and tag 4
    truncated; 32 bytes received but buffer size is 8").
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    head = lines[0].removesuffix("error stack:").rstrip(" ,")
    innermost = lines[-1].split("): ", 1)[-1] if len(lines) > 1 else head
    return head if innermost == head else f"{head}: {innermost}"
