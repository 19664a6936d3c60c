"""The documentation: a short README, pages whose links resolve, no lab-notebook references, every option documented.

README.md gets a newcomer running; docs/*.md is the reference. Every option of every ``xprep`` and ``xtrain``
command (walked from the click groups in xprep.cli) must appear on that command's page, so a new option fails
here until it is documented.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import click
import pytest
from conftest import REPO_ROOT
from xprep.cli import xprep, xtrain

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
README_MAX_LINES = 200
# command → the page that documents it; a command missing here fails test_every_command_has_a_page
PAGES = {
    "xprep tokenize": "docs/tokenize.md",
    "xprep merge": "docs/merge.md",
    "xprep pack": "docs/pack.md",
    "xprep inspect": "docs/inspect.md",
    "xtrain run": "docs/train.md",
    "xtrain export": "docs/export.md",
}
# Pages other engineers write; linked to before they exist. Once a page exists its links and anchors are checked.
PENDING_PAGES = {"docs/api.md", "docs/environment.md"}
DATED_PAGES = {"docs/benchmarks.md"}  # the one page whose figures carry the machine and the date they were measured

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
# "issue 31", "#31" (not a link's "](#anchor)"), "owner/repo#31", "pytorch#155915", ".../pull/31", "PR 31", "wave"
ISSUE = re.compile(r"\bissues?\s*#?\d+|(?<![\w/-])(?<!\]\()#\d+\b|\b\w+#\d{2,}\b|\b(?:issues|pull)/\d+|\bPR\s*#?\d+"
                   r"|\bwaves?\b", re.I)
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b(?![T ]\d)")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


def prose(text: str) -> str:
    """The text without fenced code blocks (links and headings inside them are not links or headings)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a page's headings, with GitHub's -1, -2, … for repeated ones."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose(path.read_text(encoding="utf-8")), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def commands() -> list[tuple[str, click.Command]]:
    """Every command of both programs, walked from the click groups (``xprep tokenize``, …, ``xtrain run``)."""
    found = []
    for group in (xprep, xtrain):
        for name, command in sorted(group.commands.items()):
            found.append((f"{group.name} {name}", command))
    return found


def option_names(command: click.Command) -> list[str]:
    """Every name of every visible option: long names and their --no- forms; a short name only when it is all."""
    names = []
    for param in command.params:
        if not isinstance(param, click.Option) or param.hidden:
            continue
        every = [*param.opts, *param.secondary_opts]
        long = [n for n in every if n.startswith("--")]
        names += long or every
    return names


def mentions(text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def commit_prefixes() -> set[str] | None:
    """The repository's commit hashes (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "log", "--all", "--format=%H"], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return set(out.split())


# ------------------------------------------------------------------------------------------------ tests
def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it ≤ {README_MAX_LINES}, the rest in docs/"


def test_the_readme_has_a_table_of_contents_of_its_sections():
    text = README.read_text(encoding="utf-8")
    sections = re.findall(r"^## (.+)$", prose(text), re.M)
    contents = [s for s in sections if s.lower() == "contents"]
    assert contents, "README.md: no '## Contents' section"
    toc = prose(text).split("## Contents", 1)[1].split("\n## ", 1)[0]
    linked = set(LINK.findall(toc))
    missing = [s for s in sections if s.lower() != "contents" and f"#{slug(s)}" not in linked]
    assert not missing, f"README.md: sections not in its table of contents: {missing}"


def test_every_page_is_reachable_from_the_readme():
    linked = {(README.parent / target.split("#")[0]).resolve() for target in LINK.findall(prose(README.read_text()))}
    unlinked = [rel(p) for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"pages the README does not link to: {unlinked}"


@pytest.mark.parametrize("page", pages(), ids=rel)
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, …
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page.resolve()
        if not file.exists():
            if file.is_relative_to(REPO_ROOT) and rel(file) in PENDING_PAGES:
                continue
            broken.append(f"{target} (no {file})")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target} (no heading #{anchor} in {file.name})")
    assert not broken, f"{rel(page)}: broken links: {broken}"


@pytest.mark.parametrize("page", pages(), ids=rel)
def test_no_page_names_an_issue_a_commit_or_a_date(page):
    text = page.read_text(encoding="utf-8")
    refs = sorted({m.group(0) for m in ISSUE.finditer(text)})
    assert not refs, f"{rel(page)} refers to issues or work history: {refs}; say what the code does instead"
    hashes = commit_prefixes()
    if hashes is not None:
        named = sorted({h for h in HEX.findall(text) if any(c.startswith(h) for c in hashes)})
        assert not named, f"{rel(page)} names commits {named}; design history belongs in commit messages"
    if rel(page) not in DATED_PAGES:
        dates = sorted(set(DATE.findall(text)))
        assert not dates, f"{rel(page)} has dates {dates}: dated figures belong in docs/benchmarks.md"


def test_every_command_has_a_page():
    missing = [name for name, _ in commands() if name not in PAGES]
    assert not missing, f"commands without a page in PAGES: {missing}; write docs/<command>.md and map it here"
    for name, page in PAGES.items():
        assert (REPO_ROOT / page).is_file(), f"{name}: {page} is missing"


@pytest.mark.parametrize("name,command", commands(), ids=[name for name, _ in commands()])
def test_every_option_is_on_its_commands_page(name, command):
    page = REPO_ROOT / PAGES.get(name, "docs/missing.md")
    text = page.read_text(encoding="utf-8") if page.is_file() else ""
    missing = [option for option in option_names(command) if not mentions(text, option)]
    assert not missing, f"{name}: options missing from {rel(page)}: {missing}"


def test_the_programs_own_options_are_in_the_readme_or_a_page():
    text = "\n".join(p.read_text(encoding="utf-8") for p in pages())
    missing = [f"{group.name} {option}" for group in (xprep, xtrain) for option in option_names(group)
               if not mentions(text, option)]
    assert not missing, f"group options documented nowhere: {missing}"


@pytest.mark.parametrize("stage", ["sources", "tokenizer", "chat", "tokenize", "dataset", "pack", "inspect"])
def test_the_architecture_table_lists_each_stages_modules_and_surface(stage):
    """docs/architecture.md's row of a stage names every module of it and exactly its ``__all__``: the page a new
    engineer reads first stays the code's."""
    import importlib

    page = (DOCS / "architecture.md").read_text(encoding="utf-8")
    row = re.search(rf"^\| \[`prep/{stage}/`\]\(\.\./prep/{stage}\) \| (.*?) \| .*? \| (.*?) \|$", page, flags=re.M)
    assert row, f"docs/architecture.md has no row for prep/{stage}/"
    root = REPO_ROOT / "prep" / stage
    modules = {p.relative_to(root).as_posix() for p in root.rglob("*.py")
               if p.name != "__init__.py" and "__pycache__" not in p.parts}
    listed = set(re.findall(r"`([^`]+)`", row.group(1))) - {"assets/"}
    assert listed == modules, (f"not listed: {sorted(modules - listed)}", f"listed, gone: {sorted(listed - modules)}")
    surface = set(importlib.import_module(f"xprep.prep.{stage}").__all__)
    shown = set(re.findall(r"`([^`]+)`", row.group(2)))
    assert shown == surface, (f"not shown: {sorted(surface - shown)}", f"not exported: {sorted(shown - surface)}")
