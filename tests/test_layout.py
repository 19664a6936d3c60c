"""The shape of the code, read from its imports and environment reads with ``ast`` (issues 10 and 32).

Every module of the product is walked under its installed name: ``xprep`` (the repository root's __init__.py, the
Python API), ``xprep.cli``, every module of prep/ at any depth (``xprep.prep.pack.kernels``) and of train/. Checked:
no import loop; prep/ never imports train/; the stages of prep/ import each other only in the direction of the
pipeline (``STAGES``), and only through a stage's package and the names its ``__all__`` exports; an import inside a
function only for an optional or deliberately deferred dependency, with its reason written beside it; no environment
variable is read but the documented ones (``DOCUMENTED_ENV``); and the tests mirror the stages, no test module
importing another folder's.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from conftest import REPO_ROOT

TOP = "xprep"
PREP = f"{TOP}.prep"
TRAIN = f"{TOP}.train"
# The stages of prep/ (one subpackage each) and the stages each may import: the pipeline's direction.
STAGES = {
    "sources": set(),
    "tokenizer": set(),
    "dataset": set(),
    "chat": {"tokenizer"},
    "tokenize": {"sources", "tokenizer", "chat", "dataset"},
    "pack": {"dataset"},
    "inspect": {"dataset", "pack"},
}
ENV_DOC = "docs/environment.md"
# Every environment variable (or prefix*) the product reads, and the page that documents it.
DOCUMENTED_ENV = {
    "XPREP_CACHE_DIR": ENV_DOC,
    "XPREP_CACHE": ENV_DOC,  # the dataset-copy cache's older name, read after XPREP_CACHE_DIR
    "XDG_CACHE_HOME": ENV_DOC,
    "RAY_ADDRESS": ENV_DOC,
    **{prefix: ENV_DOC for prefix in ("AWS_*", "FSSPEC_*", "GOOGLE_*", "GCS_*", "AZURE_*")},  # to Ray's tasks
    "XTRAIN_DEVICE": ENV_DOC,
    "XTRAIN_DIST_TIMEOUT": ENV_DOC,
    "XTRAIN_CKPT_TIMEOUT": ENV_DOC,
    "WANDB_PROJECT": ENV_DOC,
    "WANDB_DIR": ENV_DOC,
    "OMP_NUM_THREADS": ENV_DOC,
    "PYTORCH_CUDA_ALLOC_CONF": ENV_DOC,
    "PYTORCH_ALLOC_CONF": ENV_DOC,
    "CUDA_VISIBLE_DEVICES": ENV_DOC,
    # internal: set for the ranks by xtrain run's launcher (train/launch.py) or torchrun
    "RANK": ENV_DOC,
    "WORLD_SIZE": ENV_DOC,
    "LOCAL_RANK": ENV_DOC,
    "LOCAL_WORLD_SIZE": ENV_DOC,
    "TORCHELASTIC_RUN_ID": ENV_DOC,
    "XTRAIN_LAUNCHER_PID": ENV_DOC,
    "XTRAIN_STOP_FILE": ENV_DOC,
}


# ------------------------------------------------------------------------------------------ the modules
def modules() -> dict[str, Path]:
    """Every module of the product by installed name: xprep, xprep.cli, xprep.prep.* and xprep.train.* (any depth)."""
    found = {TOP: REPO_ROOT / "__init__.py", f"{TOP}.cli": REPO_ROOT / "cli.py"}
    for folder in ("prep", "train"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            found[".".join((TOP, *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return found


@functools.cache  # every test walks the same files
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def imports(tree: ast.AST) -> list[tuple[str, list[str], int]]:
    """(module, names taken from it, line) of every import anywhere in the module (functions and TYPE_CHECKING
    blocks too); ``import a.b`` takes no name. A module-level ``_EXPORTS`` table of name → module (the root
    package's lazy API) counts as importing each name from its module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.module or "", [alias.name for alias in node.names], node.lineno))
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_EXPORTS"]:
            table = ast.literal_eval(node.value)
            found += [(module, [name], node.lineno) for name, module in table.items()]
    return found


def targets(module: str, names: list[str], known: set[str]) -> set[str]:
    """The project modules an import needs: each name that is a submodule (``from xprep.prep.chat import fast``
    needs the package only to exist, not to have run), and the module itself for any other name."""
    subs = {f"{module}.{n}" for n in names} & known
    return subs | ({module} & known if len(subs) < len(names) or not names else set())


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: set().union(*(targets(m, ns, known) for m, ns, _ in imports(parse(path)))) - {name}
            for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import loop, each as the path that closes it (depth-first search)."""
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_the_walk_reaches_every_stage_and_their_inner_modules():
    """Nothing of prep/ is left unchecked: every stage is walked, down to its deepest modules (the glob of
    ``prep/*.py`` this test once used saw none of them)."""
    mods = modules()
    for stage in STAGES:
        assert f"{PREP}.{stage}" in mods, stage
    assert {f"{PREP}.tokenize.ray.cluster", f"{PREP}.pack.kernels", f"{TRAIN}.trainer", f"{TOP}.cli", TOP} <= set(mods)
    assert len(mods) == len({*(REPO_ROOT / "prep").rglob("*.py"), *(REPO_ROOT / "train").rglob("*.py")}) + 2


def test_the_import_graph_has_no_loop():
    loops = cycles(graph())
    assert not loops, "import loops: " + "; ".join(" → ".join(loop) for loop in loops)


def test_prep_never_imports_train():
    wrong = {name: sorted(t for t in found if t.startswith(TRAIN)) for name, found in graph().items()
             if name.startswith(PREP) and any(t.startswith(TRAIN) for t in found)}
    assert not wrong, f"prep/ imports train/: {wrong}"


# ------------------------------------------------------------------------------------------ the stages
def stage_of(module: str) -> str | None:
    """The stage a module belongs to (xprep.prep.pack.kernels → pack); None outside the stages."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and module.startswith(f"{PREP}.") and parts[2] in STAGES else None


def exported(package: Path) -> set[str]:
    """The names a stage's __init__.py lists in ``__all__``."""
    for node in parse(package).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            return set(ast.literal_eval(node.value))
    return set()


def stage_violations(module: str, tree: ast.AST, surfaces: dict[str, set[str]]) -> list[str]:
    """How ``module`` breaks the stage rules: an import of another stage against the pipeline's direction, past
    its package (an inner module), or of a name its ``__all__`` does not export. Inside a stage anything goes."""
    own, wrong = stage_of(module), []
    for target, names, line in imports(tree):
        if target == PREP:  # from xprep.prep import pack: the stage package itself, as a module object
            wrong += [f"{module}:{line} imports {PREP}.{n}: import the names, from {PREP}.{n} import ..."
                      for n in names if n in STAGES and n != own]
            continue
        stage = stage_of(target)
        if stage is None or stage == own:
            continue
        where = f"{module}:{line} imports {target}"
        if own is not None and stage not in STAGES[own]:
            wrong.append(f"{where}: stage {own} may import only {sorted(STAGES[own]) or 'no other stage'}")
        if target != f"{PREP}.{stage}":
            wrong.append(f"{where}: an inner module of stage {stage}; import from {PREP}.{stage}")
        elif not names:
            wrong.append(f"{where}: import the names, from {PREP}.{stage} import ...")
        elif set(names) - surfaces[stage]:
            wrong.append(f"{where}: {sorted(set(names) - surfaces[stage])} not in {PREP}.{stage}.__all__")
    return wrong


def test_stages_import_each_other_through_their_packages_in_the_pipeline_s_direction():
    """sources, tokenizer, dataset import no other stage; chat only tokenizer; tokenize only sources, tokenizer, chat
    and dataset; pack only dataset; inspect only dataset and pack. Any other stage, train/, cli.py and the API import
    a stage only from its package (``from xprep.prep.dataset import TokenDataset``), only names in its __all__."""
    mods = modules()
    surfaces = {stage: exported(mods[f"{PREP}.{stage}"]) for stage in STAGES}
    wrong = [v for name, path in mods.items() for v in stage_violations(name, parse(path), surfaces)]
    assert not wrong, "\n".join(wrong)


def test_the_stage_table_is_the_stages():
    """Every subpackage of prep/ is a stage of the table (a new one is placed in the pipeline's order here)."""
    packages = {p.parent.name for p in (REPO_ROOT / "prep").glob("*/__init__.py")}
    assert packages == set(STAGES)


def test_shared_helpers_that_use_a_stage_are_used_by_none():
    """prep/'s top-level modules are the helpers every stage may use (errors, io, …): one that imports a stage
    (demo) must be imported by no stage, or the pipeline's direction would be broken through it."""
    edges = graph()
    helpers = {name for name in edges if name.startswith(f"{PREP}.") and name.count(".") == 2 and not stage_of(name)}
    using = {h for h in helpers if any(stage_of(t) for t in edges[h])}
    wrong = sorted(f"{name} imports {h}" for name, found in edges.items() if stage_of(name) for h in found & using)
    assert not wrong, wrong


# ------------------------------------------------------------------------------------------ imports in functions
def function_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run inside a function body (where import ties hide)."""
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            found += [n for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)]
    return list({id(n): n for n in found}.values())


def has_reason(lines: list[str], node: ast.stmt, spans: set[int]) -> bool:
    """A comment on the import's own lines, on an import of the block it belongs to above it, or on the line above
    that block. ``spans``: the (0-based) lines that import statements take (multi-line ones included)."""
    if any("#" in lines[row] for row in range(node.lineno - 1, node.end_lineno)):
        return True
    row = node.lineno - 2
    while row >= 0 and row in spans:
        if "#" in lines[row]:
            return True
        row -= 1
    return row >= 0 and lines[row].strip().startswith("#")


def import_spans(nodes: list[ast.stmt]) -> set[int]:
    return {row for n in nodes for row in range(n.lineno - 1, n.end_lineno)}


def test_imports_inside_functions_say_why():
    """Only optional dependencies and heavy imports deferred on purpose, each with a one-line reason;
    never a project module outside the CLI (that is how import loops hide)."""
    unexplained, hidden_ties = [], []
    for name, path in modules().items():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        nodes = function_imports(parse(path))
        spans = import_spans(nodes)
        for node in nodes:
            where = f"{path.relative_to(REPO_ROOT)}:{node.lineno}"
            if not has_reason(lines, node, spans):
                unexplained.append(where)
            found = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if name != f"{TOP}.cli" and any(m == TOP or m.startswith(f"{TOP}.") for m in found):
                hidden_ties.append(where)
    assert not hidden_ties, f"project modules imported inside functions: {hidden_ties}"
    assert not unexplained, f"imports inside functions without a reason comment: {unexplained}"


# ------------------------------------------------------------------------------------------ the environment
class _EnvReads(ast.NodeVisitor):
    """The environment variables a module reads: ``os.environ[K]``, ``os.environ.get(K)`` (``.pop``,
    ``.setdefault``), ``os.getenv(K)``, ``K in os.environ``, and ``PREFIX*`` for a walk over ``os.environ`` kept
    by ``k.startswith(PREFIX)``. K is a string, a module constant (a string or a tuple of them, also imported from
    another project module), or a loop variable over such a tuple. ``{**os.environ}`` (the environment handed on
    whole to a child process) reads nothing by name; any other use is reported as unreadable, so nothing hides."""

    def __init__(self, resolve):
        self.resolve = resolve  # a name → its string values (None: not a constant)
        self.found: set[str] = set()
        self.unreadable: list[int] = []
        self.loops: dict[str, tuple[str, ...] | None] = {}  # loop variable → the values it takes
        self.seen: set[int] = set()  # the os.environ nodes accounted for

    @staticmethod
    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
                and node.value.id == "os")

    def walked(self, iterable: ast.AST) -> ast.AST | None:
        """The os.environ a loop walks (``os.environ``, ``.items()``, ``.keys()``), else None."""
        if self.is_environ(iterable):
            return iterable
        if (isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Attribute)
                and self.is_environ(iterable.func.value)):
            return iterable.func.value
        return None

    def values(self, node: ast.AST | None) -> tuple[str, ...] | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return (node.value,)
        if isinstance(node, ast.Name):
            return self.loops[node.id] if node.id in self.loops else self.resolve(node.id)
        if isinstance(node, ast.Tuple | ast.List):
            parts = [self.values(e) for e in node.elts]
            return None if None in parts else tuple(v for p in parts for v in p)
        return None

    def read(self, environ: ast.AST, key: ast.AST | None, line: int) -> None:
        self.seen.add(id(environ))
        keys = self.values(key)
        if keys is None:
            self.unreadable.append(line)
        else:
            self.found |= set(keys)

    def visit_For(self, node):  # noqa: N802 - ast.NodeVisitor's names
        if isinstance(node.target, ast.Name):
            self.loops[node.target.id] = self.values(node.iter)
        self.generic_visit(node)

    def _comprehension(self, node):
        for gen in node.generators:
            environ = self.walked(gen.iter)
            if environ is None:
                if isinstance(gen.target, ast.Name):
                    self.loops[gen.target.id] = self.values(gen.iter)
                continue
            self.seen.add(id(environ))
            prefixes = [self.values(c.args[0]) for cond in gen.ifs for c in ast.walk(cond)
                        if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                        and c.func.attr == "startswith" and c.args]
            if not prefixes or None in prefixes:
                self.unreadable.append(node.lineno)
            else:
                self.found |= {f"{p}*" for values in prefixes for p in values}
        self.generic_visit(node)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension  # noqa: N815

    def visit_Subscript(self, node):  # noqa: N802
        if self.is_environ(node.value):
            if isinstance(node.ctx, ast.Load):
                self.read(node.value, node.slice, node.lineno)
            else:  # a write
                self.seen.add(id(node.value))
        self.generic_visit(node)

    def visit_Call(self, node):  # noqa: N802
        func = node.func
        if isinstance(func, ast.Attribute) and self.is_environ(func.value):
            if func.attr in ("get", "pop", "setdefault"):
                self.read(func.value, node.args[0] if node.args else None, node.lineno)
            elif func.attr == "update":  # a write
                self.seen.add(id(func.value))
        elif (isinstance(func, ast.Attribute) and func.attr == "getenv" and isinstance(func.value, ast.Name)
              and func.value.id == "os"):
            self.read(func, node.args[0] if node.args else None, node.lineno)
        self.generic_visit(node)

    def visit_Compare(self, node):  # noqa: N802
        for op, right in zip(node.ops, node.comparators, strict=True):
            if isinstance(op, ast.In | ast.NotIn) and self.is_environ(right):
                self.read(right, node.left, node.lineno)
        self.generic_visit(node)

    def visit_Dict(self, node):  # noqa: N802
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None and self.is_environ(value):  # {**os.environ, ...}: handed on whole
                self.seen.add(id(value))
        self.generic_visit(node)


def constants(tree: ast.Module) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, str]]]:
    """A module's string constants by name (``X = "A"``, ``X = ("A", "B")``), and the names it imports from
    project modules (name → (module, name there))."""
    values, imported = {}, {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            if isinstance(value, str):
                values[node.targets[0].id] = (value,)
            elif isinstance(value, tuple | list) and value and all(isinstance(v, str) for v in value):
                values[node.targets[0].id] = tuple(value)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(TOP):
            imported.update({alias.asname or alias.name: (node.module, alias.name) for alias in node.names})
    return values, imported


def env_reads(trees: dict[str, ast.Module]) -> dict[str, tuple[set[str], list[int]]]:
    """Per module: the variables (and PREFIX*) it reads, and the lines of the reads it does not name plainly."""
    tables = {name: constants(tree) for name, tree in trees.items()}

    def resolve(module: str, name: str) -> tuple[str, ...] | None:
        values, imported = tables.get(module, ({}, {}))
        if name in values:
            return values[name]
        return resolve(*imported[name]) if name in imported else None  # (import loops are refused above)

    out = {}
    for name, tree in trees.items():
        visitor = _EnvReads(lambda constant, module=name: resolve(module, constant))
        visitor.visit(tree)
        stray = [n.lineno for n in ast.walk(tree) if _EnvReads.is_environ(n) and id(n) not in visitor.seen]
        stray += [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "os"
                  and {a.name for a in n.names} & {"environ", "getenv"}]
        out[name] = (visitor.found, sorted(visitor.unreadable + stray))
    return out


def test_no_environment_variable_is_read_but_the_documented_ones():
    """Every variable the product reads is in ``DOCUMENTED_ENV`` (or being removed), every one listed is still
    read, and the page named for it documents it: configuration is options, and the few variables are on one page."""
    reads = env_reads({name: parse(path) for name, path in modules().items()})
    unreadable = [f"{name}: line {line}" for name, (_, lines) in reads.items() for line in lines]
    assert not unreadable, f"environment reads this test cannot read (name the variable plainly): {unreadable}"
    read = {var: sorted(name for name, (found, _) in reads.items() if var in found)
            for var in set().union(*(found for found, _ in reads.values()))}
    undocumented = {var: where for var, where in read.items() if var not in DOCUMENTED_ENV}
    assert not undocumented, f"environment variables read but not documented (add them to {ENV_DOC}): {undocumented}"
    assert not set(DOCUMENTED_ENV) - set(read), f"documented but no longer read: {set(DOCUMENTED_ENV) - set(read)}"
    for var, page in DOCUMENTED_ENV.items():
        assert f"`{var}`" in (REPO_ROOT / page).read_text(encoding="utf-8"), f"{page} does not document {var}"


# ------------------------------------------------------------------------------------------ the tests
def collect_tests() -> dict[Path, ast.Module]:
    return {path: parse(path) for path in sorted((REPO_ROOT / "tests").rglob("test_*.py"))}


def test_no_test_module_imports_another_folder_s():
    """A test module may use the shared kits (tests/*kit.py, conftest) and its own folder's test modules, never
    another folder's: tests mirror the code, and a folder's tests move with it."""
    tests = collect_tests()
    by_stem: dict[str, list[Path]] = {}
    for path in tests:
        by_stem.setdefault(path.stem, []).append(path)
    wrong = []
    for path, tree in tests.items():
        for module, _, line in imports(tree):
            top = module.split(".")[0]
            if top in by_stem and path.parent / f"{top}.py" not in tests:
                wrong.append(f"{path.relative_to(REPO_ROOT)}:{line} imports {top} "
                             f"({', '.join(str(p.relative_to(REPO_ROOT)) for p in by_stem[top])})")
    assert not wrong, wrong


def test_tests_mirror_the_stages():
    """Every folder of tests/prep/ is named after a stage (its tests are found by path)."""
    folders = {p.name for p in (REPO_ROOT / "tests" / "prep").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders and not folders - set(STAGES), f"tests/prep/ folders that are no stage: {folders - set(STAGES)}"


# ------------------------------------------------------------------------------------------ the checker itself
def test_the_checker_finds_what_it_looks_for():
    """The helpers above catch what they look for (they would pass vacuously else)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    source = ("def f():\n    import json\n    # optional\n    import yaml\n    import zlib  # deferred\n"
              "    from a import (\n        b,  # deferred here and below\n    )\n    import c\n")
    tree = ast.parse(source)
    nodes = function_imports(tree)
    assert [has_reason(source.splitlines(), n, import_spans(nodes)) for n in nodes] == [False, True, True, True, True]

    surfaces = {stage: set() for stage in STAGES} | {"dataset": {"TokenDataset"}, "tokenizer": {"Encoder"}}
    code = ("from xprep.prep.dataset import TokenDataset, secret\nfrom xprep.prep.dataset.indexed import x\n"
            "from xprep.prep.tokenizer import Encoder\nimport xprep.prep.dataset\n")
    wrong = stage_violations(f"{PREP}.pack.blend", ast.parse(code), surfaces)
    assert [w.split(": ", 1)[1] for w in wrong] == [
        "['secret'] not in xprep.prep.dataset.__all__", "an inner module of stage dataset; import from "
        "xprep.prep.dataset", "stage pack may import only ['dataset']", "import the names, from xprep.prep.dataset "
        "import ..."]
    assert [w.split(": ", 1)[1] for w in stage_violations(f"{PREP}.dataset.merge", ast.parse(code), surfaces)] == [
        "stage dataset may import only no other stage"]  # inside its own stage anything goes
    wrong = stage_violations(f"{TRAIN}.data", ast.parse("from xprep.prep import errors, pack\n"), surfaces)
    assert [w.split(": ", 1)[1] for w in wrong] == ["import the names, from xprep.prep.pack import ..."]
    assert not stage_violations(f"{PREP}.dataset.merge", ast.parse("from xprep.prep.dataset.indexed import x\n"),
                                surfaces)

    code = ('import os\nfrom xprep.lib import PARENT\nNAMES = ("A", "B")\nKEY = "C"\n'
            'os.environ["D"]\nos.environ.get(KEY)\nos.getenv("E", "1")\nany(k in os.environ for k in NAMES)\n'
            'PARENT in os.environ\n{k: v for k, v in os.environ.items() if k.startswith(("AWS_", "GCS_"))}\n'
            'env = {**os.environ, "X": "1"}\nos.environ["Y"] = "1"\nos.environ.update(env)\n'
            'os.environ.get(compute())\nalias = os.environ\n')
    lib = ast.parse('PARENT = "F"\n')
    found, unreadable = env_reads({"xprep.m": ast.parse(code), "xprep.lib": lib})["xprep.m"]
    assert found == {"A", "B", "C", "D", "E", "F", "AWS_*", "GCS_*"} and unreadable == [14, 15]
