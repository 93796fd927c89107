"""The generated API reference (docs/reference/) covers every public name of ``colls``.

The reference pages list their objects one ``::: path`` directive at a time, so a name added to
``colls.__all__`` would silently miss the site. Each public name must be rendered by a directive
that names it, or one that names the module it is (``::: colls.functional``).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import colls

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"
DIRECTIVE = re.compile(r"^::: ([\w.]+)", re.MULTILINE)


def _rendered_objects() -> list[object]:
    """Import every object of the core that a reference page renders.

    The adapters' pages (colls_torch, colls_jax) are skipped: they need torch or jax, and they
    render their whole module.
    """
    objects = []
    for page in sorted(REFERENCE.glob("*.md")):
        for path in DIRECTIVE.findall(page.read_text()):
            if path.split(".")[0] != "colls":
                continue
            module_name, _, attribute = path.rpartition(".")
            try:
                objects.append(importlib.import_module(path))
            except ModuleNotFoundError:
                objects.append(getattr(importlib.import_module(module_name), attribute))
    return objects


def test_every_public_name_of_colls_is_in_the_reference() -> None:
    rendered = _rendered_objects()
    missing = [
        name for name in colls.__all__
        if name != "__version__" and not any(getattr(colls, name) is obj for obj in rendered)
    ]
    assert not missing, f"docs/reference/ renders no directive for colls.{missing}"
