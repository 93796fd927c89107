"""How a conformance job's rank finds the backend under test and joins the world.

``check_backend(name, plugin="my_pkg.plugin")`` tests a backend whose plugin is not installed:
every rank (and the parent, to resolve the name) registers that module before anything looks the
backend up, as pytest's ``-p`` loads a plugin by module name.
"""

from __future__ import annotations

import importlib
from typing import Final

from colls import plugin_manager
from colls.testing._checks_common import bounded

#: Seconds destroying the world (every backend's close()) may take before the job calls it hung.
LEAVE_BOUND_S: Final = 30.0


def use_plugin(module: str | None) -> None:
    """Register the plugin module ``module`` in this process unless it is already registered.

    Raises:
        ModuleNotFoundError: ``module`` cannot be imported.
    """
    if module is None:
        return
    plugin = importlib.import_module(module)
    if not plugin_manager.get_plugin_manager().is_registered(plugin):
        plugin_manager.register_plugin(plugin, name=module)


def join(backend: str, plugin: str | None, group_timeout: float) -> None:
    """Register ``plugin`` and initialise the world with ``backend`` (rank, size from the env)."""
    import colls

    use_plugin(plugin)
    colls.init_process_group(backend, timeout=group_timeout)


def leave() -> None:
    """Destroy the world if it is still initialised.

    Raises:
        AssertionError: it did not return within :data:`LEAVE_BOUND_S` (a close() that hangs
            must not hang the job: the rank reports instead).
        Exception: whatever destroy_process_group raised.
    """
    import colls

    if not colls.is_initialized():
        return
    outcome, _ = bounded(colls.destroy_process_group, LEAVE_BOUND_S,
                         "destroy_process_group() (every backend's close())")
    if isinstance(outcome, BaseException):
        raise outcome
