"""The shape of the code, read statically: the import graph of lmjax/ and pallas_kernels/.

Pure `ast` (nothing is imported, JAX least of all); the whole check costs about 0.3 s.

The graph. Every `import` and `from ... import` counts, function-local ones included, with
relative imports resolved; `from a import b` where `a.b` is a module is an edge to `a.b`, else
an edge to `a` taking the name `b`. A module reached by string (`importlib.import_module("x")`,
`sys.modules["x"]`) counts as imported too. Importing `a.b.c` is an edge to `a.b.c` only: the
parent packages it also runs are not edges (a package's `__init__` re-exporting its own
submodules would otherwise make every package a cycle).

The rules (DESIGN.md, "Layers, and which way imports point"; issue 21):

- cycle: no strongly connected component of more than one module.
- private-module: a module with a `_private` component (`lmjax.ops._common`) is imported only
  by the package that holds that component and the modules under it (`lmjax.ops`,
  `lmjax.ops.linear`, ...).
- private-name: a `_private` name (not a `__dunder__`) of a module is used only inside that
  module: neither `from m import _x` nor `m._x` on an imported module `m`, from anywhere else,
  the module's own package `__init__` included.
- sys-modules: no module is looked up in `sys.modules`; import it.
- layers: every package sits in one tier of `LAYERS` (DESIGN.md's list, with `lmjax.data` below
  `lmjax.train` and `lmjax.finetune` above it: issue 35), and an import points to its own tier or
  a lower one; a module in no tier is a violation too, so a new package is placed on purpose.
- ops-imports: lmjax/ops imports nothing of lmjax or pallas_kernels except `lmjax.errors`,
  `lmjax.checks` and `lmjax.ops` itself.
- ops-mentions: no line of lmjax/ops matches `lora|Quantized` (the primitives know nothing of
  adapters or NF4).
- file-lines: no file over 500 lines.
- function-lines: no function over 80 lines, not counting the lines of a table: a multi-line
  list / tuple / set / dict display that a top-level statement of the function assigns,
  extends (`+=`) or returns (the op cases of lmjax/testing.py).
- local-import: imports sit at module level, except in the lmjax/cli/ package (there they keep
  `lmjax --help` fast) and for the third-party packages of `LAZY_THIRD_PARTY`, each with its
  measured import cost (a third-party import cannot hide a cycle of ours).
- alias-P: `P` names `jax.sharding.PartitionSpec` or nothing; never `lmjax.params`.

`KNOWN_VIOLATIONS` lists what the tree breaks today, each with why it is there. It is a
ratchet: a violation not in the table fails, and so does an entry whose violation has gone
(delete the entry in the commit that fixes it). The table only shrinks.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lmjax", "pallas_kernels")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
LOCAL_IMPORTS_ALLOWED = "lmjax/cli/"  # a path prefix: the files of the cli package
# Third-party packages that may be imported inside a function anywhere, and why.
LAZY_THIRD_PARTY = {
    "matplotlib": "loss.png only, once per run; `import matplotlib.figure` adds 0.4-0.7 s to "
    "`import lmjax.train` (1.9-2.3 s without it, measured 2026-12-02)",
    "wandb": "train.wandb: true only, once per run (lmjax.train.wandb_log); `import wandb` is "
    "0.5-1.0 s (wandb 0.31, measured 2026-12-02)",
}
# Bottom to top. A package imports only from its own tier and the tiers below it: where a corpus
# becomes tokens (data) sits under where a step runs (train), which sits under where adapters are
# trained (finetune); the command line is on top. The root `lmjax/__init__.py` loads its four
# public subpackages lazily by name and is in no tier.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("lmjax.errors", "lmjax.compat"),
    ("lmjax.checks", "lmjax.files", "lmjax.params", "lmjax.hostmem"),
    ("lmjax.ops", "lmjax.testing"),
    ("lmjax.quant",),
    ("pallas_kernels",),
    ("lmjax.models",),
    ("lmjax.parallel",),
    ("lmjax.config",),
    ("lmjax.io", "lmjax.tokenizers", "lmjax.generate"),
    ("lmjax.lora",),
    ("lmjax.data",),
    ("lmjax.train",),
    ("lmjax.finetune", "lmjax.chat", "lmjax.eval_harness"),
    ("lmjax.cli", "lmjax.__main__"),
)
OPS = "lmjax.ops"
OPS_MAY_IMPORT = ("lmjax.errors", "lmjax.checks", OPS)
OPS_MUST_NOT_MENTION = re.compile(r"lora|Quantized")
PARTITION_SPEC = "jax.sharding.PartitionSpec"


# (rule, subject) -> why it is still here. Subjects: a cycle's sorted members joined by ", ";
# "importer -> target" for an import; a file path; "path::qualified.function".
_KNOWN: list[tuple[str, list[tuple[str, str]]]] = []  # issue 21 emptied it
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {k: why for why, keys in _KNOWN for k in keys}


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement's effect: `importer` binds `alias` to `target` (or its `name`)."""

    importer: str  # dotted module name doing the import
    path: str  # its file, relative to the root
    line: int
    target: str  # the dotted module imported from (resolved; may be third-party)
    name: str | None  # the name taken from `target`; None when the module itself is bound
    alias: str | None  # the local name bound; None for `sys.modules[...]`-style lookups
    function: str | None  # qualified name of the enclosing def/class; None at module level
    how: str = "import"  # "import", or "sys.modules" / "import_module" for string lookups


@dataclasses.dataclass(frozen=True)
class Tree:
    root: Path
    packages: tuple[str, ...]
    modules: dict[str, Path]  # dotted name -> file
    asts: dict[str, ast.Module]  # dotted name -> its parsed source
    lines: dict[str, int]  # dotted name -> its number of lines
    imports: tuple[Import, ...]
    layers: tuple[tuple[str, ...], ...] = ()  # LAYERS for the repository's tree

    def internal(self, target: str) -> bool:
        return target.split(".")[0] in self.packages

    def rel(self, module: str) -> str:
        return self.modules[module].relative_to(self.root).as_posix()


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _ImportCollector(ast.NodeVisitor):
    """The `Import`s of one module, noting the def/class each sits in."""

    def __init__(self, module: str, path: str, is_package: bool, modules):
        self.module, self.path, self.modules = module, path, modules
        self.package = module if is_package else module.rpartition(".")[0]
        self.scope: list[str] = []
        self.found: list[Import] = []

    def _add(self, node, target, name, alias, how="import"):
        function = ".".join(self.scope) or None
        self.found.append(
            Import(self.module, self.path, node.lineno, target, name, alias, function, how)
        )

    def _scoped(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Import(self, node):
        for a in node.names:
            self._add(node, a.name, None, a.asname or a.name.split(".")[0])

    def visit_ImportFrom(self, node):
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, node.module] if node.module else parts)
        for a in node.names:
            sub = f"{base}.{a.name}"
            if sub in self.modules:
                self._add(node, sub, None, a.asname or a.name)
            else:
                self._add(node, base, a.name, a.asname or a.name)

    def visit_Call(self, node):
        # importlib.import_module("x") / import_module("x")
        f = node.func
        called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        if called == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            self._add(node, str(node.args[0].value), None, None, "import_module")
        self.generic_visit(node)

    def visit_Subscript(self, node):
        v, key = node.value, node.slice
        if (
            isinstance(v, ast.Attribute)
            and v.attr == "modules"
            and isinstance(v.value, ast.Name)
            and v.value.id == "sys"
            and isinstance(key, ast.Constant)
            and isinstance(key.value, str)
        ):
            self._add(node, key.value, None, None, "sys.modules")
        self.generic_visit(node)


def _module_attributes(tree: ast.Module, bound: dict[str, str]):
    """(line, dotted module, attribute) for each `alias.x.y._attr` on a bound module alias."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in bound:
            dotted = ".".join([bound[value.id], *reversed(chain[1:])])
            yield node.lineno, dotted, node.attr


@functools.cache
def read_tree(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES, layers=LAYERS) -> Tree:
    files = sorted(p for pkg in packages for p in (root / pkg).rglob("*.py"))
    modules = {module_name(p, root): p for p in files}
    texts = {name: path.read_text(encoding="utf-8") for name, path in modules.items()}
    asts = {name: ast.parse(text, str(modules[name])) for name, text in texts.items()}
    imports = []
    for name, path in modules.items():
        rel = path.relative_to(root).as_posix()
        collector = _ImportCollector(name, rel, path.name == "__init__.py", modules)
        collector.visit(asts[name])
        imports += collector.found
    lines = {name: len(text.splitlines()) for name, text in texts.items()}
    return Tree(root, packages, modules, asts, lines, tuple(imports), layers)


# ---- the rules: each yields (rule, subject, detail) --------------------------------------------


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components of `graph`, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def cycles(tree: Tree):
    graph: dict[str, set[str]] = {m: set() for m in tree.modules}
    lines: dict[tuple[str, str], int] = {}
    for imp in tree.imports:
        if imp.target in tree.modules and imp.target != imp.importer:
            graph[imp.importer].add(imp.target)
            lines.setdefault((imp.importer, imp.target), imp.line)
    for component in strongly_connected(graph):
        if len(component) > 1:
            members = set(component)
            edges = [
                f"{a}:{lines[a, b]} -> {b}" for a in component for b in sorted(graph[a] & members)
            ]
            yield "cycle", ", ".join(component), "; ".join(edges)


def _private_owner(module: str) -> str | None:
    """The package a private module belongs to (`a.b._c.d` -> `a.b`), None if it is public."""
    parts = module.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if _is_private(part):
            return ".".join(parts[:i])
    return None


def _private_use(tree: Tree, importer: str, target: str, name: str | None, where: str):
    owner = _private_owner(target)
    if owner is not None and importer != owner and not importer.startswith(owner + "."):
        yield "private-module", f"{importer} -> {target}", where
    if name is not None and _is_private(name) and target != importer:
        yield "private-name", f"{importer} -> {target}.{name}", where


def private_uses(tree: Tree):
    for imp in tree.imports:
        if tree.internal(imp.target):
            where = f"{imp.path}:{imp.line}"
            yield from _private_use(tree, imp.importer, imp.target, imp.name, where)
    for module in tree.modules:
        bound = {
            imp.alias: imp.alias if imp.alias == imp.target.split(".")[0] else imp.target
            for imp in tree.imports
            if imp.importer == module
            and imp.alias
            and imp.name is None
            and imp.target in tree.modules
        }
        if not bound:
            continue
        for line, dotted, attr in _module_attributes(tree.asts[module], bound):
            where = f"{tree.rel(module)}:{line}"
            if f"{dotted}.{attr}" in tree.modules:
                yield from _private_use(tree, module, f"{dotted}.{attr}", None, where)
            elif dotted in tree.modules:
                yield from _private_use(tree, module, dotted, attr, where)


def sys_modules_lookups(tree: Tree):
    for imp in tree.imports:
        if imp.how == "sys.modules":
            yield "sys-modules", f"{imp.importer} -> {imp.target}", f"{imp.path}:{imp.line}"


def tier_of(module: str, layers=LAYERS) -> int | None:
    """The index in `layers` of the package holding `module`; None for one in no tier."""
    for i, packages in enumerate(layers):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return i
    return None


def package_layers(tree: Tree):
    for module in tree.modules:
        if module != "lmjax" and tier_of(module, tree.layers) is None:
            yield "layers", module, f"{tree.rel(module)} is in no tier of LAYERS"
    for imp in tree.imports:
        if not tree.internal(imp.target) or imp.target == "lmjax" or imp.importer == "lmjax":
            continue
        low, high = tier_of(imp.importer, tree.layers), tier_of(imp.target, tree.layers)
        if low is not None and high is not None and high > low:
            yield "layers", f"{imp.importer} -> {imp.target}", f"{imp.path}:{imp.line}"


def ops_layering(tree: Tree):
    for imp in tree.imports:
        in_ops = imp.importer == OPS or imp.importer.startswith(OPS + ".")
        allowed = any(imp.target == a or imp.target.startswith(a + ".") for a in OPS_MAY_IMPORT)
        if in_ops and tree.internal(imp.target) and not allowed:
            yield "ops-imports", f"{imp.importer} -> {imp.target}", f"{imp.path}:{imp.line}"
    for module, path in tree.modules.items():
        if module == OPS or module.startswith(OPS + "."):
            text = path.read_text(encoding="utf-8").splitlines()
            hits = [str(i) for i, line in enumerate(text, 1) if OPS_MUST_NOT_MENTION.search(line)]
            if hits:
                yield "ops-mentions", tree.rel(module), "lines " + ", ".join(hits)


def long_files(tree: Tree):
    for module, n in tree.lines.items():
        if n > MAX_FILE_LINES:
            yield "file-lines", tree.rel(module), f"{n} lines > {MAX_FILE_LINES}"


def _table_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[int]:
    """Lines of the multi-line displays that top-level statements of `function` assign, extend
    (`+=`) or return: its tables."""
    tables = (ast.List, ast.Tuple, ast.Set, ast.Dict)
    lines: set[int] = set()
    for statement in function.body:
        value = getattr(statement, "value", None)
        is_kept = isinstance(statement, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.Return)
        if is_kept and isinstance(value, tables) and value.end_lineno > value.lineno:
            lines.update(range(value.lineno, value.end_lineno + 1))
    return lines


def _functions(node, prefix=""):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield name, child
            yield from _functions(child, name + ".")
        else:
            yield from _functions(child, prefix)


def long_functions(tree: Tree):
    for module in tree.modules:
        for name, function in _functions(tree.asts[module]):
            span = set(range(function.lineno, function.end_lineno + 1))
            n = len(span - _table_lines(function))
            if n > MAX_FUNCTION_LINES:
                subject = f"{tree.rel(module)}::{name}"
                yield "function-lines", subject, f"{n} lines > {MAX_FUNCTION_LINES}"


def local_imports(tree: Tree):
    for imp in tree.imports:
        if imp.function is not None and imp.how == "import":
            lazy_ok = imp.target.split(".")[0] in LAZY_THIRD_PARTY
            if not (imp.path.startswith(LOCAL_IMPORTS_ALLOWED) or lazy_ok):
                subject = f"{imp.path}::{imp.function} -> {imp.target}"
                yield "local-import", subject, f"{imp.path}:{imp.line}"


def p_aliases(tree: Tree):
    for imp in tree.imports:
        imported = imp.target if imp.name is None else f"{imp.target}.{imp.name}"
        if imp.alias == "P" and imported != PARTITION_SPEC:
            yield "alias-P", f"{imp.path} -> {imported}", f"{imp.path}:{imp.line}"


RULES = (
    cycles,
    private_uses,
    sys_modules_lookups,
    package_layers,
    ops_layering,
    long_files,
    long_functions,
    local_imports,
    p_aliases,
)


def violations(tree: Tree) -> dict[tuple[str, str], str]:
    """(rule, subject) -> where, for every rule broken in `tree` (repeats joined)."""
    found: dict[tuple[str, str], list[str]] = {}
    for rule in RULES:
        for kind, subject, detail in rule(tree):
            found.setdefault((kind, subject), []).append(detail)
    return {key: "; ".join(dict.fromkeys(d)) for key, d in sorted(found.items())}


def ratchet(found: dict, known: dict) -> tuple[list[str], list[str]]:
    """(new violations, listed ones that are gone), each as printable lines."""
    new = [f"{k!r}: {found[k]}" for k in sorted(found.keys() - known.keys())]
    gone = [f"{k!r}" for k in sorted(known.keys() - found.keys())]
    return new, gone


# ---- the tests ---------------------------------------------------------------------------------


@functools.cache
def current_violations() -> dict[tuple[str, str], str]:
    return violations(read_tree())


def test_no_new_violation():
    new, _ = ratchet(current_violations(), KNOWN_VIOLATIONS)
    assert not new, "new violations of the architecture rules (module docstring):\n" + "\n".join(
        new
    )


def test_known_violations_are_still_there():
    _, gone = ratchet(current_violations(), KNOWN_VIOLATIONS)
    assert not gone, "fixed, so delete from KNOWN_VIOLATIONS:\n" + "\n".join(gone)


def test_every_known_violation_says_why():
    assert len(KNOWN_VIOLATIONS) == sum(len(keys) for _, keys in _KNOWN), "an entry twice"
    rules = {"cycle", "private-module", "private-name", "sys-modules", "ops-imports"}
    rules |= {"ops-mentions", "file-lines", "function-lines", "local-import", "alias-P"}
    for (rule, subject), why in KNOWN_VIOLATIONS.items():
        assert rule in rules, (rule, subject)
        assert subject and why.strip(), (rule, subject)


def test_the_graph_sees_the_tree():
    """Guards the checker against reading nothing: known modules and edges are present."""
    tree = read_tree()
    assert {"lmjax", "lmjax.ops", "lmjax.cli", "pallas_kernels.flash_attention"} <= set(
        tree.modules
    )
    edges = {(i.importer, i.target) for i in tree.imports}
    assert ("lmjax.ops", "lmjax.ops.attention") in edges
    local = [i for i in tree.imports if i.path.startswith("lmjax/cli/") and i.function]
    assert local, "cli's function-local imports are counted"


# A small tree breaking each rule once, next to the same tree with each break mended.
_BAD = {
    "lmjax/__init__.py": "",
    "lmjax/a.py": "from lmjax import b\n\n_hidden = 1\n",
    "lmjax/b.py": "def f():\n    from . import a\n\n    return a\n",
    "lmjax/c.py": "from lmjax.a import _hidden\nimport lmjax.a as m\n\nx = m._hidden + _hidden\n",
    "lmjax/d.py": "import sys\n\nfrom lmjax.sub import _impl\nfrom lmjax.sub._impl import y\n\n"
    "z = sys.modules['lmjax.a']\n",
    "lmjax/sub/__init__.py": "from lmjax.sub._impl import y\n",
    "lmjax/sub/_impl.py": "y = 2\n",
    "lmjax/sub/e.py": "from ._impl import y\n",
    "lmjax/ops/__init__.py": "",
    "lmjax/ops/x.py": "from lmjax import errors\nfrom lmjax import a\n\nlora = 1\n",
    "lmjax/ops/y.py": "from lmjax.checks import require\nfrom lmjax.ops import x\n",
    "lmjax/errors.py": "",
    "lmjax/checks.py": "",
    "lmjax/cli/__init__.py": "def main():\n    from lmjax import a\n\n    return a\n",  # allowed
    "lmjax/params.py": "",
    "lmjax/long.py": "from lmjax import params as P\n\n\ndef f():\n" + "    x = 1\n" * 80,
    "lmjax/table.py": "def cases():\n    t = [\n" + "        1,\n" * 90 + "    ]\n    return t\n",
    "lmjax/big.py": "x = 1\n" * 501,
    "lmjax/plot.py": "def f():\n    import matplotlib.figure\n\n    import numpy\n",
    "lmjax/low.py": "from lmjax import a\n",  # a tier below lmjax.a
    "lmjax/stray.py": "",  # in no tier
}
_SMALL_LAYERS = (
    ("lmjax.errors", "lmjax.checks", "lmjax.params"),
    ("lmjax.ops",),
    ("lmjax.low",),
    ("lmjax.a", "lmjax.b", "lmjax.c", "lmjax.d", "lmjax.sub", "lmjax.long", "lmjax.table"),
    ("lmjax.big", "lmjax.plot", "lmjax.cli"),
)
_MENDED = _BAD | {
    "lmjax/b.py": "",
    "lmjax/c.py": "import lmjax.a as m\n\nx = m\n",
    "lmjax/d.py": "from lmjax.sub import y\n",
    "lmjax/ops/x.py": "from lmjax import errors\n\nlow_rank = 1\n",
    "lmjax/long.py": "from jax.sharding import PartitionSpec as P\n\n\ndef f():\n"
    + "    x = 1\n" * 79,  # 80 lines: the limit
    "lmjax/big.py": "x = 1\n" * 500,  # the limit
    "lmjax/plot.py": "def f():\n    import matplotlib.figure\n",  # LAZY_THIRD_PARTY
    "lmjax/low.py": "from lmjax import errors\n",
}


def _write(root: Path, files: dict[str, str], layers=_SMALL_LAYERS) -> Tree:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return read_tree(root, ("lmjax",), layers)


def test_the_checker_catches_each_rule_on_a_small_tree(tmp_path):
    found = violations(_write(tmp_path / "bad", _BAD))
    assert set(found) == {
        ("cycle", "lmjax.a, lmjax.b"),
        ("private-name", "lmjax.c -> lmjax.a._hidden"),
        ("private-module", "lmjax.d -> lmjax.sub._impl"),
        ("sys-modules", "lmjax.d -> lmjax.a"),
        ("ops-imports", "lmjax.ops.x -> lmjax.a"),
        ("ops-mentions", "lmjax/ops/x.py"),
        ("file-lines", "lmjax/big.py"),
        ("function-lines", "lmjax/long.py::f"),
        ("local-import", "lmjax/b.py::f -> lmjax.a"),
        ("local-import", "lmjax/plot.py::f -> numpy"),  # matplotlib may be lazy, numpy not
        ("alias-P", "lmjax/long.py -> lmjax.params"),
        ("layers", "lmjax.low -> lmjax.a"),
        ("layers", "lmjax.ops.x -> lmjax.a"),  # ops-imports names it too
        ("layers", "lmjax.stray"),
    }, found
    assert "lmjax/c.py:1" in found["private-name", "lmjax.c -> lmjax.a._hidden"]
    assert "lmjax/c.py:4" in found["private-name", "lmjax.c -> lmjax.a._hidden"]  # m._hidden
    assert found["private-module", "lmjax.d -> lmjax.sub._impl"] == "lmjax/d.py:3; lmjax/d.py:4"
    mended = _write(tmp_path / "mended", _MENDED, (*_SMALL_LAYERS, ("lmjax.stray",)))
    assert violations(mended) == {}


def test_the_ratchet_fails_both_ways(tmp_path):
    found = violations(_write(tmp_path, _BAD))
    known = dict.fromkeys(found, "listed") | {("cycle", "lmjax.x, lmjax.y"): "fixed since"}
    del known["cycle", "lmjax.a, lmjax.b"]
    new, gone = ratchet(found, known)
    assert [line.split(":")[0] for line in new] == ["('cycle', 'lmjax.a, lmjax.b')"]
    assert gone == ["('cycle', 'lmjax.x, lmjax.y')"]


@pytest.mark.parametrize(
    "module, owner",
    [
        ("lmjax.ops._common", "lmjax.ops"),
        ("lmjax.tokenizers._base", "lmjax.tokenizers"),
        ("a.b._c.d", "a.b"),
        ("lmjax.ops.linear", None),
        ("lmjax.__init__", None),
        ("_top", None),
    ],
)
def test_private_module_owner(module, owner):
    assert _private_owner(module) == owner
