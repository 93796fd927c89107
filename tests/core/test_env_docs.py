"""docs/env.md stays true: it lists every COLLS_* setting colls.env knows, as describe() prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from colls import env

DOC = Path(__file__).resolve().parents[2] / "docs" / "env.md"


def test_every_setting_is_documented_exactly_as_describe_prints_it() -> None:
    text = DOC.read_text()
    for row in env.describe().splitlines()[2:]:
        assert row in text, f"docs/env.md lacks or has a stale row: {row}"


def test_a_malformed_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLLS_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="COLLS_TIMEOUT='-1'"):
        env.get("COLLS_TIMEOUT")
