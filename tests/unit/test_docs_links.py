"""Every relative link in README.md and docs/*.md (outside code blocks) names a file or folder that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # code blocks hold no links
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:|#", target)]


def test_every_relative_link_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in pages for target in _links(page)
              if not (page.parent / target.split("#")[0]).exists()]
    assert not broken, "\n".join(broken)
    assert len([target for page in pages for target in _links(page)]) > 30  # the pattern still finds links
