"""The README stays a short read, every relative link in README.md and docs/*.md leads somewhere, every command they
show names files and flags that exist, and they describe the product, not how it was developed.

A link's file must exist (relative to the page, or to the repository root for a leading `/`), and a `#anchor` in a
link to a markdown page (or to the page itself) must be one of that page's headings under GitHub's rules: the
heading's text, lowercased, every character other than a letter, digit, space, '-' or '_' dropped, spaces turned into
'-', and a repeated heading given '-1', '-2', ... Links inside code (fenced or indented blocks, `inline` spans) are
not links and are not checked.

A command is a line of a code block (fenced or indented, `\\` continuations joined, `&&` chains split) that starts,
after any `NAME=value` assignments, with `deepspeed`, `python`/`python3`, `bash`, `pip` or `bin/`. Its program must
exist, every `--flag` must be one the program's argparse (or the `deepspeed` launcher's) takes, read from their source
with `ast`, and every input path must exist in the repository or be made by an earlier command of the same page
(a run directory, an export, a file under /tmp). Running them is not done here: the CPU ones take minutes each.
No launch, no torch: this file takes about a second.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import shlex
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


# ---------------------------------------------------------------------------------------------------------------------
# Commands

LAUNCHER_SOURCE = Path(importlib.util.find_spec("deepspeed").origin).parent / "launcher" / "runner.py"
PROGRAM_SOURCES = {  # the program -> the file whose argparse it runs (a bin/ wrapper imports main from engine/)
    "bin/pretrain.py": "engine/pretrain.py", "bin/grpo.py": "engine/grpo.py", "bin/zero_to_fp32": "engine/export/write.py",
    "bin/check_cluster": "engine/cluster.py", "bin/bench.py": "bin/bench.py", "bin/decode_bench.py": "bin/decode_bench.py",
}
INPUT_FLAGS = ("--deepspeed_config", "--config", "--hostfile", "--init_from", "--data")
REPO_DIRS = ("ds_configs", "engine", "hostfiles", "bin", "tests", "docs")
MADE_DIRS = ("runs/", "exported/", "/tmp/", ".cache/")
STARTS = ("deepspeed", "python", "python3", "bash", "pip")
DEV_WORDS = re.compile(r"session [0-9]|issue [0-9]|phase [A-Z]\b|build 1", re.IGNORECASE)


def argparse_flags(source: Path) -> dict[str, bool]:
    """{flag: takes a value} of every add_argument call in source."""
    flags = {}
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            action = next((k.value.value for k in node.keywords if k.arg == "action"
                           and isinstance(k.value, ast.Constant)), None)
            for a in node.args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-"):
                    flags[a.value] = action not in ("store_true", "store_false", "count")
    return flags


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a fenced or indented code block, continuations joined."""
    out, fenced, previous_blank, in_indented = [], False, True, False
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            out.append((number, line))
        elif (previous_blank or in_indented) and line.startswith("    ") and line.strip():
            in_indented = True
            out.append((number, line[4:]))
        else:
            in_indented = in_indented and not line.strip() and False
        previous_blank = not line.strip()
    joined, pending = [], None
    for number, line in out:
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line.strip())
        else:
            pending = (number, line.strip())
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1].rstrip())
            continue
        joined.append(pending)
        pending = None
    return joined


def commands(page: Path) -> list[tuple[int, list[str]]]:
    """(line number, argv) of every command on page (env assignments dropped)."""
    found = []
    for number, line in code_lines(page.read_text(encoding="utf-8")):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for part in " ".join(shlex.quote(w) if w != "&&" else "&&" for w in words).split(" && "):
            argv = shlex.split(part)
            while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
                argv = argv[1:]
            if argv and (argv[0] in STARTS or re.fullmatch(r"bin/\w[\w.]*", argv[0])):
                found.append((number, argv))
    return found


def recipe_run_dir(recipe: str) -> str | None:
    m = re.search(r"^run_dir:\s*(\S+)", (ROOT / recipe).read_text(), re.MULTILINE) if (ROOT / recipe).is_file() else None
    return m.group(1) if m else None


def check_program_args(program: str, args: list[str], where: str, made: set[str]) -> list[str]:
    """Flags against the program's argparse; input paths exist or were made earlier. Adds what this command makes."""
    problems, flags = [], argparse_flags(ROOT / PROGRAM_SOURCES[program]) if program in PROGRAM_SOURCES else None
    positional, values, i = [], {}, 0
    while i < len(args):
        a = args[i]
        if a.startswith("--") and flags is not None:
            name, eq, value = a.partition("=")
            if name not in flags:
                problems.append(f"{where}: {program} has no flag {name}")
            elif flags[name] and not eq:
                i += 1
                value = args[i] if i < len(args) else ""
            values[name] = value
        elif not a.startswith("-"):
            positional.append(a)
        i += 1
    inputs = [values[f] for f in INPUT_FLAGS if values.get(f)]
    if program == "bin/zero_to_fp32":
        inputs += positional[:1]
        made.update(positional[1:2])
    elif program.startswith("tests/scripts/") or program == "pytest":
        inputs += positional
    for path in inputs:
        problems += check_input(path, where, made)
    if program in ("bin/pretrain.py", "bin/grpo.py"):
        default = "engine/recipes/tiny.yaml" if program == "bin/pretrain.py" else "engine/recipes/grpo_tiny.yaml"
        made.add(values.get("--run_dir") or recipe_run_dir(values.get("--config") or default) or "")
    return problems


def check_input(path: str, where: str, made: set[str]) -> list[str]:
    if "$" in path or "<" in path or re.fullmatch(r"[A-Z_]+", path):  # a placeholder the reader fills in
        return []
    if path.split("/")[0] in REPO_DIRS:
        return [] if (ROOT / path).exists() else [f"{where}: {path} does not exist in the repository"]
    if path.startswith(MADE_DIRS) and not any(path == m or path.startswith(m.rstrip("/") + "/") for m in made):
        return [f"{where}: {path} is made by no earlier command on this page"]
    return []


def command_problems(page: Path) -> list[str]:
    problems, made = [], set()
    launcher = argparse_flags(LAUNCHER_SOURCE)
    for number, argv in commands(page):
        where = f"{page.relative_to(ROOT)}:{number}"
        made.update(m.group(0) for m in re.finditer(r"/tmp/[\w./-]+", " ".join(argv)))  # files a command writes
        prog, args = argv[0], argv[1:]
        if prog == "deepspeed":
            i = 0
            while i < len(args) and args[i].startswith("-"):
                name, eq, _ = args[i].partition("=")
                if name not in launcher:
                    problems.append(f"{where}: the deepspeed launcher has no flag {name}")
                elif launcher[name] and not eq:
                    i += 1
                i += 1
            prog, args = (args[i], args[i + 1:]) if i < len(args) else ("", [])
        elif prog in ("python", "python3"):
            if args[:1] == ["-c"]:
                continue
            if args[:2] == ["-m", "pytest"]:
                prog, args = "pytest", [a for a in args[2:] if not a.startswith("-") and "/" in a or a == "tests"]
            else:
                prog, args = (args[0], args[1:]) if args else ("", [])
        elif prog == "bash":
            prog, args = (args[0], []) if args else ("", [])
        elif prog == "pip":
            continue
        if prog != "pytest" and not (ROOT / prog).is_file():
            problems.append(f"{where}: the program {prog!r} does not exist")
            continue
        problems += check_program_args(prog, args, where, made)
    return problems


def test_every_documented_command_names_real_files_and_flags():
    per_page = {page.relative_to(ROOT).as_posix(): commands(page) for page in pages()}
    assert len(per_page["README.md"]) >= 7, per_page["README.md"]  # the checker does find the README's commands
    problems = [p for page in pages() for p in command_problems(page)]
    assert not problems, "\n".join(problems)


def test_the_command_checker_finds_bad_commands(tmp_path, monkeypatch):
    """A missing program, a flag the program or the launcher does not take, a missing input file and an input no
    earlier command made are found; a run dir made by an earlier command, placeholders and `python -c` are not."""
    import test_docs

    (tmp_path / "docs").mkdir()
    for d in ("bin", "engine", "ds_configs"):
        (tmp_path / d).symlink_to(ROOT / d)
    monkeypatch.setattr(test_docs, "ROOT", tmp_path)
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n"
        "    deepspeed bin/pretrain.py --deepspeed_config ds_configs/zero3.json     # -> runs/tiny\n"
        "    bin/zero_to_fp32 runs/tiny exported/tiny && bin/zero_to_fp32 exported/tiny /tmp/x\n"
        "    deepspeed --num_gpus 2 bin/grpo.py --deepspeed_config ds_configs/zero3_grpo.json --init_from runs/tiny\n"
        "    bin/zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR --dtype bf16\n"
        "    python -c \"open('/tmp/made.txt', 'w')\"\n\n"
        "```sh\n"
        "deepspeed --no_ssh_checks bin/pretrain.py --deepspeed_config ds_configs/zero4.json \\\n"
        "    --max_step 3\n"
        "bin/train.py --x\n"
        "PORT=1 deepspeed bin/grpo.py --deepspeed_config ds_configs/zero3_grpo.json --init_from runs/other\n"
        "```\n")
    problems = test_docs.command_problems(page)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "the deepspeed launcher has no flag --no_ssh_checks",
        "bin/pretrain.py has no flag --max_step",
        "ds_configs/zero4.json does not exist in the repository",
        "the program 'bin/train.py' does not exist",
        "runs/other is made by no earlier command on this page"], problems
    assert problems[0].startswith("docs/page.md:10: ")


def test_docs_describe_the_product_not_its_history():
    """No "session 7", "issue 15", "phase K", "Build 1" in README.md, docs/*.md and the records in docs/bench/."""
    found = [f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
             for page in [*pages(), *sorted((ROOT / "docs" / "bench").glob("*.md"))]
             for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1) if DEV_WORDS.search(line)]
    assert not found, "\n".join(found)
