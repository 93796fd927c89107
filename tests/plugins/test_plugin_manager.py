"""Unit behaviour of colls.plugin_manager with in-process plugins and fake entry points.

Entry point discovery is turned off (``COLLS_DISABLE_PLUGIN_AUTOLOAD=1``) unless a test feeds
fake entry points, so installed plugins never leak into these results.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator

import fake_plugins as fp
import pluggy
import pytest

from colls import plugin_manager
from colls.errors import BackendUnavailableError

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, fresh_plugins: None) -> Iterator[None]:
    """Start every test with discovery off and no plugin registered."""
    monkeypatch.setenv("COLLS_DISABLE_PLUGIN_AUTOLOAD", "1")
    plugin_manager.reset()
    yield


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, *points: tuple[str, str]) -> None:
    """Make discovery see exactly ``points`` ((name, "module:attr") pairs) and turn it on."""
    fakes = [importlib.metadata.EntryPoint(name, value, "colls") for name, value in points]

    def entry_points(**selection: str) -> list[importlib.metadata.EntryPoint]:
        return fakes if selection.get("group") == "colls" else []

    monkeypatch.setattr(plugin_manager.importlib.metadata, "entry_points", entry_points)
    monkeypatch.delenv("COLLS_DISABLE_PLUGIN_AUTOLOAD")
    plugin_manager.reset()


def test_discovery_off_means_no_backends_and_says_so() -> None:
    assert plugin_manager.available_backends() == {}
    with pytest.raises(BackendUnavailableError) as info:
        plugin_manager.resolve_backend("tcp")
    message = str(info.value)
    assert "unknown backend 'tcp'" in message
    assert "COLLS_DISABLE_PLUGIN_AUTOLOAD=1" in message and "discovery is off" in message


def test_registered_plugin_provides_its_backend() -> None:
    plugin_manager.register_plugin(fp.FakePlugin("pigeon"), name="aviary")
    spec = plugin_manager.resolve_backend("pigeon")
    assert (spec.name, spec.plugin, spec.devices) == ("pigeon", "aviary", ("cpu",))
    assert plugin_manager.available_backends() == {"pigeon": None}


def test_names_are_case_insensitive_and_gloo_means_tcp() -> None:
    plugin_manager.register_plugin(fp.FAKE_TCP, name="fake-tcp")
    assert plugin_manager.resolve_backend("TCP").plugin == "fake-tcp"
    assert plugin_manager.resolve_backend("gloo").name == "tcp"


def test_unknown_name_lists_every_backend_and_why() -> None:
    plugin_manager.register_plugin(fp.FakePlugin("pigeon"), name="aviary")
    plugin_manager.register_plugin(fp.MOON, name="moon")
    with pytest.raises(BackendUnavailableError) as info:
        plugin_manager.resolve_backend("carrier")
    message = str(info.value)
    assert "unknown backend 'carrier'" in message
    assert "pigeon: available" in message
    assert "moonlink: needs a base station on the moon" in message


def test_unavailable_backend_gives_its_reason() -> None:
    plugin_manager.register_plugin(fp.MOON, name="moon")
    assert plugin_manager.available_backends() == {"moonlink": fp.MOON.reason}
    with pytest.raises(BackendUnavailableError, match="needs a base station on the moon"):
        plugin_manager.resolve_backend("moonlink")


def test_availability_check_that_raises_becomes_the_reason() -> None:
    plugin_manager.register_plugin(fp.BrokenCheckPlugin(), name="fragile-plugin")
    reason = plugin_manager.available_backends()["fragile"]
    assert reason == "fragile: availability check failed: RuntimeError: probe exploded"
    with pytest.raises(BackendUnavailableError, match="probe exploded"):
        plugin_manager.resolve_backend("fragile")


def test_two_plugins_claiming_one_name_is_an_error_naming_both() -> None:
    plugin_manager.register_plugin(fp.FakePlugin("twin"), name="first")
    plugin_manager.register_plugin(fp.FakePlugin("twin"), name="second")
    with pytest.raises(BackendUnavailableError) as info:
        plugin_manager.resolve_backend("twin")
    assert "'twin' is claimed by more than one plugin" in str(info.value)
    assert "'first'" in str(info.value) and "'second'" in str(info.value)
    assert "'first'" in plugin_manager.available_backends()["twin"]


def test_same_plugin_name_twice_is_refused() -> None:
    plugin_manager.register_plugin(fp.FakePlugin("a"), name="dup")
    with pytest.raises(ValueError, match="dup"):
        plugin_manager.register_plugin(fp.FakePlugin("b"), name="dup")


def test_hook_with_a_wrong_signature_is_refused_naming_plugin_and_hook() -> None:
    with pytest.raises(pluggy.PluginValidationError) as info:
        plugin_manager.register_plugin(fp.BadSignaturePlugin(), name="bad-signature")
    assert "bad-signature" in str(info.value) and "colls_backends" in str(info.value)
    assert "device" in str(info.value)


def test_hook_returning_something_else_than_specs_names_the_plugin() -> None:
    plugin_manager.register_plugin(fp.NotASpecPlugin(), name="dicty-plugin")
    with pytest.raises(TypeError, match="plugin 'dicty-plugin'.*must return BackendSpec"):
        plugin_manager.available_backends()


def test_unregister_removes_the_backend() -> None:
    plugin_manager.register_plugin(fp.FakePlugin("pigeon"), name="aviary")
    plugin_manager.unregister_plugin("aviary")
    plugin_manager.unregister_plugin("never-registered")  # a no-op
    assert plugin_manager.available_backends() == {}


def test_reset_forgets_registered_plugins() -> None:
    plugin_manager.register_plugin(fp.FakePlugin("pigeon"), name="aviary")
    plugin_manager.reset()
    assert plugin_manager.available_backends() == {}


def test_entry_points_are_registered_under_their_names(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(monkeypatch, ("moon-ep", "fake_plugins:MOON"),
                       ("tcp-ep", "fake_plugins:FAKE_TCP"))
    assert plugin_manager.resolve_backend("tcp").plugin == "tcp-ep"
    assert plugin_manager.available_backends() == {"moonlink": fp.MOON.reason, "tcp": None}


def test_entry_point_that_fails_to_import_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_entry_points(monkeypatch, ("ghost", "no_such_module_for_colls_tests"),
                       ("tcp-ep", "fake_plugins:FAKE_TCP"))
    status = plugin_manager.available_backends()
    assert status["tcp"] is None
    assert "plugin 'ghost'" in status["ghost"] and "ModuleNotFoundError" in status["ghost"]
    with pytest.raises(BackendUnavailableError, match="ghost: plugin 'ghost'.*failed to import"):
        plugin_manager.resolve_backend("nonexistent")


def test_two_entry_points_claiming_one_name(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(monkeypatch, ("twin-a", "fake_plugins:TWIN_A"),
                       ("twin-b", "fake_plugins:TWIN_B"))
    with pytest.raises(BackendUnavailableError, match=r"'twin-a', 'twin-b'"):
        plugin_manager.resolve_backend("twin")


def test_a_launcher_builds_the_manager_before_forking_only_from_colls_own_plugins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    own = [ep for ep in importlib.metadata.entry_points(group="colls")
           if ep.dist is not None and ep.dist.name == plugin_manager.OWN_DISTRIBUTION]
    assert {ep.name for ep in own} >= {"tcp", "mpi", "nccl"}
    # one entry point that another distribution declares (its module may load CUDA): nothing
    _fake_entry_points(monkeypatch, ("moon-ep", "fake_plugins:MOON"))
    assert plugin_manager.build_before_fork() is False
    assert plugin_manager._manager is None
    # colls' own entry points only, as installed: the manager and the specs are built now
    monkeypatch.setattr(plugin_manager.importlib.metadata, "entry_points",
                        lambda **selection: own if selection.get("group") == "colls" else [])
    plugin_manager.reset()
    assert plugin_manager.build_before_fork() is True
    assert plugin_manager._manager is not None and plugin_manager._specs is not None
    assert plugin_manager.resolve_backend("tcp").plugin == "tcp"
