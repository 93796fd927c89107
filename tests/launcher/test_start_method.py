"""--start-method fork: each hazard of forking workers from the launcher (colls/run/forking.py).

The end-to-end tests run under both start methods (the ``start_method`` fixture of conftest.py):
whatever a forked worker sees must be what an exec'd one sees. The unit tests below them look at
the fork machinery in this process.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from launch_helpers import LAUNCH_TIMEOUT_S, launcher_env

from colls.run import forking
from colls.run.config import LaunchConfig
from colls.run.processes import WorkerGroup

pytestmark = pytest.mark.timeout(60)


def lines_of(output: str) -> list[str]:
    return sorted(output.splitlines())


def test_forked_workers_start_with_the_preloaded_modules(write_script, run_launcher,
                                                        start_method):
    # Proof that the fork runs of every end-to-end test fork (and the exec runs exec).
    script = write_script("preloaded.py", """
        import os, sys
        from colls import plugin_manager
        from colls.run.forking import PRELOAD_MODULES
        preloaded = all(name in sys.modules for name in PRELOAD_MODULES)
        # the entry points were found before forking; they were loaded, and the manager built,
        # only if every one is colls' own (a third party's module may load CUDA)
        found = [ep.name for ep in plugin_manager._entry_points or ()]
        built = plugin_manager._manager is not None
        sys.stdout.write(f"{preloaded} parent={os.getppid()} {'tcp' in found} {built}\\n")
    """)
    result = run_launcher("--nproc-per-node", "2", str(script))
    assert result.returncode == 0, result.stderr
    flags = {(line.split()[0], *line.split()[2:]) for line in result.stdout.splitlines()}
    forked = start_method == "fork"
    only_own = all(ep.dist is not None and ep.dist.name == "colls"
                   for ep in importlib.metadata.entry_points(group="colls"))
    assert flags == {(str(forked), str(forked), str(forked and only_own))}
    assert len({line.split()[1] for line in result.stdout.splitlines()}) == 1  # the launcher


# --- 1. signal handlers -------------------------------------------------------------------------


def test_workers_start_with_a_fresh_interpreters_signal_handlers(write_script, run_launcher):
    script = write_script("signals.py", """
        import os, signal, sys
        fresh = (signal.getsignal(signal.SIGINT) is signal.default_int_handler
                 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
                 and signal.getsignal(signal.SIGHUP) == signal.SIG_DFL)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        sys.stdout.write(f"{os.environ['RANK']} fresh={fresh} blocked={sorted(blocked)}\\n")
    """)
    result = run_launcher("--nproc-per-node", "2", str(script))
    assert result.returncode == 0, result.stderr
    assert lines_of(result.stdout) == ["0 fresh=True blocked=[]", "1 fresh=True blocked=[]"]


# --- 2. threads, and 5. descriptors --------------------------------------------------------------


@pytest.mark.parametrize("tag", [False, True], ids=["untagged", "tagged"])
def test_worker_starts_with_only_the_standard_descriptors_and_one_thread(
    write_script, run_launcher, tag
):
    # Another worker's pipe left open in a worker would keep that pipe from ever reaching EOF.
    script = write_script("fds.py", """
        import os, sys, threading
        fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))  # 3: listdir's own
        tasks = len(os.listdir("/proc/self/task"))
        sys.stdout.write(f"fds={fds} threads={threading.active_count()} tasks={tasks}\\n")
    """)
    tag_flag = ["--tag-output"] if tag else []
    result = run_launcher("--nproc-per-node", "3", *tag_flag, str(script))
    assert result.returncode == 0, result.stderr
    expected = "fds=[0, 1, 2, 3] threads=1 tasks=1"
    prefixes = [f"[rank {r}]: " for r in range(3)] if tag else [""] * 3
    assert lines_of(result.stdout) == [p + expected for p in prefixes]


def test_tag_output_readers_start_only_after_every_worker_is_forked(monkeypatch, tmp_path):
    threads_at_fork = []

    def fake_fork_worker(argv, env, capture_output, args):
        threads_at_fork.append(threading.active_count())
        ends = [os.pipe(), os.pipe()]
        for _, write_end in ends:
            os.close(write_end)  # the readers see EOF at once
        out, err = (os.fdopen(read_end, "rb") for read_end, _ in ends)
        return forking.ForkedProcess(os.getpid(), args, out, err)  # waitpid: not a child, "0"

    monkeypatch.setattr(forking, "use_fork", lambda config: True)
    monkeypatch.setattr(forking, "prepare_launcher", lambda config: [])
    monkeypatch.setattr(forking, "fork_worker", fake_fork_worker)
    before = threading.active_count()
    with WorkerGroup(LaunchConfig(str(tmp_path / "a.py"), nproc_per_node=3,
                                  tag_output=True)) as group:
        group.start()
        assert threads_at_fork == [before] * 3
        assert len(group._pumps) == 6
        assert [w.popen.poll() for w in group.workers] == [0, 0, 0]


# --- 3. environment ------------------------------------------------------------------------------


def test_openblas_in_a_worker_sizes_its_pool_from_the_workers_omp_setting(
    write_script, run_launcher
):
    # OpenBLAS reads OMP_NUM_THREADS when NumPy is imported: under fork that import happens in the
    # launcher, so the launcher must have set it first. With one thread per worker, a matrix
    # product starts no extra thread (with the launcher's unset value it would, on >= 2 cores).
    script = write_script("blas.py", """
        import os, sys
        import numpy as np
        a = np.ones((256, 256))
        a @ a
        tasks = len(os.listdir("/proc/self/task"))
        sys.stdout.write(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} tasks={tasks}\\n")
    """)
    result = run_launcher("--nproc-per-node", "2", str(script))
    assert result.returncode == 0, result.stderr
    assert lines_of(result.stdout) == ["OMP_NUM_THREADS=1 tasks=1"] * 2


def test_prepare_launcher_sets_thread_defaults_before_preloading(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(forking, "preload", lambda modules: seen.append(
        os.environ.get("OMP_NUM_THREADS")) or [])
    monkeypatch.setenv("OMP_NUM_THREADS", "0")  # so that monkeypatch restores the original
    monkeypatch.delenv("OMP_NUM_THREADS")
    forking.prepare_launcher(LaunchConfig("a.py", nproc_per_node=1))
    forking.prepare_launcher(LaunchConfig("a.py", nproc_per_node=4))
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    forking.prepare_launcher(LaunchConfig("a.py", nproc_per_node=4))
    assert seen == [None, "1", "8"]  # as worker_env: only with several workers, never overriding


# --- 4. random state -----------------------------------------------------------------------------


def test_unseeded_random_draws_differ_between_ranks(write_script, tmp_path, start_method):
    # The launcher runs in-process under a driver that loaded numpy.random first (as NumPy 1.x's
    # own import does), so that forked workers really inherit NumPy's global RandomState.
    driver = write_script("driver.py", """
        import sys
        import numpy.random
        from colls.run import cli
        sys.exit(cli.main(sys.argv[1:]))
    """)
    script = write_script("draw.py", """
        import os, random, sys
        inherited = "numpy.random" in sys.modules
        import numpy as np
        sys.stdout.write(f"{inherited} {np.random.random()!r} {random.random()!r}\\n")
    """)
    result = subprocess.run(
        [sys.executable, str(driver), "--start-method", start_method, "--nproc-per-node", "3",
         str(script)],
        cwd=tmp_path, env=launcher_env(), capture_output=True, text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert len(rows) == 3
    assert {inherited for inherited, _, _ in rows} == {str(start_method == "fork")}
    assert len({np_draw for _, np_draw, _ in rows}) == 3
    assert len({py_draw for _, _, py_draw in rows}) == 3


def test_reseed_numpy_replaces_the_global_random_state():
    np = pytest.importorskip("numpy")
    state = np.random.get_state()
    try:
        np.random.seed(0)
        first = np.random.random()
        np.random.seed(0)
        forking.reseed_numpy()
        assert np.random.random() != first
    finally:
        np.random.set_state(state)


# --- 5. standard streams -------------------------------------------------------------------------


@pytest.mark.parametrize("tag", [False, True], ids=["untagged", "tagged"])
def test_line_printed_just_before_sigkill_reaches_the_output(write_script, run_launcher, tag):
    script = write_script("last_words.py", """
        import os, signal, time
        if os.environ["RANK"] == "0":
            print("last words")  # print(), not one write: unbuffered streams lose nothing
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    tag_flag = ["--tag-output"] if tag else []
    result = run_launcher("--nproc-per-node", "2", *tag_flag, str(script))
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    assert result.stdout.splitlines() == [("[rank 0]: " if tag else "") + "last words"]
    assert "rank 0 (local rank 0, pid" in result.stderr
    assert "failed first: killed by signal SIGKILL" in result.stderr


# --- 7. exit -------------------------------------------------------------------------------------


def test_exit_joins_threads_then_runs_the_scripts_atexit_handlers(write_script, run_launcher):
    script = write_script("bye.py", """
        import atexit, os, sys, threading
        rank = os.environ["RANK"]
        main_done = threading.Event()

        def work():
            main_done.wait(30)
            sys.stdout.write(f"{rank} thread done\\n")

        thread = threading.Thread(target=work)  # not a daemon: exit waits for it
        thread.start()
        atexit.register(lambda: sys.stdout.write(f"{rank} atexit, alive={thread.is_alive()}\\n"))
        main_done.set()
    """)
    result = run_launcher("--nproc-per-node", "3", str(script))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # in particular, no launcher code ran again in a worker
    lines = result.stdout.splitlines()
    for rank in range(3):
        assert [line for line in lines if line.startswith(f"{rank} ")] == [
            f"{rank} thread done", f"{rank} atexit, alive=False",
        ]


def test_file_a_module_never_closed_keeps_what_was_written(write_script, run_launcher, tmp_path):
    # The interpreter's teardown flushes the files it destroys; a forked worker ends with
    # os._exit, which must not drop what such a file still buffers.
    write_script("metrics.py", """
        import os
        log = open(os.path.join(os.environ["OUT_DIR"], os.environ["RANK"]), "w")
        log.write("last line\\n")
    """)
    script = write_script("train.py", "import metrics\n")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = run_launcher("--nproc-per-node", "2", str(script), OUT_DIR=str(out_dir))
    assert result.returncode == 0, result.stderr
    assert {p.name: p.read_text() for p in out_dir.iterdir()} == {
        "0": "last line\n", "1": "last line\n",
    }


@pytest.mark.parametrize(
    ("code", "status", "stderr_line"),
    [("None", 0, None), ("3", 3, None), ("'bye'", 1, "bye")],
)
def test_sys_exit_ends_the_worker_as_python_does(write_script, run_launcher, code, status,
                                                 stderr_line):
    script = write_script("leave.py", f"""
        import atexit, sys
        atexit.register(lambda: sys.stdout.write("atexit ran\\n"))
        sys.exit({code})
    """)
    result = run_launcher(str(script))
    assert result.returncode == status, result.stderr
    assert result.stdout == "atexit ran\n"
    if stderr_line is not None:
        assert result.stderr.splitlines()[0] == stderr_line
        assert "failed first with exit code 1" in result.stderr


def test_uncaught_keyboard_interrupt_kills_the_worker_with_sigint(write_script, run_launcher):
    script = write_script("interrupted.py", """
        import atexit, sys
        atexit.register(lambda: sys.stdout.write("atexit ran\\n"))
        raise KeyboardInterrupt
    """)
    result = run_launcher(str(script))
    assert result.returncode == 128 + signal.SIGINT, result.stderr
    assert result.stdout == "atexit ran\n"  # Python runs the handlers, then dies by SIGINT
    assert "\nKeyboardInterrupt\n" in result.stderr
    assert "failed first: killed by signal SIGINT" in result.stderr


# --- 8. garbage collection ----------------------------------------------------------------------


def test_forked_workers_inherit_frozen_objects_and_still_collect_their_own(write_script,
                                                                          run_launcher,
                                                                          start_method):
    script = write_script("gc_state.py", """
        import gc, sys, weakref
        class Node:
            pass
        node = Node()
        node.itself = node  # a cycle: only the collector frees it
        ref = weakref.ref(node)
        del node
        gc.collect()
        sys.stdout.write(f"{gc.get_freeze_count() > 0} {ref() is None}\\n")
    """)
    result = run_launcher("--nproc-per-node", "2", str(script))
    assert result.returncode == 0, result.stderr
    assert lines_of(result.stdout) == [f"{start_method == 'fork'} True"] * 2


# --- the fork machinery --------------------------------------------------------------------------
# Tests that fork run in a fresh interpreter: pytest's own process has JAX's and torch's thread
# pools by now, and a child forked from it can deadlock on a lock one of those threads held.


def run_clean(source: str) -> subprocess.CompletedProcess[str]:
    """Run ``source`` (its asserts are the test) in a fresh interpreter; fail if it fails."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)], env=launcher_env(),
        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_forked_process_reports_status_and_signal_like_popen():
    run_clean("""
        import os, signal, subprocess
        from colls.run import forking

        def fork_child(body):
            pid = os.fork()
            if pid == 0:
                try:
                    body()
                finally:
                    os._exit(0)
            return pid

        read_end, write_end = os.pipe()
        waiting = forking.ForkedProcess(fork_child(lambda: os._exit(len(os.read(read_end, 8)))),
                                        ["waiting"], None, None)
        killed = forking.ForkedProcess(
            fork_child(lambda: os.kill(os.getpid(), signal.SIGKILL)), ["killed"], None, None
        )
        assert killed.wait() == -signal.SIGKILL
        assert waiting.poll() is None
        try:
            waiting.wait(0.05)
        except subprocess.TimeoutExpired:
            pass
        else:
            raise AssertionError("wait(0.05) returned although the child runs")
        os.write(write_end, b"abc")
        assert waiting.wait(30) == 3
        assert (waiting.poll(), killed.poll()) == (3, -signal.SIGKILL)
    """)


def test_child_whose_own_setup_fails_exits_1_with_the_reason():
    # An environment name with "=" cannot be set: the child fails before the program runs, and
    # must end there (os._exit), never unwinding into the parent's (the launcher's) frames.
    result = run_clean("""
        import sys
        from colls.run import forking

        process = forking.fork_worker(["never_run.py"], {"BAD=NAME": "x"}, True, ["never_run.py"])
        with process.stdout, process.stderr:
            err = process.stderr.read().decode()
            assert process.stdout.read() == b""
        assert process.wait(30) == forking.EXIT_SETUP_FAILED
        sys.stdout.write(err)
    """)
    assert result.stdout.startswith("colls-run: forked worker setup failed:\n")
    assert "ValueError: illegal environment variable name" in result.stdout


def test_fork_applies_only_where_it_is_safe(monkeypatch):
    monkeypatch.setattr(forking.atexit, "_ncallbacks", lambda: 0)  # pytest registers its own
    # The suite's in-process tests before this one may leave threads (jax's, torch's).
    real_active_count = threading.active_count
    monkeypatch.setattr(forking.threading, "active_count", lambda: 1)
    monkeypatch.delenv("PYTHON_EXEC", raising=False)
    assert forking.use_fork(LaunchConfig("a.py"))
    assert not forking.use_fork(LaunchConfig("a.py", start_method="exec"))
    assert not forking.use_fork(LaunchConfig("prog", no_python=True))
    monkeypatch.setenv("PYTHON_EXEC", "/opt/python")  # another interpreter: exec it
    assert not forking.use_fork(LaunchConfig("a.py"))
    monkeypatch.delenv("PYTHON_EXEC")
    monkeypatch.setattr(forking.threading, "active_count", real_active_count)
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(30,))
    thread.start()
    try:
        assert not forking.use_fork(LaunchConfig("a.py"))  # a running thread: no fork
    finally:
        release.set()
        thread.join()
    monkeypatch.setattr(forking.atexit, "_ncallbacks", lambda: 1)
    assert not forking.use_fork(LaunchConfig("a.py"))  # someone else's exit handler: no fork


def test_preload_is_best_effort():
    assert forking.preload(["json", "no_such_module_for_colls_run"]) == [
        "no_such_module_for_colls_run"
    ]


#: Modules that may initialise a GPU or MPI (or are third-party plugins): never preloaded. The
#: mpi and nccl plugins' declaring modules are preloaded; what loads MPI or CUDA is not.
NEVER_PRELOADED = ("torch", "cupy", "jax", "jaxlib", "mpi4py", "colls_storemail", "colls_torch",
                   "colls_jax", "colls_plugins.mpi.runtime", "colls_plugins.mpi.backend",
                   "colls_plugins.nccl.runtime", "colls_plugins.nccl.backend")


def test_preload_list_imports_and_loads_no_gpu_mpi_or_plugin_module():
    probe = f"""
import json, sys
from colls.run import forking
failed = forking.preload(forking.PRELOAD_MODULES)
never = {NEVER_PRELOADED!r}
loaded = sorted(m for m in sys.modules if any(m == n or m.startswith(n + ".") for n in never))
import colls.plugin_manager
print(json.dumps([failed, loaded, colls.plugin_manager._manager is None]))
"""
    result = subprocess.run([sys.executable, "-c", probe], env=launcher_env(), capture_output=True,
                            text=True, timeout=LAUNCH_TIMEOUT_S, cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [[], [], True]
