"""mkdocs hook: render the reST habits of colls' docstrings (roles, ``::``) for the site.

The docstrings name other objects the Sphinx way (``:class:`~colls.work.Work```), which Markdown
renders as the role's text followed by code. This hook turns each such role in a page's HTML into
an optional mkdocs-autorefs reference: a link when the object is on a reference page, plain code
otherwise (optional references never fail the strict build). A leading ``~`` shows only the last
component of the name, as in Sphinx. reST's "text::" before a literal block becomes "text:", and
a paragraph that is only "::" goes.
"""

from __future__ import annotations

import html
import re
from typing import Any

_ROLE = re.compile(r":(?:func|class|mod|meth|attr|exc|data|obj):<code>(~?)([\w.]+)(\(\))?</code>")
_LONE_LITERAL_MARKER = re.compile(r"<p>::</p>")
_TRAILING_LITERAL_MARKER = re.compile(r"(?<=\S)::(?=</p>)")


def _reference(match: re.Match[str]) -> str:
    short, identifier, call = match.group(1), match.group(2), match.group(3) or ""
    title = identifier.rsplit(".", 1)[-1] if short else identifier
    return (f'<autoref identifier="{html.escape(identifier)}" optional>'
            f"<code>{html.escape(title)}{call}</code></autoref>")


def on_page_content(html_text: str, **_: Any) -> str:
    """Turn the page's Sphinx roles into optional cross-references; drop reST's ``::``."""
    html_text = _LONE_LITERAL_MARKER.sub("", html_text)
    html_text = _TRAILING_LITERAL_MARKER.sub(":", html_text)
    return _ROLE.sub(_reference, html_text)
