"""The README stays a short read, and every relative link in README.md and docs/*.md leads somewhere.

A link's file must exist (relative to the page, or to the repository root for a leading `/`), and a `#anchor` in a
link to a markdown page (or to the page itself) must be one of that page's headings under GitHub's rules: the
heading's text, lowercased, every character other than a letter, digit, space, '-' or '_' dropped, spaces turned into
'-', and a repeated heading given '-1', '-2', ... Links inside code (fenced or indented blocks, `inline` spans) are
not links and are not checked. No launch, no torch: this file takes well under a second.
"""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

from conftest import ROOT

README_LIMIT = 6000  # characters (issue 16: a README a newcomer reads in five minutes)

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HTML_ANCHOR = re.compile(r"<a\s+[^>]*\b(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced and indented code blocks, with `inline code` spans blanked out."""
    out, fenced, previous_blank = [], False, True
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
            continue
        indented_code = previous_blank and (line.startswith("    ") or line.startswith("\t"))
        if fenced or indented_code:
            out.append("")  # an indented block goes on until a non-indented line: stay in it
            previous_blank = indented_code or previous_blank
            continue
        previous_blank = not line.strip()
        out.append(re.sub(r"(`+)(?:(?!\1).)+?\1", "", line))
    return out


def github_slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w: unicode letters, digits and '_'
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The #anchors GitHub gives page: one per heading (repeats numbered), plus explicit <a name|id="..."> ones."""
    text = page.read_text(encoding="utf-8")
    found, seen = set(), {}
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    found.update(HTML_ANCHOR.findall(text))
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline and reference-style link in page's prose."""
    out = []
    for number, line in enumerate(prose_lines(page.read_text(encoding="utf-8")), 1):
        out += [(number, m.group(1)) for m in INLINE_LINK.finditer(line)]
        m = REFERENCE_LINK.match(line)
        if m:
            out.append((number, m.group(1)))
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for number, target in links(page):
        if not target or SCHEME.match(target):  # http:, https:, mailto: ...: not this repository's
            continue
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part)
        if not path_part:
            dest = page
        elif path_part.startswith("/"):
            dest = root / path_part.lstrip("/")
        else:
            dest = (page.parent / path_part).resolve()
        where = f"{page.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file {dest}")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            problems.append(f"{where}: {dest.name} has no heading with anchor #{anchor}")
    return problems


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8"))
    assert n < README_LIMIT, f"README.md is {n} characters, the limit is {README_LIMIT}: move reference text to docs/"


def test_every_relative_link_and_anchor_resolves():
    problems = [p for page in pages() for p in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_one_click_from_the_readme():
    linked = {(ROOT / unquote(t.partition("#")[0])).resolve() for _, t in links(ROOT / "README.md")
              if not SCHEME.match(t) and t.partition("#")[0]}
    missing = [p.relative_to(ROOT).as_posix() for p in pages()[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link to: {missing}"


def test_the_checker_finds_broken_links(tmp_path):
    """The checks above can fail: a missing file, a missing anchor (in another page and in the same one) are found;
    links in code, external links, and anchors spelled by GitHub's rules are not reported."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text(
        "# Other\n\n## H200, 2026-12-01 (session 6): the `grpo.eval_path` & more\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Title\n\n## Two commands\n\n"
        "[ok](docs/other.md#h200-2026-12-01-session-6-the-grpoeval_path--more) [ok](docs/other.md#twice-1) "
        "[ok](#two-commands) [ok](https://example.com/x.md#nowhere) [ok](/docs/other.md)\n"
        "[gone](docs/missing.md) [bad anchor](docs/other.md#twice-2) [bad self](#three-commands)\n"
        "`[code](docs/missing.md)`\n\n    [indented code](docs/missing.md)\n\n"
        "```\n[fenced](docs/missing.md)\n```\n"
        "[ref]: docs/also_missing.md\n")
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 4, problems
    assert "README.md:6: docs/missing.md: no such file" in problems[0]
    assert "#twice-2" in problems[1] and "#three-commands" in problems[2]
    assert "docs/also_missing.md: no such file" in problems[3]
    assert github_slug(".deepspeed_env") == "deepspeed_env"
    assert github_slug("Recipes (`engine/recipes/*.yaml`)") == "recipes-enginerecipesyaml"
