"""The package's modules import each other without cycles.

The graph is read from the source: an edge for every module-level import of a
``kunlun_infer`` module (imports under ``if TYPE_CHECKING:`` and inside
functions are not run at import time and are left out). ``from package import
name`` points at the submodule when ``name`` is one, else at the package's
``__init__``; importing ``a.b.c`` also runs ``a.b``'s ``__init__`` first, an
edge too (the root package's aside: it gathers the public API). A cycle means a module's import works only in some orders; a
function-local import that papers over one is refused by the last test.
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src"
CONF = Path(__file__).resolve().parents[1] / "conf"
PACKAGE = "kunlun_infer"
#: the imports of the package that stay inside functions, each for a reason other than a cycle
LOCAL_IMPORTS = {
    # fastapi and uvicorn are an optional extra, Ray (the fleet) another
    "kunlun_infer.commands.serve": {"kunlun_infer.server", "kunlun_infer.fleet"},
    "kunlun_infer": {"kunlun_infer.fleet"},  # kunlun_infer.Fleet needs the cluster extra
    "kunlun_infer.testing.pytest_plugin": {"kunlun_infer.testing.harness"},  # every pytest session loads the plugin
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SOURCE / PACKAGE).rglob("*.py")):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    found[f"{PACKAGE}.conf"] = CONF / "__init__.py"
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If) and not _is_type_checking(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return found


def _targets(node: ast.Import | ast.ImportFrom, modules: dict[str, Path], here: str) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    base = node.module or ""
    if node.level:  # relative import
        package = here if modules[here].name == "__init__.py" else here.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    if base not in modules:
        return set()
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}


def _with_packages(targets: set[str]) -> set[str]:
    """``targets`` and the subpackages Python runs first to import them (the root package aside)."""
    found = set(targets)
    for target in targets:
        parts = target.split(".")
        found.update(".".join(parts[:i]) for i in range(2, len(parts)))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = set().union(*(_targets(n, modules, name) for n in _module_level_imports(tree)))
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = _with_packages(targets) - {name} - own_packages
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first = last), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for succ in sorted(graph.get(node, ())):
            if state.get(succ) == 1:
                return path[path.index(succ):] + [succ]
            if succ not in state:
                found = visit(succ)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _local_imports() -> list[tuple[str, str]]:
    found = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(), str(path))
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(func):
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                        found.append((name, node.module))
    return sorted(set(found))


def test_the_package_imports_without_cycles():
    graph = import_graph()
    assert len(graph) > 100 and "kunlun_infer.engine.engine" in graph["kunlun_infer"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_is_found_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_of_the_package_sit_inside_functions_only_for_a_reason():
    unexplained = [f"{module} imports {target} inside a function" for module, target in _local_imports()
                   if target not in LOCAL_IMPORTS.get(module, ())]
    assert not unexplained, "\n".join(unexplained)
