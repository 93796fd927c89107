"""Start, watch and stop the workers of one node: the process half of colls-run.

Python workers are forked from the launcher after it preloaded NumPy and colls
(``--start-method fork``, colls.run.forking: the fast default), or each runs a fresh interpreter
(``exec``, subprocess.Popen). Every worker runs in its own session, so the launcher can signal a
worker together with anything it spawned (``os.killpg``), and so a Ctrl-C in the terminal reaches
only the launcher, which forwards it once. All workers are started before any is waited on, then
polled every ``POLL_INTERVAL_S``. When one fails, the rest get SIGTERM, ``STOP_GRACE_S`` to exit,
then SIGKILL, and the root-cause report (colls.run.failures) goes to stderr; with
``--on-failure shrink`` or ``replace`` the others go on instead, and a dead worker may be
replaced (colls.run.replacing).

Standard library only (the fork path's preloads aside): the launcher must start in milliseconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import FrameType, TracebackType
from typing import IO, BinaryIO, Protocol

from colls.run import forking, fr_dumps, replacing
from colls.run.config import (
    AUTH_TOKEN_VAR,
    INCARNATION_VAR,
    JOIN_VAR,
    STORE_PORT_VAR,
    LaunchConfig,
)
from colls.run.failures import (
    SIGNAL_EXIT_BASE,
    WorkerOutcome,
    exit_code_for,
    first_failure,
    format_interrupted,
    format_root_cause,
    read_error_file,
)
from colls.run.job_store import JobStore, JobStoreError

#: How often the workers are polled. Polling a handful of children costs microseconds; 20 ms keeps
#: the launcher's reaction (and its exit after the last worker) well under a human's notice.
POLL_INTERVAL_S = 0.02

#: Time the remaining workers get to exit after SIGTERM before they are killed with SIGKILL.
STOP_GRACE_S = 3.0

#: Upper bound on waiting for a worker to disappear after SIGKILL (it can hang only in the kernel).
KILL_WAIT_S = 10.0

#: Upper bound on waiting for the output readers of --tag-output after the workers are gone (a
#: grandchild that outlives its worker may keep the pipe open).
PUMP_JOIN_TIMEOUT_S = 2.0

#: Module every Python worker runs; it wraps the user's script (see colls.run._worker).
WORKER_MODULE = "colls.run._worker"

#: Signals the launcher forwards to the workers before stopping them.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Signals that ask for a live view of the ranks' flight recorders; the job goes on.
LIVE_VIEW_SIGNALS = tuple(s for s in (getattr(signal, "SIGUSR1", None),) if s is not None)

#: Exit codes of a worker that cannot be started, as a shell reports them.
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126


class WorkerStartError(Exception):
    """A worker process could not be started (program not found, not executable, ...)."""

    def __init__(self, local_rank: int, command: list[str], cause: OSError) -> None:
        super().__init__(
            f"colls-run: cannot start local rank {local_rank}: {command[0]!r}: "
            f"{cause.strerror or cause}"
        )
        self.local_rank = local_rank
        self.command = command
        self.cause = cause

    @property
    def exit_code(self) -> int:
        """Return 127 when the program does not exist, 126 when it cannot be executed, else 1."""
        if isinstance(self.cause, FileNotFoundError):
            return EXIT_NOT_FOUND
        if isinstance(self.cause, PermissionError):
            return EXIT_NOT_EXECUTABLE
        return 1


def worker_argv(config: LaunchConfig) -> list[str]:
    """Return the wrapper's arguments (colls.run._worker): ``[SCRIPT | -m MODULE, ARG ...]``."""
    target = ["-m", config.script] if config.module else [config.script]
    return [*target, *config.script_args]


def build_command(config: LaunchConfig) -> list[str]:
    """Return the argv an exec'd worker runs: the wrapped Python program, or the program itself.

    Python workers run with ``-u`` (unbuffered output) as under torchrun; ``PYTHON_EXEC`` picks
    another interpreter, as in torchrun.
    """
    if config.no_python:
        return [config.script, *config.script_args]
    python = os.environ.get("PYTHON_EXEC") or sys.executable
    return [python, "-u", "-m", WORKER_MODULE, *worker_argv(config)]


def worker_env(
    config: LaunchConfig, local_rank: int, error_file: str, base: dict[str, str] | None = None,
    incarnation: int = 0,
) -> dict[str, str]:
    """Return the environment of the worker with ``local_rank``: ``base`` plus the launch variables.

    Args:
        config: The launch.
        local_rank: The worker's rank on this node.
        error_file: Where the worker writes its traceback (exported as COLLS_ERROR_FILE).
        base: The environment to extend; the launcher's own when None.
        incarnation: 0 for the slot's first worker; n for its n-th replacement
            (``--on-failure replace``), which gets COLLS_JOIN=1 and COLLS_INCARNATION=n.

    The job's ``config.auth_token`` becomes COLLS_AUTH_TOKEN unless ``base`` has one, and its
    ``config.store_port`` (bound already) COLLS_STORE_PORT.
    """
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(config.global_rank(local_rank)),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(config.world_size),
        LOCAL_WORLD_SIZE=str(config.nproc_per_node),
        GROUP_RANK=str(config.node_rank),
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(config.master_port),
        COLLS_ERROR_FILE=error_file,
    )
    env.setdefault(fr_dumps.DUMP_DIR_VAR, fr_dumps.job_dump_dir())  # flight recorder dumps
    if config.auth_token:
        env.setdefault(AUTH_TOKEN_VAR, config.auth_token)
    if config.store_port == 0:
        raise ValueError("colls-run: worker_env() before the job's store was bound to a port")
    if config.store_port is None:
        env.pop(STORE_PORT_VAR, None)  # an outer job's store is not this job's
    else:
        env[STORE_PORT_VAR] = str(config.store_port)
    if incarnation:
        env.update({JOIN_VAR: "1", INCARNATION_VAR: str(incarnation)})
    else:  # an outer job's replacement must not make this job's workers join
        env.pop(JOIN_VAR, None)
        env.pop(INCARNATION_VAR, None)
    config.apply_thread_defaults(env)
    return env


def error_file_name(rank: int, incarnation: int) -> str:
    """Return the name of a worker's error file: one per slot and incarnation."""
    if incarnation:
        return f"error-rank{rank}-incarnation{incarnation}.json"
    return f"error-rank{rank}.json"


class WorkerProcess(Protocol):
    """What the launcher uses of a worker process: subprocess.Popen, or forking.ForkedProcess."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None:
        """Return the return code once the process exited (minus N for signal N), else None."""

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit and return the return code; raise TimeoutExpired after timeout."""


@dataclass
class Worker:
    """One started worker and what the launcher knows about it.

    ``incarnation`` is 0 for a slot's first worker, n for its n-th replacement.
    """

    local_rank: int
    rank: int
    error_file: str
    popen: WorkerProcess
    returncode: int | None = None
    incarnation: int = 0
    stopped_by_launcher: bool = False
    stop_signal: int | None = None

    @property
    def pid(self) -> int:
        """Return the worker's process id (also its process group id)."""
        return self.popen.pid


class _LinePump:
    """Copy one worker pipe to the launcher's stream line by line, each line prefixed."""

    def __init__(self, pipe: IO[bytes], sink: BinaryIO | None, prefix: bytes, lock: threading.Lock):
        self._pipe = pipe
        self._sink = sink
        self._prefix = prefix
        self._lock = lock
        self._thread = threading.Thread(target=self._run, name="colls-run-output", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for line in iter(self._pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"  # keep the next prefix at the start of a line
                self._write(self._prefix + line)
        finally:
            self._pipe.close()

    def _write(self, data: bytes) -> None:
        if self._sink is None:
            return  # the launcher's stream is gone; keep draining so the worker never blocks
        try:
            with self._lock:
                self._sink.write(data)
                self._sink.flush()
        except (OSError, ValueError):
            self._sink = None

    def join(self, timeout: float) -> None:
        """Wait until the worker closed its end of the pipe, for at most ``timeout`` seconds."""
        self._thread.join(timeout)


def _binary(stream: IO[str]) -> BinaryIO | None:
    return getattr(stream, "buffer", None)


def _signal_group(pid: int, signum: int) -> None:
    """Send ``signum`` to the process group of the worker ``pid``; ignore a group that is gone."""
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class WorkerGroup:
    """The workers of this node, from start to cleanup. Use as a context manager.

    Leaving the context kills any worker still running, waits for the output readers and removes
    the temporary directory holding the error files.
    """

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.workers: list[Worker] = []
        self._pumps: list[_LinePump] = []
        self._error_dir: str | None = None
        self._output_lock = threading.Lock()
        self._store: JobStore | None = None
        self._fork = False
        self._base_env: dict[str, str] = {}

    def __enter__(self) -> WorkerGroup:
        self._error_dir = tempfile.mkdtemp(prefix="colls-run-")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        """Start every worker of this node, without waiting on any.

        With fork, the launcher first preloads what workers import (colls.run.forking). On
        node 0 it then starts the job's store (colls.run.job_store). The --tag-output readers
        start only once every worker is started: no thread may run in the launcher while it
        forks.

        Raises:
            WorkerStartError: a worker could not be started; the ones already started keep
                running until the caller stops them (or leaves the context).
            JobStoreError: the job's store cannot be served; no worker was started.
        """
        if self._error_dir is None:
            raise RuntimeError("colls-run: WorkerGroup.start() called outside its 'with' block")
        # Decided once: preloading registers exit handlers, after which use_fork says no.
        self._fork = fork = forking.use_fork(self.config)
        if fork:
            forking.prepare_launcher(self.config)
        if self.config.serves_store:
            self._store = JobStore(self.config)
            self.config = replace(self.config, store_port=self._store.port)
        # Read once: decoding os.environ for each of hundreds of workers cost a third of a
        # millisecond each, on the path that starts them one after the other. Kept for the
        # replacements, which get their slot's environment.
        self._base_env = base_env = dict(os.environ)
        try:
            for local_rank in range(self.config.nproc_per_node):
                self.workers.append(self._start_one(local_rank, self._error_dir, fork, base_env))
        finally:
            if self.config.tag_output:  # also for the workers started before one failed to
                for worker in self.workers:
                    self._tag(worker)

    def replace(self, dead: Worker) -> Worker:
        """Start the next incarnation of ``dead``'s slot (``--on-failure replace``) and return it.

        It is forked as the first workers were, unless a thread now runs in the launcher (the
        --tag-output readers): forking a threaded process can leave a lock held in the child, so
        it is exec'd then.

        Raises:
            WorkerStartError: it could not be started.
        """
        if self._error_dir is None:
            raise RuntimeError("colls-run: WorkerGroup.replace() called outside its 'with' block")
        incarnation = 1 + max(w.incarnation for w in self.workers
                              if w.local_rank == dead.local_rank)
        fork = self._fork and threading.active_count() == 1
        worker = self._start_one(dead.local_rank, self._error_dir, fork, self._base_env,
                                 incarnation)
        self.workers.append(worker)
        if self.config.tag_output:
            self._tag(worker)
        return worker

    def _start_one(
        self, local_rank: int, error_dir: str, fork: bool, base_env: dict[str, str],
        incarnation: int = 0,
    ) -> Worker:
        """Fork or exec the worker with ``local_rank`` (its environment: ``base_env`` plus the
        launch variables); raise WorkerStartError if it cannot be."""
        rank = self.config.global_rank(local_rank)
        error_file = os.path.join(error_dir, error_file_name(rank, incarnation))
        env = worker_env(self.config, local_rank, error_file, base_env, incarnation)
        command = build_command(self.config)
        try:
            if fork:
                process: WorkerProcess = forking.fork_worker(
                    worker_argv(self.config), env, self.config.tag_output, command
                )
            else:
                pipe = subprocess.PIPE if self.config.tag_output else None
                process = subprocess.Popen(
                    command, env=env, stdout=pipe, stderr=pipe, start_new_session=True
                )
        except OSError as exc:
            raise WorkerStartError(local_rank, command, exc) from exc
        return Worker(local_rank, rank, error_file, process, incarnation=incarnation)

    def _tag(self, worker: Worker) -> None:
        prefix = f"[rank {worker.rank}]: ".encode()
        stdout, stderr = worker.popen.stdout, worker.popen.stderr
        if stdout is None or stderr is None:
            raise RuntimeError("colls-run: --tag-output needs the workers' output as pipes")
        self._pumps.append(_LinePump(stdout, _binary(sys.stdout), prefix, self._output_lock))
        self._pumps.append(_LinePump(stderr, _binary(sys.stderr), prefix, self._output_lock))

    def poll(self) -> list[Worker]:
        """Return the workers that exited since the last poll, recording their return codes."""
        exited = []
        for worker in self.workers:
            if worker.returncode is None:
                code = worker.popen.poll()
                if code is not None:
                    worker.returncode = code
                    exited.append(worker)
        return exited

    def running(self) -> list[Worker]:
        """Return the workers not yet seen to exit."""
        return [w for w in self.workers if w.returncode is None]

    def stop(self, signum: int, grace_s: float, hurry: Callable[[], bool] = lambda: False) -> None:
        """Send ``signum`` to every worker's group, wait up to ``grace_s``, then SIGKILL the rest.

        Args:
            signum: The first signal (SIGTERM, or the one the launcher received).
            grace_s: Seconds the workers get to exit before SIGKILL.
            hurry: Called while waiting; when it returns True (say, a second Ctrl-C), SIGKILL
                is sent at once.
        """
        self.poll()
        for worker in self.running():
            worker.stopped_by_launcher = True
            worker.stop_signal = signum
        for worker in self.workers:  # exited ones too: their own children may still run
            _signal_group(worker.pid, signum)
        deadline = time.monotonic() + grace_s
        while self.running() and time.monotonic() < deadline and not hurry():
            time.sleep(POLL_INTERVAL_S)
            self.poll()
        self._kill_running()

    def _kill_running(self) -> None:
        for worker in self.running():
            worker.stopped_by_launcher = True
            worker.stop_signal = signal.SIGKILL
            _signal_group(worker.pid, signal.SIGKILL)
        for worker in self.running():
            try:
                worker.returncode = worker.popen.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                print(f"colls-run: pid {worker.pid} survived SIGKILL", file=sys.stderr)

    def finish_output(self) -> None:
        """Wait for the tagged output of exited workers to be written (no-op without tagging)."""
        for pump in self._pumps:
            pump.join(PUMP_JOIN_TIMEOUT_S)
        self._pumps.clear()

    def outcome(self, worker: Worker) -> WorkerOutcome:
        """Return how ``worker`` ended (it must have exited), with its error file if any."""
        if worker.returncode is None:
            raise ValueError(f"colls-run: rank {worker.rank} (pid {worker.pid}) is still running")
        return WorkerOutcome(
            rank=worker.rank,
            local_rank=worker.local_rank,
            pid=worker.pid,
            returncode=worker.returncode,
            stopped_by_launcher=worker.stopped_by_launcher,
            stop_signal=worker.stop_signal,
            error=read_error_file(worker.error_file),
            incarnation=worker.incarnation,
        )

    def close(self) -> None:
        """Kill any worker still running, flush tagged output, stop the job's store (no worker
        is left to use it) and remove the error files."""
        self.poll()
        self._kill_running()
        self.finish_output()
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._error_dir is not None:
            shutil.rmtree(self._error_dir, ignore_errors=True)
            self._error_dir = None


class SignalCatcher:
    """Record SIGINT, SIGTERM and SIGHUP sent to the launcher, for the supervise loop to act on.

    A context manager: the previous handlers come back on exit. Outside the main thread (where
    Python cannot install handlers) it records nothing.
    """

    def __init__(self) -> None:
        self._received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalCatcher:
        if threading.current_thread() is threading.main_thread():
            for signum in (*FORWARDED_SIGNALS, *LIVE_VIEW_SIGNALS):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._received.append(signum)

    def take(self) -> int | None:
        """Return the oldest signal not yet taken, or None."""
        return self._received.pop(0) if self._received else None

    def pending(self) -> bool:
        """Return True when a signal arrived that was not yet taken."""
        return bool(self._received)


def launch(config: LaunchConfig, signals: SignalCatcher | None = None) -> int:
    """Run the workers of this node to the end and return the launcher's exit code.

    Returns:
        0 when every worker exited 0; the first failure's exit code (128 + N for signal N) when
        one failed; 128 + N when the launcher received signal N; 126/127 when a worker could not
        be started.
    """
    with WorkerGroup(config) as group:
        try:
            group.start()
        except (WorkerStartError, JobStoreError) as exc:
            print(exc, file=sys.stderr)
            group.stop(signal.SIGTERM, STOP_GRACE_S)
            return exc.exit_code
        return _supervise(group, signals)


def _supervise(group: WorkerGroup, signals: SignalCatcher | None) -> int:
    """Watch the workers until the job ends; return the launcher's exit code.

    With ``--on-failure stop`` the first death ends the job; otherwise a death while another
    worker runs is survived (colls.run.replacing.GoingOn), and the deaths survived are listed
    at the end.
    """
    going_on = None
    if group.config.goes_on_after_failure:
        token = os.environ.get(AUTH_TOKEN_VAR) or group.config.auth_token
        going_on = replacing.GoingOn(group.config, token)
    try:
        return _watch(group, signals, going_on)
    finally:
        if going_on is not None:
            going_on.close()


def _watch(
    group: WorkerGroup, signals: SignalCatcher | None, going_on: replacing.GoingOn | None
) -> int:
    hurry = signals.pending if signals is not None else (lambda: False)
    survived = going_on.report if going_on is not None else (lambda: "")
    while True:
        signum = signals.take() if signals is not None else None
        if signum in LIVE_VIEW_SIGNALS:
            _live_view(group.config)
            continue
        if signum is not None:
            group.stop(signum, STOP_GRACE_S, hurry)
            group.finish_output()
            report = format_interrupted(signum, [group.outcome(w) for w in group.workers])
            _print_report(survived() + report)
            return SIGNAL_EXIT_BASE + signum
        failed = [w for w in group.poll() if w.returncode != 0]
        if going_on is not None:
            failed = going_on.handle(group, failed)
        if failed:
            first = first_failure([group.outcome(w) for w in failed])
            group.stop(signal.SIGTERM, STOP_GRACE_S, hurry)
            group.finish_output()  # the report comes after the workers' last lines
            others = [group.outcome(w) for w in group.workers if w.pid != first.pid]
            _print_report(survived() + format_root_cause(first, others))
            _print_report(fr_dumps.report(fr_dumps.job_dump_dir()))
            return exit_code_for(first.returncode) or 1
        if not group.running():
            report = survived()
            if report:
                group.finish_output()  # after the workers' last lines, as the failure report
                _print_report(report)
            return 0
        time.sleep(POLL_INTERVAL_S)


def _live_view(config: LaunchConfig) -> None:
    """Print each rank's last started and completed call per group (colls-run got SIGUSR1)."""
    port = config.store_port or config.master_port
    try:
        text = fr_dumps.live_view(config.master_addr, port,
                                  os.environ.get(AUTH_TOKEN_VAR) or config.auth_token,
                                  fr_dumps.job_dump_dir())
    except Exception as exc:  # a view on request: the job goes on whatever happens here
        text = f"colls-run: no live view of the flight recorders: {type(exc).__name__}: {exc}\n"
    _print_report(text)


def _print_report(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # stderr closed: the exit code still tells the story
