"""The package as a user gets it: what the code imports is declared in pyproject.toml, the package data it lists
exists and is installed, the wheel installed into a clean virtualenv runs every command from outside the source
tree, a missing extra is one error line naming it, and shell completion works for both programs (issue 29).

The clean virtualenv downloads nothing: the distributions the wheel requires (its Requires-Dist, no extras) and
what they require in turn are taken from this interpreter's environment, as symbolic links in a folder on the
virtualenv's path (outside it, so pip never removes anything there) — nothing else of this environment, and not
the sources. `pip check` then proves those satisfy every requirement, versions included, and the commands prove
that the declared dependencies are all the code needs (a multi-GB torch is never fetched, and no index is needed).
"""

from __future__ import annotations

import ast
import email
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from fnmatch import fnmatch
from functools import partial
from importlib import metadata
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import REPO_ROOT
from prepkit import chat_records, text_records, write_jsonl
from trainkit import side_by_side
from xprep.cli import xprep, xtrain

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
PROJECT_PACKAGES = ("prep", "train")  # folders of the repository, xprep.prep and xprep.train installed
# Imported by the code but declared nowhere, on purpose: each with why.
UNDECLARED = {"flash-attn": "an optional CUDA kernel (train/attention.py), built for the machine's CUDA by hand"}
# Import name → distribution, for distributions that are not installed here (others are read from the metadata).
ALIASES = {"yaml": "pyyaml"}
# Signs in pip's output that the package index could not be reached: the install test then skips.
OFFLINE = ("NewConnectionError", "Name or service not known", "Temporary failure in name resolution",
           "Network is unreachable", "ConnectTimeout", "ProxyError")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: list[str]) -> set[str]:
    return {canonical(re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0]) for r in requirements}


def product_files() -> list[Path]:
    return [REPO_ROOT / "cli.py", *(p for pkg in PROJECT_PACKAGES for p in sorted((REPO_ROOT / pkg).rglob("*.py")))]


def third_party_imports(tree: ast.Module) -> list[tuple[str, bool, int]]:
    """(top-level module, whether it runs at import time outside any ``try … except ImportError``, line) of every
    import of something outside the standard library and this project."""
    found = []

    def visit(node: ast.AST, at_import_time: bool, guarded: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom) and getattr(child, "level", 0) == 0:
                names = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or ""]
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ("__future__", "xprep"):
                        found.append((top, at_import_time and not guarded, child.lineno))
            is_function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            catches_import_error = isinstance(child, ast.Try) and any(
                h.type is not None and "ImportError" in ast.unparse(h.type) for h in child.handlers)
            visit(child, at_import_time and not is_function, guarded or catches_import_error)

    visit(tree, True, False)
    return found


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    return metadata.packages_distributions()  # reads every installed distribution's file list: once


@functools.cache
def distributions_of(module: str) -> set[str]:
    installed = _packages_distributions().get(module)
    return {canonical(d) for d in installed} if installed else {canonical(ALIASES.get(module, module))}


def test_every_import_is_declared_and_every_dependency_imported():
    """An import at module level needs a core dependency, any other import a core dependency or an extra (the
    test extra does not count: a user never installs it); a core dependency nothing imports is a stale one."""
    core = requirement_names(PYPROJECT["project"]["dependencies"])
    extras = set().union(*(requirement_names(v) for k, v in PYPROJECT["project"]["optional-dependencies"].items()
                           if k != "test"))
    imported, problems = set(), []
    for path in product_files():
        for module, at_import_time, line in third_party_imports(ast.parse(path.read_text(encoding="utf-8"))):
            dists = distributions_of(module)
            imported |= dists
            where = f"{path.relative_to(REPO_ROOT)}:{line} imports {module}"
            if at_import_time and not dists & core:
                problems.append(f"{where} at import time, but {sorted(dists)} is not in [project] dependencies")
            elif not dists & (core | extras | set(UNDECLARED)):
                problems.append(f"{where}, but {sorted(dists)} is neither a dependency nor in an extra")
    stale = sorted(core - imported)
    assert not problems and not stale, problems + [f"{d} is a dependency nothing imports" for d in stale]


def folder_of(package: str) -> Path:
    """The repository folder of an installed package name: ``xprep`` is the top level, ``prep.pack`` prep/pack/."""
    parts = package.split(".")
    assert parts[0] == "xprep", f"{package}: everything installs under xprep"
    return REPO_ROOT.joinpath(*parts[1:])


def test_every_folder_of_code_and_data_is_a_listed_package():
    """pyproject.toml lists the packages by hand (the top level maps to xprep): a new folder of code or data left
    out of the list would be missing from the wheel, and a listed one that is gone fails the build."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    folders = {p.parent for top in (*PROJECT_PACKAGES, "schemas") for p in (REPO_ROOT / top).rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    wanted = {"xprep", *(".".join(("xprep", *f.relative_to(REPO_ROOT).parts)) for f in folders)}
    assert listed == wanted, (f"not listed: {sorted(wanted - listed)}", f"listed, not there: {sorted(listed - wanted)}")


def test_package_data_lists_what_exists_and_every_data_file():
    """Every package-data pattern matches a file, and every file of the packages that is not Python (HTML assets,
    JSON Schemas) is matched by one, so a wheel never silently lacks it (schemas/: config validation)."""
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]
    for package, globs in patterns.items():
        for pattern in globs:
            assert any(folder_of(package).glob(pattern)), f"package-data {package}: {pattern!r} matches no file"
    data = [p for top in (*PROJECT_PACKAGES, "schemas") for p in (REPO_ROOT / top).rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert any(p.parent.name == "schemas" for p in data)
    for path in data:
        package = ".".join(("xprep", *path.parent.relative_to(REPO_ROOT).parts))
        assert any(fnmatch(path.name, g) for g in patterns.get(package, [])), f"{path} is not in package-data"


@pytest.mark.parametrize("program,words,expected", [
    (xprep, "xprep to", "plain,tokenize"),
    (xprep, "xprep pack --me", "plain,--method"),
    (xtrain, "xtrain ex", "plain,export"),
])
def test_shell_completion(program, words, expected):
    """Click's completion protocol, as the script ``_XPREP_COMPLETE=bash_source xprep`` installs calls it."""
    name = words.split()[0]
    env = {f"_{name.upper()}_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - 1)}
    result = CliRunner().invoke(program, [], prog_name=name, env=env)
    assert result.exit_code == 0 and expected in result.output.splitlines(), result.output


# ------------------------------------------------------------------------------------------ the wheel, installed
class Installed:
    """A clean virtualenv with the wheel installed, and a working directory outside the source tree."""

    def __init__(self, venv: Path, work: Path, wheel: Path):
        self.bin = venv / "bin"
        self.wheel = wheel
        self.work = work
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        self.env.update(PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1",
                        HF_HUB_OFFLINE="1", XPREP_CACHE_DIR=str(work / "cache"))

    def run(self, program: str, *args, expect: int = 0, timeout: float = 300) -> subprocess.CompletedProcess:
        """``program ARGS`` (the virtualenv's, else the one on PATH) in the working directory; its exit must be
        ``expect``."""
        exe = self.bin / program
        proc = subprocess.run([str(exe) if exe.exists() else program, *map(str, args)], cwd=self.work, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == expect, f"{program} {' '.join(map(str, args))}: exit {proc.returncode}\n" \
                                          f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        return proc

    def python(self, code: str) -> str:
        return self.run("python", "-c", code).stdout.strip()


def _pip(*args: str, cwd: Path) -> None:
    """``python -m pip ARGS`` of this interpreter; skips the test when the package index cannot be reached."""
    proc = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if proc.returncode != 0 and any(sign in proc.stdout + proc.stderr for sign in OFFLINE):
        pytest.skip(f"pip cannot reach the package index: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, f"pip {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of the source tree (a build writes build/ and *.egg-info beside the sources)."""
    src = tmp / "src"
    shutil.copytree(REPO_ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "tests", "bench", "build", "dist", "demo", "runs", "*.egg-info", "__pycache__", ".*cache",
        ".hypothesis"))
    try:  # the build backend pyproject.toml asks for, when this interpreter has it: no download
        ours = int(metadata.version("setuptools").split(".")[0]) >= 77
    except (metadata.PackageNotFoundError, ValueError):
        ours = False
    _pip("wheel", "--no-deps", "-q", *(["--no-build-isolation"] if ours else []), "-w", str(tmp / "dist"), str(src),
         cwd=tmp)
    (wheel,) = (tmp / "dist").glob("xprep-*.whl")
    return wheel


def requirements_closure(requirements: list[str], into: Path) -> Path:
    """``into`` holding links to the installed distributions ``requirements`` name (markers evaluated, no extras)
    and, recursively, those they require."""
    from packaging.requirements import Requirement  # pytest's own dependency

    into.mkdir()
    todo, seen = [Requirement(r) for r in requirements], set()
    while todo:
        requirement = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            continue  # pip check (in the fixture) names what is missing
        if canonical(dist.metadata["Name"]) in seen:
            continue
        seen.add(canonical(dist.metadata["Name"]))
        todo += map(Requirement, dist.requires or [])
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if top != "__pycache__" and not top.endswith(".pth") and not (into / top).exists():
                (into / top).symlink_to(Path(dist.locate_file(top)))
    return into


def seed_kernel_cache(purelib: Path) -> int:
    """Copy the numba kernels this checkout has compiled (``cache=True``: files in each package's __pycache__) into
    the installed copy's __pycache__; returns how many files.

    numba keys a cached kernel by the content of its source file, so the wheel's commands load what the suite has
    compiled already instead of compiling every kernel again (~30 s on two cores: the first pack of a new install
    compiles them all); a kernel not compiled here yet, or from other source, is compiled as on a user's first run.
    """
    copied = 0
    for cached in (p for top in PROJECT_PACKAGES for p in sorted((REPO_ROOT / top).rglob("__pycache__/*.nb[ic]"))):
        into = purelib / "xprep" / cached.parent.parent.relative_to(REPO_ROOT) / "__pycache__"
        if into.parent.is_dir():
            into.mkdir(exist_ok=True)
            shutil.copyfile(cached, into / cached.name)
            copied += 1
    return copied


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    """The wheel installed in a fresh virtualenv whose only other packages are what it requires."""
    if tuple(int(x) for x in metadata.version("pip").split(".")[:2]) < (22, 3):
        pytest.skip("pip install --python needs pip 22.3 or later")
    tmp = tmp_path_factory.mktemp("install")
    wheel = build_wheel(tmp)
    venv, python = tmp / "venv", str(tmp / "venv" / "bin" / "python")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    with zipfile.ZipFile(wheel) as z:
        meta = email.message_from_bytes(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))))
    linked = requirements_closure(meta.get_all("Requires-Dist") or [], tmp / "requirements")
    (Path(purelib) / "_requirements.pth").write_text(f"{linked}\n")
    _pip("--python", python, "install", "-q", "--no-deps", "--no-compile", "--no-index", str(wheel), cwd=tmp)
    _pip("--python", python, "check", cwd=tmp)  # every requirement, versions included, satisfied by what is linked
    seed_kernel_cache(Path(purelib))
    (tmp / "work").mkdir()
    return Installed(venv, tmp / "work", wheel)


@pytest.fixture(scope="module")
def trained(installed, tiny_tokenizer) -> Installed:
    """Chat and text tokenized, packed together and trained two steps, with the installed commands."""
    work = installed.work
    write_jsonl(work / "chat.jsonl", chat_records(24))
    write_jsonl(work / "text.jsonl", text_records(60))
    side_by_side([partial(installed.run, "xprep", "tokenize", f"{name}.jsonl", "-o", name, "--tokenizer",
                          tiny_tokenizer) for name in ("chat", "text")])
    installed.run("xprep", "pack", "chat", "text", "-o", "packed", "--method", "multipack", "--seq-len", "128",
                  "--overlong", "split")
    installed.run("xtrain", "run", "packed", "--model", "tiny", "--steps", "2", "--output", "run",
                  "--log-every", "1")
    return installed


@pytest.mark.slow
def test_the_installed_wheel_runs_every_command(trained):
    """tokenize, pack and run (the fixture), inspect --html of each output, export: from the wheel alone."""
    here = trained
    assert not (here.work / "prep").exists() and REPO_ROOT not in here.work.parents
    site, pytest_spec, *where = json.loads(here.python(
        "import json, sysconfig, importlib.util, xprep.cli, xprep.prep, xprep.train.config as c; print(json.dumps("
        "[sysconfig.get_paths()['purelib'], str(importlib.util.find_spec('pytest')), xprep.cli.__file__, "
        "xprep.prep.__file__, xprep.train.__file__, str(c.SCHEMA)]))"))
    assert all(Path(p).is_relative_to(site) for p in where), where  # the installed copy, not the sources
    assert Path(where[-1]).is_file()  # schemas/train.schema.json installed: configs are validated
    assert pytest_spec == "None"  # a test dependency, not a runtime one
    pages = ("chat", "packed", "run")
    side_by_side([*(partial(here.run, "xprep", "inspect", path, "--html", f"{path}.html") for path in pages),
                  partial(here.run, "xtrain", "export", "run", "-o", "hf")])  # each checks its exit status
    for path in pages:
        assert "<html" in (here.work / f"{path}.html").read_text(encoding="utf-8")[:500].lower()
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (here.work / "hf").iterdir()}


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_name(installed):
    """Only ``xprep`` (and its .dist-info) lands in site-packages: a user's own ``train.py`` or another
    distribution's ``cli`` neither shadows nor is overwritten by this project; the scripts go to bin/."""
    with zipfile.ZipFile(installed.wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist()}
    assert tops == {"xprep", f"xprep-{PYPROJECT['project']['version']}.dist-info"}, sorted(tops)
    here = installed.run("python", "-c", "import importlib.util as u; print([m for m in ('cli', 'prep', 'train') "
                         "if u.find_spec(m)])")
    assert here.stdout.strip() == "[]", here.stdout
    shadow = installed.work / "shadow"  # a user's project: its own train.py and cli.py beside the script
    shadow.mkdir()
    for name in ("train.py", "cli.py", "prep.py"):
        (shadow / name).write_text("raise SystemExit('the user module was imported')\n")
    proc = subprocess.run([str(installed.bin / "python"), "-c", "from xprep.train.data import PackedDataset; "
                           "from xprep.cli import xtrain; print('ok')"], cwd=shadow, env=installed.env,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.slow
def test_a_missing_extra_is_one_line_naming_it(trained, tiny_tokenizer):
    """Each optional feature, run where its package is absent (as in this clean virtualenv): exit 2 and one line
    saying what to install. Features whose package a dependency brought in anyway are not asked (PyYAML is
    one: tokenizers requires huggingface_hub, which requires it); --log wandb fails as --log tensorboard does."""
    here = trained
    (here.work / "hf-model").mkdir(exist_ok=True)
    (here.work / "hf-model" / "config.json").write_text("{}")
    cases = {
        "transformers": (["xtrain", "run", "packed", "--model", "hf:hf-model", "--output", "r1"], "xprep[hf]"),
        "tensorboard": (["xtrain", "run", "packed", "--log", "tensorboard", "--output", "r2"], "xprep[tensorboard]"),
        "matplotlib": (["xprep", "inspect", "run", "--plot", "loss.png"], "xprep[plot]"),
        "ray": (["xprep", "tokenize", "chat.jsonl", "-o", "r4", "--tokenizer", tiny_tokenizer, "--ray", "auto"],
                "xprep[ray]"),
        "s3fs": (["xprep", "tokenize", "s3://bucket/chat.jsonl", "-o", "r5", "--tokenizer", tiny_tokenizer], "s3fs"),
    }
    absent = json.loads(here.python(f"import importlib.util as u, json; print(json.dumps([m for m in {list(cases)!r}"
                                    " if u.find_spec(m) is None]))"))
    assert "transformers" in absent and "matplotlib" in absent, absent
    refused = side_by_side([partial(here.run, *cases[module][0], expect=2) for module in absent])
    for module, proc in zip(absent, refused, strict=True):
        lines, hint = proc.stderr.strip().splitlines(), cases[module][1]
        assert len(lines) == 1 and lines[0].startswith("error: ") and hint in lines[0], (module, lines)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_installed_bash_completion(installed):
    """README's `eval "$(_XPREP_COMPLETE=bash_source xprep)"`, then a Tab after a partial word, for both programs."""
    for name, words, expected in (("xprep", "xprep insp", "inspect"), ("xtrain", "xtrain run --sa", "--sampler")):
        script = (f'eval "$(_{name.upper()}_COMPLETE=bash_source {name})"; COMP_WORDS=({words}); '
                  f'COMP_CWORD={len(words.split()) - 1}; _{name}_completion {name}; printf "%s\\n" "${{COMPREPLY[@]}}"')
        out = installed.run("bash", "-c", script).stdout.split()
        assert expected in out, (name, out)
