"""mkdocs hook: render the Sphinx roles of shardwise's docstrings as code, linked where possible.

The docstrings name other objects with Sphinx roles (``:class:`~shardwise.Group```),
which Markdown turns into the literal role followed by code: ``:class:<code>~shardwise.Group</code>``.
This hook rewrites each into the code span alone (``~`` keeps only the last
dotted part, as Sphinx does), and for a dotted name into an *optional* autorefs
cross-reference: a link when the API reference documents that object, plain code
when it does not (a private module, a relative name), never a build warning.
Sphinx-style cross-references therefore never fail ``mkdocs build --strict``;
Markdown cross-references (``[Group][shardwise.Group]``) still do when broken.
"""

from __future__ import annotations

import html
import re
from typing import Any

_ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):<code>(?P<tilde>~?)(?P<name>[\w.]+)(?P<call>\(\))?</code>"
)


def _replace(match: re.Match[str]) -> str:
    name = match["name"]
    shown = name.rsplit(".", 1)[-1] if match["tilde"] else name
    code = f"<code>{html.escape(shown)}{match['call'] or ''}</code>"
    if "." not in name:
        return code
    return f'<autoref identifier="{html.escape(name)}" optional>{code}</autoref>'


def on_page_content(html_text: str, **kwargs: Any) -> str:
    """Rewrite the roles in one page's HTML, before autorefs resolves the links (in ``on_env``)."""
    return _ROLE.sub(_replace, html_text)
