"""``--start-method fork``: Python workers forked from a launcher that preloaded NumPy and colls.

Why: startup time. A worker started as a fresh interpreter pays Python's own start (about 50 ms),
``import numpy`` (about 130 ms of CPU) and the colls modules ``init_process_group("tcp")`` needs
(about 150 ms), and four workers on two cores pay that four times over: about 0.9 s from launch to
the first barrier. Here the launcher imports :data:`PRELOAD_MODULES` once, then ``os.fork()``s one
child per local rank; each child becomes its worker in place and runs colls.run._worker's logic,
so the imports are paid once and shared copy-on-write (figures in docs/benchmarks.md).

A forked child is not a fresh interpreter. The differences that matter are handled one by one:

1. Signal handlers: the launcher's Python-level handlers (SignalCatcher) go back to what a fresh
   interpreter has (SIGINT raises KeyboardInterrupt, the others SIG_DFL). The signals that have
   such handlers are blocked around ``fork()`` so that none lands on the launcher's handler in
   the child.
2. Threads: colls-run forks every worker before it starts any thread (its --tag-output readers),
   and falls back to exec when another Python thread runs. The only threads that may exist are
   OpenBLAS's native ones, which OpenBLAS stops around fork itself (pthread_atfork).
3. Environment: the child applies its worker environment to ``os.environ``. OMP_NUM_THREADS, read
   by OpenBLAS when NumPy is imported, is set in the launcher's own environment before preloading.
4. Random state: NumPy's legacy global RandomState, when loaded, is reseeded from OS entropy in
   the child, so unseeded draws differ between ranks (Python's ``random`` reseeds itself).
5. Standard streams: --tag-output's pipes are put on fds 1 and 2, every other inherited descriptor
   is closed (as Popen's ``close_fds``), and ``sys.stdout``/``sys.stderr`` become unbuffered text
   streams, as under ``python -u``: nothing is lost when the worker is killed.
6. ``sys.argv`` and ``sys.path[0]``: set by colls.run._worker, as for an exec'd worker.
7. Exit: the child never returns into the launcher's frames (it would run the launcher's cleanup
   and kill the other workers). It ends as the interpreter ends a program: SystemExit converted to
   a status, an uncaught KeyboardInterrupt printed and turned into death by SIGINT, non-daemon
   threads joined, atexit handlers run, stdout and stderr then every open buffered file flushed
   (the interpreter's teardown flushes the files it destroys: a module-level log file never
   closed keeps its last lines), then ``os._exit``. Other finalizers (``__del__``) do not run.
   Exit handlers that the preloaded modules register at import (colls.health's report flush,
   logging's shutdown) are the worker's own and stay; the launcher itself registers none, and
   fork is not used when the process already had handlers before preloading (colls-run run
   in-process by another program).
8. Garbage collection: the launcher moves every object it holds after preloading to the
   collector's permanent generation (``gc.freeze()``, as the gc documentation advises before
   fork). A worker's collections then neither scan those objects nor write their headers,
   which copied pages and cost a worker about 3 ms of CPU time to its first barrier. The
   worker's own objects are collected as usual; the frozen ones live as long as the process, as
   the preloaded modules do anyway.

Nothing that may initialise a GPU or MPI is preloaded: a CUDA or MPI context does not survive
fork. The entry points are *found* before forking
(:func:`colls.plugin_manager.discover_entry_points` reads every installed distribution's
metadata, which was half of each worker's CPU time to its first barrier). When every one of them
is colls' own, the launcher also loads them and builds the plugin manager
(:func:`colls.plugin_manager.build_before_fork`); with a third-party plugin installed, whose
module might load CUDA, each worker loads them itself.
``exec`` (a fresh interpreter per worker) remains available and is used whenever fork does not
apply (:func:`use_fork`).
"""

from __future__ import annotations

import _signal  # signal's C module: plain ints in and out (see _python_handled_signals)
import atexit
import gc
import importlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Mapping
from typing import IO, NoReturn

from colls.run import _worker
from colls.run.config import LaunchConfig

#: Modules the launcher imports once before forking, so that forked workers start with them loaded:
#: what ``import colls; colls.init_process_group("tcp"); colls.barrier()`` imports (found with
#: ``python -X importtime``). Only NumPy, the standard library and colls' own CPU-only modules:
#: never anything that may initialise a GPU or MPI (torch, cupy, jax, mpi4py, the mpi and nccl
#: backends' runtimes), and no third-party plugin (its module may load CUDA libraries; see the
#: module docstring for colls' own). A module that fails to import is skipped: the worker imports
#: it itself.
PRELOAD_MODULES: tuple[str, ...] = (
    "numpy",
    "importlib.metadata",  # plugin discovery reads the entry points with it
    "encodings.idna",  # host names passed to socket functions are encoded with it
    "pkgutil",  # runpy.run_path imports it for every script: 1 ms and 300 page faults a worker
    "colls.lifecycle",  # init_process_group: dispatch, buffers, plugin_manager, health, pluggy
    "colls.collectives",
    "colls.rendezvous",
    "colls.store.tcp",
    "colls.store.tcp_server",
    "colls_plugins.tcp.plugin",  # colls' own tcp backend, with colls_plugins.tcp.backend
    # shrink_group / grow_group: survivors would import them all at once, right after a death,
    # when every millisecond of 63 ranks' CPU on a host counts (0.4 s at 64 ranks on 2 cores).
    "colls.resize",
    # The modules colls' other entry points name. The worker's plugin manager imports every
    # entry point's module, so these were imported in every worker anyway (5 ms of its CPU time
    # to the first barrier, a sixth). They import neither mpi4py nor CuPy (their contract):
    # their backends' runtimes load those when a group is created.
    "colls_plugins.mpi.plugin",
    "colls_plugins.nccl.plugin",
)

#: Exit status of a forked child whose own setup failed, before the worker's program ran.
EXIT_SETUP_FAILED = 1

#: The interpreter's exit status when stdout or stderr cannot be flushed at exit.
EXIT_FLUSH_FAILED = 120

#: Exit status of a process killed by SIGINT, used if the signal somehow does not end the child.
EXIT_SIGINT = 128 + signal.SIGINT

#: Longest sleep between polls in ForkedProcess.wait(timeout), as in subprocess.Popen.wait.
WAIT_DELAY_MAX_S = 0.05


def use_fork(config: LaunchConfig) -> bool:
    """Return True when the workers of ``config`` are forked, False when each is exec'd.

    Fork is used when it is asked for (the default) and applies: the workers are Python programs
    (not --no-python) run by this very interpreter (no PYTHON_EXEC), the platform has ``fork``, no
    other Python thread runs (forking a threaded process can leave locks held in the child), and
    no exit handler is registered yet (it would belong to whatever runs the launcher, and would run
    again in every worker).
    """
    return (
        config.start_method == "fork"
        and not config.no_python
        and not os.environ.get("PYTHON_EXEC")
        and hasattr(os, "fork")
        and threading.active_count() == 1
        and atexit._ncallbacks() == 0
    )


def prepare_launcher(config: LaunchConfig) -> list[str]:
    """Make this process the parent forked workers need; return the modules that did not import.

    The thread defaults go into the launcher's own environment first, because OpenBLAS sizes its
    thread pool from OMP_NUM_THREADS when NumPy is imported, and every forked worker inherits that
    pool's size.
    """
    config.apply_thread_defaults(os.environ)
    failed = preload(PRELOAD_MODULES)
    if "colls.lifecycle" not in failed:
        from colls import plugin_manager

        plugin_manager.discover_entry_points()
        plugin_manager.build_before_fork()
    gc.freeze()  # hazard 8
    return failed


def preload(modules: Iterable[str]) -> list[str]:
    """Import ``modules`` (best effort) and return the names that failed to import."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # missing or broken: the worker imports it itself and reports the error
            failed.append(name)
    return failed


class ForkedProcess:
    """A forked worker, with the part of subprocess.Popen's interface the launcher uses.

    Attributes:
        pid: The child's process id (also its session and process group id).
        args: The command the worker stands for, for messages (as ``Popen.args``).
        stdout: Read end of the child's stdout pipe (--tag-output), else None.
        stderr: Read end of the child's stderr pipe (--tag-output), else None.
        returncode: None while running; then the exit status, or minus the number of the signal
            that killed it, exactly as ``Popen.returncode``.
    """

    def __init__(
        self, pid: int, args: list[str], stdout: IO[bytes] | None, stderr: IO[bytes] | None
    ) -> None:
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Return the return code if the child has exited (reaping it), else None."""
        if self.returncode is None:
            self._reap(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child to exit and return its return code.

        Raises:
            subprocess.TimeoutExpired: it is still running after ``timeout`` seconds.
        """
        if timeout is None:
            while self.returncode is None:
                self._reap(0)
            return self.returncode
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            delay = min(delay * 2, remaining, WAIT_DELAY_MAX_S)
            time.sleep(delay)
        return self.returncode

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:
            self.returncode = 0  # reaped by someone else: Popen reports 0 in that case too
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)


def fork_worker(
    worker_argv: list[str], env: Mapping[str, str], capture_output: bool, args: list[str]
) -> ForkedProcess:
    """Fork a child that runs ``colls.run._worker.main(worker_argv)`` with ``env``, then exits.

    Args:
        worker_argv: The wrapper's command line: ``[SCRIPT, ARG ...]`` or ``[-m, MODULE, ARG ...]``.
        env: The worker's whole environment.
        capture_output: Give the child pipes as stdout and stderr (--tag-output); their read ends
            are the returned process's ``stdout`` and ``stderr``.
        args: The equivalent command line, for messages.

    Raises:
        OSError: no pipe or no process could be created.
    """
    pipes = [os.pipe(), os.pipe()] if capture_output else []
    try:
        pid, mask = _fork()
    except OSError:
        for read_end, write_end in pipes:
            os.close(read_end)
            os.close(write_end)
        raise
    if pid == 0:
        _child_main(worker_argv, env, [write_end for _, write_end in pipes], mask)
    for _, write_end in pipes:
        os.close(write_end)  # the child holds it now; EOF on the read end means the child is done
    stdout, stderr = (os.fdopen(r, "rb") for r, _ in pipes) if pipes else (None, None)
    return ForkedProcess(pid, args, stdout, stderr)


def fork_helper() -> int:
    """Fork a child that works for the launcher but is no worker; return its pid, 0 in the child.

    The child gets its own session (a Ctrl-C in the terminal reaches only the launcher, which
    stops it in order) and a fresh interpreter's signal handlers (hazard 1). It must end with
    ``os._exit``, never returning into the launcher's frames (hazard 7). colls.run.job_store
    serves the job's store from such a child.
    """
    pid, mask = _fork()
    if pid == 0:
        os.setsid()
        _restore_fresh_signal_handlers()
        _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)
    return pid


def _fork() -> tuple[int, set[int]]:
    """Fork with the launcher's handled signals blocked; return the pid and the mask to restore.

    Blocked, a signal sent to the child before it has put back a fresh interpreter's handlers
    waits, instead of running the launcher's handler in the child (where it would be lost).
    """
    _flush_std_streams()  # a buffered byte would otherwise be written twice, once by each process
    handled = _python_handled_signals()
    mask = _signal.pthread_sigmask(_signal.SIG_BLOCK, handled)
    try:
        pid = os.fork()
    except BaseException:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)
        raise
    if pid != 0:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)
    return pid, mask


def _python_handled_signals() -> list[int]:
    """Return the signals that have a Python-level handler in this process.

    Through ``_signal``: :mod:`signal`'s wrappers turn every number into an enum member, and
    for the 64 signals of each of hundreds of forks that cost about as much as the forks.
    """
    return [s for s in _signal.valid_signals() if callable(_signal.getsignal(s))]


def _child_main(
    worker_argv: list[str], env: Mapping[str, str], out_fds: list[int], mask: set[int]
) -> NoReturn:
    """Become the worker, run it, and end the process; never return into the launcher's frames."""
    try:
        try:
            _become_worker(env, out_fds, mask)
        except BaseException:
            _report_setup_failure()
            os._exit(EXIT_SETUP_FAILED)
        status = _run_worker(worker_argv)
        _finish(status)
    finally:
        os._exit(EXIT_SETUP_FAILED)  # reached only if the above raised: never unwind further


def _become_worker(env: Mapping[str, str], out_fds: list[int], mask: set[int]) -> None:
    """Turn the forked launcher into what a freshly exec'd worker would be (hazards 1 to 5)."""
    os.setsid()  # own session and process group, as Popen(start_new_session=True)
    _restore_fresh_signal_handlers()
    _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)
    _set_up_std_streams(out_fds)
    # Only what differs from the launcher's environment, inherited already: a write is a
    # putenv, and the whole environment cost a worker most of a millisecond. A variable the
    # worker's environment leaves out (an outer job's COLLS_STORE_PORT) is removed.
    for name in [k for k in os.environ if k not in env]:
        del os.environ[name]
    os.environ.update({k: v for k, v in env.items() if os.environ.get(k) != v})
    reseed_numpy()


def _restore_fresh_signal_handlers() -> None:
    """Give back every Python-level handler of the launcher to what a fresh interpreter has."""
    for signum in _python_handled_signals():
        if _signal.getsignal(signum) is not signal.default_int_handler:
            fresh = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, fresh)


def _set_up_std_streams(out_fds: list[int]) -> None:
    """Put the --tag-output pipes on fds 1 and 2, close other descriptors, use unbuffered streams.

    Every descriptor above 2 is closed, as Popen does for an exec'd worker: the launcher's read
    ends of earlier workers' pipes would otherwise keep those pipes open. The file objects that
    wrap them stay reachable from the launcher's frames, which this process never leaves, so they
    are never finalised (and never close a reused descriptor number).
    """
    if out_fds:
        os.dup2(out_fds[0], 1)
        os.dup2(out_fds[1], 2)
    os.closerange(3, _max_fd())
    sys.stdout = sys.__stdout__ = _unbuffered_text_stream(1, "<stdout>", sys.stdout)
    sys.stderr = sys.__stderr__ = _unbuffered_text_stream(2, "<stderr>", sys.stderr)


def _max_fd() -> int:
    """Return one past the highest possible descriptor number (subprocess uses the same bound)."""
    try:
        return max(os.sysconf("SC_OPEN_MAX"), 256)
    except (ValueError, OSError):
        return 256


def _unbuffered_text_stream(fd: int, name: str, like: IO[str] | None) -> io.TextIOWrapper | None:
    """Return a text stream writing straight through to ``fd``, as ``python -u`` makes; None when
    ``fd`` is not open (the interpreter sets the stream to None then)."""
    try:
        raw = io.FileIO(fd, "wb", closefd=False)
    except OSError:
        return None
    raw.name = name  # type: ignore[misc]  # as the interpreter names its own
    return io.TextIOWrapper(
        raw,
        encoding=getattr(like, "encoding", None) or "utf-8",
        errors=getattr(like, "errors", None) or "strict",
        newline="\n",
        write_through=True,
    )


def reseed_numpy() -> None:
    """Reseed NumPy's legacy global RandomState from OS entropy, if NumPy's random is loaded.

    Python's ``random`` reseeds itself in a forked child (os.register_at_fork); NumPy's global
    RandomState does not, so every rank would otherwise draw the same "random" numbers.
    """
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()


def _run_worker(worker_argv: list[str]) -> int | None:
    """Run the worker's program as the interpreter runs one; return its exit status.

    Returns:
        The status (0, 1 for an uncaught exception, a ``sys.exit`` code), or None when the program
        ended with an uncaught KeyboardInterrupt, which Python turns into death by SIGINT.
    """
    try:
        return _worker.main(worker_argv)
    except SystemExit as exc:
        return _system_exit_status(exc)
    except KeyboardInterrupt as exc:
        _print_exception(exc)
        return None
    except BaseException as exc:  # neither Exception (the wrapper's) nor the two above
        _print_exception(exc)
        return 1


def _system_exit_status(exc: SystemExit) -> int:
    """Return the exit status the interpreter gives ``exc``, printing a non-integer code."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    _write_stderr(f"{exc.code}\n")
    return 1


def _finish(status: int | None) -> NoReturn:
    """End the process in the interpreter's order: threads, exit handlers, flush, then exit.

    ``status`` None means death by SIGINT (an uncaught KeyboardInterrupt).
    """
    _join_threads()
    atexit._run_exitfuncs()  # prints and skips a failing handler, as at interpreter exit
    flushed = _flush_std_streams()
    _flush_open_files()
    if status is None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(EXIT_SIGINT)
    os._exit((status if flushed else EXIT_FLUSH_FAILED) & 0xFF)


def _join_threads() -> None:
    """Wait for the program's non-daemon threads, as the interpreter does before atexit."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # also used by multiprocessing's children
    except BaseException as exc:  # a Ctrl-C while waiting: reported, and the exit goes on
        _write_stderr(f"Exception ignored in: {threading!r}\n")
        _print_exception(exc)


def _flush_open_files() -> None:
    """Flush every buffered file still open, as the interpreter does when its teardown destroys
    them; ``os._exit`` would drop what they hold. Text layers go first: they flush into the
    binary buffers below them. (The launcher's own writers, stdout and stderr, are empty.)"""
    kinds = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    files = [obj for obj in gc.get_objects() if issubclass(type(obj), kinds)]
    files.sort(key=lambda f: not isinstance(f, io.TextIOWrapper))
    for file in files:
        try:
            if not file.closed:
                file.flush()
        except Exception:  # detached, a broken pipe ...: ignored, as at teardown
            pass


def _flush_std_streams() -> bool:
    """Flush sys.stdout and sys.stderr; return False when one of them could not be flushed."""
    flushed = True
    for stream in (sys.stdout, sys.stderr):
        if stream is None or getattr(stream, "closed", False):
            continue
        try:
            stream.flush()
        except Exception:
            flushed = False
    return flushed


def _print_exception(exc: BaseException) -> None:
    try:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    except BaseException:
        pass  # no usable stderr: the exit status still tells


def _write_stderr(text: str) -> None:
    try:
        if sys.stderr is not None:
            sys.stderr.write(text)
    except BaseException:
        pass


def _report_setup_failure() -> None:
    """Print why this child could not become a worker, straight to fd 2 (streams may be broken)."""
    try:
        text = "colls-run: forked worker setup failed:\n" + traceback.format_exc()
        os.write(2, text.encode(errors="backslashreplace"))
    except BaseException:
        pass
