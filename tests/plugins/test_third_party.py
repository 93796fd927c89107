"""A third-party backend found through its entry point, and the errors of backend selection.

``storemail`` (in ``storemail/``, installed by pip in the ``storemail_installed`` fixture)
implements only point-to-point through the group's store; the conformance suite proves it gets
every collective from colls.algorithms.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import fake_plugins as fp
import numpy as np
import pytest

import colls
from colls import plugin_manager
from colls.errors import BackendUnavailableError
from colls.testing import ConformanceError, check_backend

SUBPROCESS_TIMEOUT_S = 120


def _init_single(backend: str) -> None:
    """Initialise a world of one with ``backend`` over an in-memory store."""
    colls.init_process_group(backend, store=colls.HashStore(), rank=0, world_size=1)


def _run_python(script: str, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run([sys.executable, str(path)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)


@pytest.mark.timeout(60)
def test_entry_point_is_discovered(storemail_installed: str, fresh_plugins: None) -> None:
    assert colls.available_backends()[storemail_installed] is None
    spec = plugin_manager.resolve_backend(storemail_installed)
    assert (spec.name, spec.plugin, spec.devices) == ("storemail", "storemail", ("cpu",))


@pytest.mark.timeout(60)
def test_storemail_runs_a_world_of_one_in_process(storemail_installed: str,
                                                  fresh_plugins: None) -> None:
    _init_single(storemail_installed)
    try:
        assert colls.get_backend() == "storemail"
        array = np.arange(5, dtype=np.float32)
        colls.all_reduce(array)
        np.testing.assert_array_equal(array, np.arange(5, dtype=np.float32))
        assert colls.get_world_size() == 1
    finally:
        colls.destroy_process_group()


@pytest.mark.timeout(240)
def test_storemail_passes_the_conformance_suite(storemail_installed: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Every check, the failure paths included: storemail declares it relies on timeouts."""
    check_backend(storemail_installed, world_sizes=(1, 2, 3), quick=True, timeout=200)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("check_backend('storemail'): passed 22 checks ("), summary
    assert "dead peers: relies on timeouts (the backend declares dead_peers='timeout')" in (
        summary)


@pytest.mark.timeout(SUBPROCESS_TIMEOUT_S + 10)
def test_disabling_autoload_hides_every_plugin(storemail_installed: str, tmp_path: Path) -> None:
    result = _run_python("""
        import colls
        from colls.errors import BackendUnavailableError
        print("available:", colls.available_backends())
        try:
            colls.init_process_group("tcp", store=colls.HashStore(), rank=0, world_size=1)
        except BackendUnavailableError as exc:
            print("error:", exc)
        else:
            print("error: none")
    """, tmp_path, {"COLLS_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert result.returncode == 0, result.stderr
    assert "available: {}" in result.stdout
    assert "error: unknown backend 'tcp'" in result.stdout
    assert "entry point discovery is off: COLLS_DISABLE_PLUGIN_AUTOLOAD=1" in result.stdout


@pytest.mark.timeout(60)
def test_unknown_backend_lists_the_available_ones(storemail_installed: str,
                                                  fresh_plugins: None) -> None:
    with pytest.raises(BackendUnavailableError) as info:
        _init_single("carrier-pigeon")
    message = str(info.value)
    assert "unknown backend 'carrier-pigeon'" in message
    assert "tcp: available" in message and "storemail: available" in message
    assert not colls.is_initialized()


@pytest.mark.timeout(60)
def test_two_plugins_claiming_one_name_conflict(storemail_installed: str,
                                                fresh_plugins: None) -> None:
    plugin_manager.register_plugin(fp.IMPOSTOR, name="impostor")
    with pytest.raises(BackendUnavailableError) as info:
        _init_single("storemail")
    message = str(info.value)
    assert "'storemail' is claimed by more than one plugin" in message
    assert "'storemail'" in message and "'impostor'" in message
    assert not colls.is_initialized()
    plugin_manager.unregister_plugin("impostor")
    assert plugin_manager.resolve_backend("storemail").plugin == "storemail"


@pytest.mark.timeout(60)
def test_unavailable_backend_error_gives_the_plugins_reason(fresh_plugins: None) -> None:
    plugin_manager.register_plugin(fp.MOON, name="moon")
    assert colls.available_backends()["moonlink"] == fp.MOON.reason
    with pytest.raises(BackendUnavailableError) as info:
        _init_single("moonlink")
    assert "backend 'moonlink' is not available: moonlink: needs a base station on the moon" in (
        str(info.value))
    assert not colls.is_initialized()


LEAKY_PLUGIN = '''
"""A backend that writes into the non-root ranks' arrays during reduce (a bug to be caught)."""

from colls.backend import BackendSpec
from colls.hookspecs import hookimpl
from colls_plugins.tcp.backend import TcpBackend

GARBAGE = 99  # never one of the conformance suite's input values


class LeakyBackend(TcpBackend):
    def reduce(self, array, root, op, tag):
        super().reduce(array, root, op, tag)
        if self.rank != root and array.size:
            array[...] = GARBAGE


@hookimpl
def colls_backends():
    return [BackendSpec(name="leaky", devices=("cpu",), create=LeakyBackend)]
'''


def _install_on_path(directory: Path) -> None:
    """Make ``leaky_plugin`` discoverable by interpreters that have ``directory`` on sys.path."""
    (directory / "leaky_plugin.py").write_text(LEAKY_PLUGIN)
    info = directory / "leaky_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: leaky-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[colls]\nleaky = leaky_plugin\n")


@pytest.mark.timeout(SUBPROCESS_TIMEOUT_S + 10)
def test_conformance_failure_names_check_world_size_rank_and_case(tmp_path: Path) -> None:
    plugin_dir = tmp_path / "site"
    plugin_dir.mkdir()
    _install_on_path(plugin_dir)
    path = os.pathsep.join(filter(None, [str(plugin_dir), os.environ.get("PYTHONPATH")]))
    result = _run_python("""
        import sys
        from colls.testing import ConformanceError, check_backend

        if __name__ == "__main__":
            try:
                check_backend("leaky", world_sizes=(2,), checks=["counts"], timeout=60)
            except ConformanceError as exc:
                print(exc)
                sys.exit(3)
    """, tmp_path, {"PYTHONPATH": path})
    assert result.returncode == 3, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("check_backend('leaky', array_library='numpy'): world size 2: ")
    assert lines[0].endswith("failing case(s):"), lines[0]
    first = lines[1].strip()
    assert first.startswith("conformance check 'reduce' failed (backend='leaky', world_size=2, "
                            "rank=0, array_library=numpy, dtype=float32, op=SUM, root=1, "
                            "count=1): AssertionError: result"), first
    assert "Every rank:" in result.stdout and "--- rank 1:" in result.stdout


@pytest.mark.timeout(30)
def test_conformance_error_is_an_assertion_error() -> None:
    assert issubclass(ConformanceError, AssertionError)
    with pytest.raises(ValueError, match="unknown checks"):
        check_backend("tcp", checks=["no-such-check"])
    with pytest.raises(ValueError, match="array_library"):
        check_backend("tcp", array_library="cupy")
