"""The plugin contract: the hooks a colls plugin implements.

A plugin is a module (or object) with functions marked ``@colls.hookspecs.hookimpl``. It is found
through the entry point group ``colls`` of its distribution, exactly as colls' own backends are::

    # pyproject.toml of a third-party backend
    [project.entry-points.colls]
    mytransport = "my_package.colls_plugin"

and in ``my_package/colls_plugin.py``::

    from colls.backend import BackendSpec
    from colls.hookspecs import hookimpl

    @hookimpl
    def colls_backends():
        return [BackendSpec(name="mytransport", devices=("cpu",), create=MyBackend,
                            available=lambda: None)]

Setting ``COLLS_DISABLE_PLUGIN_AUTOLOAD=1`` turns entry point discovery off; plugins can still
be registered explicitly with :func:`colls.plugin_manager.register_plugin`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from colls.backend import BackendSpec

PROJECT = "colls"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def colls_backends() -> list[BackendSpec]:
    """Return the backends this plugin provides.

    Called once per process, the first time colls needs to know which backends exist (at
    ``init_process_group``, ``new_group`` or ``colls.available_backends()``), never at import.
    Keep it cheap: import heavy dependencies (mpi4py, cupy) lazily inside the spec's
    ``available`` check and ``create`` factory, not at module import.

    Returns:
        The plugin's ``colls.backend.BackendSpec`` objects, each with a unique ``name``. Two
        plugins returning the same name is an error reported when that name is used.
    """
