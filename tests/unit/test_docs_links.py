"""The guide's links hold: every relative link in README.md, CHANGELOG.md and docs/*.md
names a file that exists (and, with a #fragment into a Markdown file, a heading there),
every docs page is reachable from the README, and CI runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(text: str) -> str:
    """The text a reader sees as Markdown: code blocks, code spans and comments removed."""
    return CODE_SPAN.sub("", FENCE.sub("", COMMENT.sub("", text)))


def links(text: str) -> list[str]:
    body = prose(text)
    return INLINE_LINK.findall(body) + REFERENCE_DEF.findall(body)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", COMMENT.sub("", path.read_text()))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` that does not resolve, with why."""
    problems = []
    for target in links(page.read_text()):
        if EXTERNAL.match(target):
            continue
        path_part, _, fragment = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            problems.append(f"{page.name}: {target}: no such file {resolved}")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            problems.append(f"{page.name}: {target}: no heading #{fragment} in {resolved.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert page.exists(), f"{page} is missing"
    problems = broken_links(page)
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme():
    readme = REPO / "README.md"
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(readme.read_text())
              if not EXTERNAL.match(t) and t.partition("#")[0]}
    unlinked = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked]
    assert unlinked == [], "docs pages the README's table of contents does not link"


def test_a_broken_link_or_anchor_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# A `code` heading: yes\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-code-heading-yes) [ok2](other.md#twice-1) [here](#top)\n"
        "# Top\n[gone](missing.md) [bad anchor](other.md#nope) [web](https://example.org/x)\n"
        "`[in code](missing-too.md)`\n```\n[in a block](missing-three.md)\n```\n"
        "[ref]: ./absent.md\n")
    assert broken_links(page) == [
        f"page.md: missing.md: no such file {tmp_path / 'missing.md'}",
        "page.md: other.md#nope: no heading #nope in other.md",
        f"page.md: ./absent.md: no such file {tmp_path / 'absent.md'}",
    ]


def test_ci_runs_the_readmes_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^bin/tmax-dev test(\s+#.*)?$", readme, re.MULTILINE), \
        "README lost its test command"
    assert re.search(r"^exec bin/tmax-dev test$", ci, re.MULTILINE)
