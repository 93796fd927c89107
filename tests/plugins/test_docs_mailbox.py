"""The minimal backend of docs/plugins.md is real: taken from the page, it passes the suite.

The code block under "A complete minimal backend" is written to a module and tested through
``check_backend(plugin=...)``, uninstalled, as the page tells authors to. Its dead-peer
declaration (``"timeout"``) is checked by storemail's full run (test_third_party.py), which
declares the same; this run leaves the four dead-peer jobs out to keep CI short.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from colls.testing import check_backend
from colls.testing.conformance import ALL_CHECKS, DEAD_PEER, SHRINK

PAGE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
SECTION = "## A complete minimal backend"
JOB_TIMEOUT_S = 150


def mailbox_source() -> str:
    """Return the first Python block of the page's minimal-backend section."""
    text = PAGE.read_text()
    section = text[text.index(SECTION):]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, f"no python block under {SECTION!r} in {PAGE}"
    return match.group(1)


def test_the_example_is_short() -> None:
    """The page promises about 60 lines: the Matcher does the receive side."""
    assert len(mailbox_source().splitlines()) <= 65


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_the_mailbox_example_passes_the_conformance_suite(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "mailbox_backend.py").write_text(mailbox_source())
    monkeypatch.syspath_prepend(str(tmp_path))  # the ranks get the parent's sys.path
    checks = [name for name in ALL_CHECKS if name not in (DEAD_PEER, SHRINK)]
    check_backend("mailbox", world_sizes=(3,), quick=True, checks=checks,
                  plugin="mailbox_backend", timeout=JOB_TIMEOUT_S)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith(f"check_backend('mailbox'): passed {len(checks)} checks ("), summary
    assert "dead peers: not checked (not among the checks)" in summary, summary


def test_plugin_must_be_a_module_name() -> None:
    with pytest.raises(TypeError, match=r"check_backend: plugin must be a module name, got 3"):
        check_backend("tcp", plugin=3)  # type: ignore[arg-type]
