"""Find backend plugins and turn a backend name into a :class:`~colls.backend.BackendSpec`.

Discovery goes through pluggy over the entry point group ``colls``; colls' own backends are
declared in its pyproject exactly like a third party's, so there is no built-in list here.
``COLLS_DISABLE_PLUGIN_AUTOLOAD=1`` skips entry points; :func:`register_plugin` still works.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import threading
from typing import Any

import pluggy

from colls import env, hookspecs
from colls.backend import BackendSpec
from colls.errors import BackendUnavailableError

log = logging.getLogger(__name__)

#: Names accepted for compatibility and the backend they mean.
ALIASES = {"gloo": "tcp"}
#: The distribution that declares colls' own backends (tcp, mpi, nccl) as entry points.
OWN_DISTRIBUTION = "colls"

_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_load_errors: dict[str, str] = {}
_specs: dict[str, list[BackendSpec]] | None = None  # the hook's answers, asked once
_entry_points: tuple[importlib.metadata.EntryPoint, ...] | None = None  # found, not yet loaded


def _new_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    if not env.get("COLLS_DISABLE_PLUGIN_AUTOLOAD"):
        _load_entry_points(manager)
    return manager


def discover_entry_points() -> tuple[importlib.metadata.EntryPoint, ...]:
    """Return the ``colls`` entry points of the installed distributions, without loading any.

    Reading every distribution's metadata is most of the CPU time a process spends in
    ``init_process_group`` (tens of milliseconds in a venv with torch and jax). The result is
    kept for the process, so a launcher that forks its workers (colls.run.forking) calls this
    once before forking and every worker inherits the list; :func:`reset` forgets it.
    """
    global _entry_points
    with _lock:
        if _entry_points is None:
            _entry_points = tuple(importlib.metadata.entry_points(group=hookspecs.PROJECT))
        return _entry_points


def build_before_fork() -> bool:
    """Build the plugin manager now if every ``colls`` entry point is colls' own; return whether.

    colls-run calls this before it forks its workers (colls.run.forking), which then inherit the
    manager and the backends' specs instead of each building them: 3 ms of a worker's CPU time,
    most of it pluggy inspecting the plugin modules. colls' own plugin modules import neither MPI
    nor CUDA libraries (their backends' runtimes do, when a group is created). A third-party
    plugin's module may, and such a context does not survive fork: with one installed, every
    worker builds its own manager, as a process that is not forked does.
    """
    if not all(ep.dist is not None and ep.dist.name == OWN_DISTRIBUTION
               for ep in discover_entry_points()):
        return False
    _all_specs()
    return True


def _load_entry_points(manager: pluggy.PluginManager) -> None:
    """Register every ``colls`` entry point; remember (not raise) the ones that fail to import."""
    for entry_point in discover_entry_points():
        if manager.has_plugin(entry_point.name):
            continue
        try:
            plugin = entry_point.load()
        except Exception as exc:  # a broken third-party plugin must not break colls
            _load_errors[entry_point.name] = (
                f"plugin {entry_point.name!r} ({entry_point.value}) failed to import: "
                f"{type(exc).__name__}: {exc}"
            )
            log.warning("%s", _load_errors[entry_point.name])
            continue
        manager.register(plugin, name=entry_point.name)


def get_plugin_manager() -> pluggy.PluginManager:
    """Return the process-wide plugin manager, loading entry points on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = _new_manager()
        return _manager


def register_plugin(plugin: Any, name: str | None = None) -> None:
    """Register a plugin object or module explicitly (in addition to entry points).

    Raises:
        ValueError: a plugin with that name is already registered.
        pluggy.PluginValidationError: a hook's signature does not match colls.hookspecs, or
            the plugin marks a hook colls does not define (the message names plugin and hook).
    """
    global _specs
    manager = get_plugin_manager()
    with _lock:
        registered = manager.register(plugin, name=name)
        try:
            manager.check_pending()
        except pluggy.PluginValidationError:
            manager.unregister(name=registered)
            raise
        _specs = None


def unregister_plugin(name: str) -> None:
    """Remove a plugin registered under ``name`` (no-op if absent)."""
    global _specs
    manager = get_plugin_manager()
    with _lock:
        plugin = manager.get_plugin(name)
        if plugin is not None:
            manager.unregister(plugin, name=name)
        _specs = None


def reset() -> None:
    """Forget every plugin; the next lookup rediscovers entry points (used by tests)."""
    global _manager, _specs, _entry_points
    with _lock:
        _manager = None
        _specs = None
        _entry_points = None
        _load_errors.clear()


def _all_specs() -> dict[str, list[BackendSpec]]:
    """Return the specs of every plugin, grouped by lower-cased backend name (asked once)."""
    global _specs
    with _lock:
        if _specs is None:
            _specs = _collect_specs()
        return _specs


def _collect_specs() -> dict[str, list[BackendSpec]]:
    manager = get_plugin_manager()
    found: dict[str, list[BackendSpec]] = {}
    for plugin_name, plugin in manager.list_name_plugin():
        hook = getattr(plugin, "colls_backends", None)
        if hook is None:
            continue
        for spec in hook() or []:
            if not isinstance(spec, BackendSpec):
                raise TypeError(
                    f"plugin {plugin_name!r}: colls_backends() must return BackendSpec objects, "
                    f"got {type(spec).__name__}"
                )
            spec = dataclasses.replace(spec, plugin=plugin_name)
            found.setdefault(spec.name.lower(), []).append(spec)
    return found


def available_backends() -> dict[str, str | None]:
    """Return every known backend name mapped to None (usable) or the reason it is not."""
    status: dict[str, str | None] = {}
    for name, specs in sorted(_all_specs().items()):
        if len(specs) > 1:
            status[name] = _conflict_message(name, specs)
        else:
            status[name] = _availability(specs[0])
    for plugin_name, reason in _load_errors.items():
        status.setdefault(plugin_name, reason)
    return status


def _availability(spec: BackendSpec) -> str | None:
    try:
        return spec.available()
    except Exception as exc:
        return f"{spec.name}: availability check failed: {type(exc).__name__}: {exc}"


def _conflict_message(name: str, specs: list[BackendSpec]) -> str:
    owners = ", ".join(repr(s.plugin) for s in specs)
    return f"backend {name!r} is claimed by more than one plugin ({owners})"


def _describe(status: dict[str, str | None]) -> str:
    if not status:
        hint = " (entry point discovery is off: COLLS_DISABLE_PLUGIN_AUTOLOAD=1)"
        return "no backends are registered" + (
            hint if env.get("COLLS_DISABLE_PLUGIN_AUTOLOAD") else ""
        )
    lines = [f"  {name}: {'available' if why is None else why}" for name, why in status.items()]
    return "known backends:\n" + "\n".join(lines)


def resolve_backend(name: str) -> BackendSpec:
    """Return the spec of the usable backend called ``name`` (aliases such as gloo accepted).

    Raises:
        BackendUnavailableError: the name is unknown, claimed by two plugins, or unavailable
            here; the message lists every known backend and why the others are unusable.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__}")
    canonical = ALIASES.get(name.lower(), name.lower())
    specs = _all_specs()
    candidates = specs.get(canonical)
    if not candidates:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; {_describe(available_backends())}"
        )
    if len(candidates) > 1:
        raise BackendUnavailableError(
            f"{_conflict_message(canonical, candidates)}; {_describe(available_backends())}"
        )
    spec = candidates[0]
    reason = _availability(spec)
    if reason is not None:
        raise BackendUnavailableError(
            f"backend {canonical!r} is not available: {reason}; {_describe(available_backends())}"
        )
    return spec
