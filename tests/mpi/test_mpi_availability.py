"""The mpi plugin's availability check, lazy loading and singleton use (no mpiexec needed).

Each case runs in a fresh interpreter: what is imported and initialised is process state.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

#: Seconds one interpreter may take (imports only; guards a hang).
RUN_S = 60


def _python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter; return its stdout (fail with its stderr)."""
    import os

    environ = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "RANK")}
    environ.update(env)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=RUN_S, env=environ)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout.strip()


@pytest.mark.no_mpi_needed
def test_missing_mpi4py_is_reported_with_the_install_hint() -> None:
    out = _python("""
        import sys
        sys.modules["mpi4py"] = None  # as if it were not installed
        import colls
        from colls.errors import BackendUnavailableError
        print(colls.available_backends()["mpi"])
        try:
            colls.init_process_group("mpi")
        except BackendUnavailableError as exc:
            print("refused:", exc)
    """)
    reason, refused = out.splitlines()[:2]
    # the command works as written from a checkout (issue 32)
    assert reason.startswith(
        "mpi: mpi4py is not installed (pip install -e '.[mpi]' in a checkout of colls, or "
        "pip install mpi4py mpich)"
    )
    assert refused.startswith("refused: backend 'mpi' is not available: mpi: mpi4py is not")


#: An mpi4py whose extension module cannot load libmpi, as on a machine where the MPI library is
#: missing or of the wrong ABI. It stands in for the real package (first on PYTHONPATH), so the
#: test runs the same whether or not mpi4py is installed.
BROKEN_MPI4PY = {
    "__init__.py": "class rc:\n    initialize = True\n    finalize = None\n",
    "MPI.py": "raise ImportError('libmpi.so.12: cannot open shared object file: "
              "No such file or directory')\n",
}


@pytest.mark.no_mpi_needed
def test_a_libmpi_that_fails_to_load_is_reported(tmp_path) -> None:
    package = tmp_path / "mpi4py"
    package.mkdir()
    for name, text in BROKEN_MPI4PY.items():
        (package / name).write_text(text)
    out = _python("""
        import colls
        print(colls.available_backends()["mpi"])
    """, PYTHONPATH=str(tmp_path))
    assert out == ("mpi: mpi4py failed to load libmpi: ImportError: libmpi.so.12: cannot open "
                   "shared object file: No such file or directory")


def test_listing_backends_neither_imports_at_plugin_load_nor_initialises_mpi() -> None:
    out = _python("""
        import sys
        import colls
        import colls_plugins.mpi.plugin
        print("mpi4py" in sys.modules)
        print(colls.available_backends()["mpi"])
        from mpi4py import MPI
        print(MPI.Is_initialized())
    """)
    assert out.splitlines() == ["False", "None", "False"]


def test_a_process_outside_mpiexec_is_a_world_of_one() -> None:
    out = _python("""
        import numpy as np
        import colls
        colls.init_process_group("mpi")
        a = np.arange(4, dtype=np.float32)
        colls.all_reduce(a)
        g = colls.new_group([0])
        colls.broadcast(a, src=0, group=g)
        print(colls.get_rank(), colls.get_world_size(), a.tolist())
        colls.destroy_process_group()
    """)
    assert out == "0 1 [0.0, 1.0, 2.0, 3.0]"


def test_an_mpi_the_application_initialised_first_is_used() -> None:
    out = _python("""
        from mpi4py import MPI  # the application's own import initialises MPI
        import numpy as np
        import colls
        colls.init_process_group("mpi")
        a = np.ones(2)
        colls.all_reduce(a)
        colls.destroy_process_group()
        print(MPI.Is_initialized(), MPI.Is_finalized(), a.tolist())
    """)
    assert out == "True False [1.0, 1.0]"


def test_an_mpi_without_thread_multiple_is_unavailable() -> None:
    out = _python("""
        import mpi4py
        mpi4py.rc.thread_level = "single"
        from mpi4py import MPI
        import colls
        print(MPI.Query_thread() < MPI.THREAD_MULTIPLE)
        print(colls.available_backends()["mpi"])
    """)
    lowered, reason = out.splitlines()
    if lowered == "False":
        pytest.skip("this MPI provides MPI_THREAD_MULTIPLE even when asked for less")
    assert "colls needs MPI_THREAD_MULTIPLE" in reason


def test_cuda_awareness_detection_and_override() -> None:
    code = """
        from colls_plugins.mpi import runtime
        try:
            print(runtime.cuda_aware())
        except ValueError as exc:
            print("ValueError:", exc)
    """
    assert _python(code, COLLS_MPI_CUDA_AWARE="1") == "True"
    assert _python(code, COLLS_MPI_CUDA_AWARE="0") == "False"
    assert _python(code) == "False"  # PyPI's MPICH: no CUDA support reported
    assert "expected auto, 1 or 0" in _python(code, COLLS_MPI_CUDA_AWARE="maybe")


def test_the_mpi_library_itself_is_asked_about_cuda() -> None:
    # mpi4py does not wrap MPIX_Query_cuda_support; colls calls it in the loaded library.
    # PyPI's MPICH exports it and answers 0 (built without CUDA).
    code = """
        from colls_plugins.mpi import runtime
        runtime.initialized_mpi()
        print(runtime._mpix_cuda_support())
    """
    assert _python(code) == "False"
