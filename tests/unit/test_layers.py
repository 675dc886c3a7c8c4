"""The package's layers point one way: no import cycle, and no layer imports one above it.

The import graph is built from the source with :mod:`ast` (nothing is imported), over every
module of the installed ``kvoffload`` package: ``kvoffload/`` and the folders ``setup.cfg``'s
``package_dir`` maps into it (``ipc/`` as ``kvoffload.ipc``, ``workers/``, ``tools/``).

What counts as an import of module B by module A:

- every ``import B`` / ``from B import name`` / ``from . import B`` / ``from .B import name``
  statement in A, wherever it is: at the top, inside a function or a method (a lazy import still
  makes A depend on B; it only postpones the load), inside ``try``/``if``;
- ``from P import n`` names the module ``P.n`` when there is one, else ``P`` itself;
- ``import a.b.c`` names ``a.b.c`` only, not its parent packages (Python runs ``a/__init__.py``
  first, but a package ``__init__`` that imports its own modules would otherwise make a cycle
  with each of them);
- statements under ``if TYPE_CHECKING:`` never run: they do not count for the cycle rule; they do
  count for the layer rules (a type taken from a layer above is still a dependency on it).

No lazy import is excluded from the cycle rule: lazy imports that exist to avoid loading a heavy
dependency (vLLM, torch, prometheus-client, boto3) import third-party packages, not kvoffload
modules, so they never close a cycle here.

The layers (DESIGN.md §3): ``ipc`` imports nothing of the project; ``workers`` import only
``ipc``; the core (``kvoffload/*.py`` and ``kvoffload/tiers/``) imports neither the vLLM plug-in
(``kvoffload.vllm``) nor the tools nor the contract suite, and outside the p2p tier's own package
not the p2p wire module (``kvoffload.ipc.peer_messages``); every vLLM import of the library is in
``kvoffload.vllm.compat``. The few exceptions are listed below, each with its reason.
"""

from __future__ import annotations

import ast
import configparser
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: (importer, imported) edges of the core into the plug-in, each lazy and with its reason.
CORE_TO_PLUGIN_ALLOWED = {
    # the pinning backend "vllm" reaches vLLM's host_register through compat, the one module
    # that imports vLLM; the import runs only when that backend is asked for (the GPU path)
    ("kvoffload.pinning", "kvoffload.vllm.compat"),
}
#: core modules that may import the p2p wire module, and why.
# The p2p wire module: only the p2p tier speaks it (the serving side, kvoffload.serving, returns
# lookup verdicts and slots; the p2p server encodes the wire messages).
WIRE = "kvoffload.ipc.peer_messages"


class Import(NamedTuple):
    importer: str
    imported: str  # a kvoffload module, or a top-level third-party package name
    line: int
    lazy: bool  # inside a function
    type_only: bool  # under `if TYPE_CHECKING:`


def _package_dirs() -> dict[str, Path]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    out = {}
    for line in cfg["options"]["package_dir"].strip().splitlines():
        name, _, path = (p.strip() for p in line.partition("="))
        out[name] = ROOT / path
    return out


def _modules() -> dict[str, Path]:
    """Module name -> file, for every module of the installed package."""
    mods: dict[str, Path] = {}
    for pkg, folder in _package_dirs().items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder)
            if any(part.startswith((".", "__pycache__")) for part in rel.parts):
                continue
            if not all((folder / p / "__init__.py").exists() for p in _parents(rel)):
                continue  # a folder of scripts, not a package
            parts = [pkg, *rel.parent.parts] + ([] if rel.name == "__init__.py" else [rel.stem])
            name = ".".join(p for p in parts if p)
            mods.setdefault(name, path)  # a mapped folder wins over its symlink under kvoffload/
    return mods


def _parents(rel: Path) -> Iterator[Path]:
    for i in range(len(rel.parts) - 1):
        yield Path(*rel.parts[: i + 1])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, mods: dict[str, Path]) -> list[Import]:
    is_pkg = path.name == "__init__.py"
    out: list[Import] = []

    def resolve(target: str) -> str:
        while target not in mods and "." in target:
            target = target.rsplit(".", 1)[0]
        return target

    def visit(node: ast.AST, lazy: bool, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, lazy, True)
            for child in node.orelse:
                visit(child, lazy, type_only)
            return
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                pkg = ".".join([*base, *([node.module] if node.module else [])])
            else:
                pkg = node.module or ""
            targets = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in mods else pkg for a in node.names]
        for t in targets:
            if t == "kvoffload" or t.startswith("kvoffload."):
                t = resolve(t)
            else:
                t = t.split(".")[0]
            if t != name:
                out.append(Import(name, t, node.lineno, lazy, type_only))
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, type_only)

    visit(ast.parse(path.read_text(), str(path)), False, False)
    return out


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], list[Import]]:
    mods = _modules()
    edges = [e for name, path in mods.items() for e in _imports(name, path, mods)]
    return mods, edges


def _where(mods: dict[str, Path], e: Import) -> str:
    kind = " (in a function)" if e.lazy else " (TYPE_CHECKING)" if e.type_only else ""
    return f"{mods[e.importer].relative_to(ROOT)}:{e.line} imports {e.imported}{kind}"


def _cycles(nodes: list[str], succ: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(succ.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(succ.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _is_core(mods: dict[str, Path], name: str) -> bool:
    rel = mods[name].relative_to(ROOT).parts
    return rel[0] == "kvoffload" and (len(rel) == 2 or rel[1] == "tiers")


def test_the_import_graph_sees_the_whole_package(graph):
    mods, edges = graph
    # the graph is not vacuous: the mapped folders, the subpackages and lazy imports are in it
    for name in (
        "kvoffload.tiering",
        "kvoffload.tiers.p2p.tier",
        "kvoffload.vllm.compat",
        "kvoffload.ipc.arena",
        "kvoffload.workers.main",
        "kvoffload.tools.cli",
        "kvoffload.testing.tier_contract",
    ):
        assert name in mods, name
    internal = [e for e in edges if e.imported in mods]
    assert len(internal) > 200
    assert any(e.lazy for e in internal) and any(e.type_only for e in internal)


def test_imports_are_read_in_every_form(tmp_path):
    # the package uses no relative imports today; a module that does is read all the same
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for f in ("__init__.py", "b.py", "c.py", "d.py"):
        (pkg / f).write_text("")
    (pkg / "a.py").write_text(
        "import os.path\n"
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "from .c import thing\n"
        "from .. import metrics\n"
        "if TYPE_CHECKING:\n"
        "    from kvoffload.pkg import d\n"
        "class K:\n"
        "    def f(self):\n"
        "        import vllm.v1\n"
        "        from kvoffload.pkg.b import name_in_b\n"
    )
    mods = {
        "kvoffload.metrics": ROOT / "kvoffload" / "metrics.py",
        "kvoffload.pkg": pkg / "__init__.py",
        **{f"kvoffload.pkg.{m}": pkg / f"{m}.py" for m in "abcd"},
    }
    got = {
        (e.imported, e.lazy, e.type_only)
        for e in _imports("kvoffload.pkg.a", mods["kvoffload.pkg.a"], mods)
    }
    assert got == {
        ("os", False, False),
        ("typing", False, False),
        ("kvoffload.pkg.b", False, False),
        ("kvoffload.pkg.c", False, False),
        ("kvoffload.metrics", False, False),
        ("kvoffload.pkg.d", False, True),
        ("vllm", True, False),
        ("kvoffload.pkg.b", True, False),
    }


def test_the_package_has_no_import_cycle(graph):
    mods, edges = graph
    succ: dict[str, set[str]] = {}
    for e in edges:
        if e.imported in mods and not e.type_only:
            succ.setdefault(e.importer, set()).add(e.imported)
    cycles = _cycles(sorted(mods), succ)
    lines = []
    for comp in cycles:
        members = set(comp)
        lines.append(" <-> ".join(comp))
        lines += sorted(
            {
                "    " + _where(mods, e)
                for e in edges
                if e.importer in members and e.imported in members and not e.type_only
            }
        )
    assert not cycles, "import cycles:\n" + "\n".join(lines)


def test_the_cycle_check_finds_a_cycle_through_a_lazy_import():
    succ = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(["a", "b", "c", "d"], succ) == [["a", "b", "c"]]
    assert _cycles(["a", "b"], {"a": {"b"}}) == []


def test_the_core_imports_neither_the_vllm_plugin_nor_the_tools(graph):
    mods, edges = graph
    bad = [
        _where(mods, e)
        for e in edges
        if _is_core(mods, e.importer)
        and e.imported.startswith(("kvoffload.vllm", "kvoffload.tools", "kvoffload.testing"))
        and not ((e.importer, e.imported) in CORE_TO_PLUGIN_ALLOWED and e.lazy)
    ]
    assert not bad, "the core imports a layer above it:\n" + "\n".join(bad)


def test_the_core_outside_the_p2p_tier_does_not_speak_the_p2p_wire_format(graph):
    mods, edges = graph
    bad = [
        _where(mods, e)
        for e in edges
        if _is_core(mods, e.importer)
        and not e.importer.startswith("kvoffload.tiers.p2p")
        and e.imported == WIRE
    ]
    assert not bad, "the p2p wire module imported outside the p2p tier:\n" + "\n".join(bad)


def test_ipc_and_workers_import_only_downwards(graph):
    mods, edges = graph
    bad = [
        _where(mods, e)
        for e in edges
        if e.imported in mods
        and (
            (e.importer.startswith("kvoffload.ipc") and not e.imported.startswith("kvoffload.ipc"))
            or (
                e.importer.startswith("kvoffload.workers")
                and not e.imported.startswith(("kvoffload.ipc", "kvoffload.workers"))
            )
        )
    ]
    assert not bad, "ipc imports nothing of the project; workers only ipc:\n" + "\n".join(bad)


def test_metrics_reads_the_manager_without_importing_it(graph):
    # kvoffload.metrics reads a manager through the ManagerReadings it hands over; the manager and
    # the tiers import metrics, so metrics imports none of them
    mods, edges = graph
    imported = {
        e.imported for e in edges if e.importer == "kvoffload.metrics" and e.imported in mods
    }
    assert imported <= {"kvoffload.ipc", "kvoffload.ipc.names"}, imported


def test_every_vllm_import_of_the_library_is_in_compat(graph):
    # tools/bench/ is exempt: its vLLM benchmarks drive vLLM's own offloading (its CPU manager,
    # its fs and p2p tiers) as what they measure, not through the plug-in
    mods, edges = graph
    bad = [
        _where(mods, e)
        for e in edges
        if e.imported == "vllm"
        and e.importer != "kvoffload.vllm.compat"
        and not e.importer.startswith("kvoffload.tools.bench")
    ]
    assert not bad, "vLLM imported outside kvoffload.vllm.compat:\n" + "\n".join(bad)
