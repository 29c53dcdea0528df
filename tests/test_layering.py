"""The packages stand in layers: the client below everything, `common` below the worker
and the gateway, the command line on top; and no module imports itself back in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

from support import ROOT

PACKAGES = ("client", "common", "worker", "gateway", "mlxq")
# What each package may import of ours, besides itself.
ALLOWED = {"client": set(), "common": {"client"}, "worker": {"client", "common"}, "gateway": {"client", "common"},
           "mlxq": {"client", "common", "worker", "gateway"}}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, anywhere: bool) -> set[str]:
    """The modules of ours that `path` imports: all of them, or (not `anywhere`) only those
    imported when the module loads (not inside functions, not for type checkers)."""
    tree = ast.parse(path.read_text())
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    nodes = ast.walk(tree) if anywhere else _loaded_at_import(tree.body)
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _loaded_at_import(body: list[ast.stmt]) -> list[ast.stmt]:
    nodes: list[ast.stmt] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            nodes.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            nodes += _loaded_at_import(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            nodes += _loaded_at_import(node.body + node.orelse + node.finalbody)
    return nodes


def _sources() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def test_no_package_imports_one_above_it():
    """client imports none of ours; common only the client; the worker and the gateway
    the client and common, never each other or the command line."""
    modules = {_module_name(path) for path in _sources()}
    wrong = []
    for path in _sources():
        package = _module_name(path).split(".")[0]
        for name in _imports(path, anywhere=True):
            if name.split(".")[0] not in ALLOWED[package] | {package}:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
            elif name not in modules and name.rsplit(".", 1)[0] not in modules:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}, which is not there")
    assert wrong == []


def test_no_import_circle():
    """Following what modules import as they load never comes back to where it started."""
    modules = {_module_name(path): path for path in _sources()}
    # A module's own packages are left out: they load before it and re-export it, as Python means them to.
    graph = {name: {m for m in _imports(path, anywhere=False)
                    if m in modules and m != name and not name.startswith(f"{m}.")}
             for name, path in modules.items()}
    circles: list[list[str]] = []

    def visit(name: str, path: list[str], done: set[str]) -> None:
        if name in path:
            circles.append(path[path.index(name):] + [name])
            return
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*path, name], done)
        done.add(name)

    finished: set[str] = set()
    for name in sorted(graph):
        visit(name, [], finished)
    assert circles == []
