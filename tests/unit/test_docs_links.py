"""Every relative link in README.md and docs/*.md (outside code blocks) names a file or folder that exists, and a
section link a heading of its page."""

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


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*)$", text, flags=re.M):
        slug = _slug(heading.replace("`", ""))
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_section_link_names_a_heading():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    targets = [(page, target) for page in pages for target in LINK.findall(
        re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)) if "#" in target and ":" not in target]
    broken = []
    for page, target in targets:
        path, _, anchor = target.partition("#")
        linked = page.parent / path if path else page
        if linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "\n".join(broken)
    assert len(targets) > 10  # the pattern still finds section links
    assert _slug("Packing that respects documents: --pack") == "packing-that-respects-documents---pack"
