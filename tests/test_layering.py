"""The packages stand in layers, and the worker's rooms in directions: the client below
everything, `common` below the worker and the gateway, the command line on top; inside the
worker, the engine and the queue side meet only in `worker.messages`. Every import counts:
at module level, inside functions, and those made only for type checkers."""

from __future__ import annotations

import ast
from pathlib import Path

from support import ROOT

PACKAGES = ("client", "common", "worker", "gateway", "mlxq")
# What each package may import of ours, besides itself.
ALLOWED = {"client": set(), "common": {"client"}, "worker": {"client", "common"}, "gateway": {"client", "common"},
           "mlxq": {"client", "common", "worker", "gateway"}}

# The worker's rooms, and the rooms each may import besides itself. The foundation
# (`messages`, `settings`, `faults`) is what every room shares; `daemon` wires the rooms.
FOUNDATION = {"worker.messages", "worker.settings", "worker.faults"}
ROOMS = {
    "foundation": set(),
    "media": {"foundation"},
    "engine": {"foundation", "media"},
    "prepare": {"foundation", "media", "engine"},
    "queue": {"foundation", "media", "prepare"},
    "fleet": {"foundation", "queue"},
    "host": {"foundation", "queue", "fleet"},
    "process": {"foundation", "media", "engine", "prepare"},
    "daemon": {"foundation", "process", "queue", "fleet", "host"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str | None = None) -> set[str]:
    """The modules of ours that `path` (the module `module`, by default the one its place
    names) imports anywhere: as it loads, inside functions, or for type checkers (an import
    hidden in a function is still a dependency)."""
    tree = ast.parse(path.read_text())
    here = (module or _module_name(path)).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _sources() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in _sources()}


def _room(module: str) -> str | None:
    """The worker room a module of the worker stands in (None for the package itself)."""
    parts = module.split(".")
    if module in FOUNDATION:
        return "foundation"
    if len(parts) < 2 or parts[0] != "worker":
        return None
    return parts[1]


def _ours(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported name is (a module, or a name in one), if it is ours."""
    if name in modules:
        return name
    head = name.rsplit(".", 1)[0]
    return head if head in modules else None


def test_no_package_imports_one_above_it():
    """client imports none of ours; common only the client; the worker and the gateway
    the client and common, never each other or the command line."""
    modules = _modules()
    wrong = []
    for path in _sources():
        package = _module_name(path).split(".")[0]
        for name in _imports(path):
            if name.split(".")[0] not in ALLOWED[package] | {package}:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
            elif _ours(name, modules) is None:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}, which is not there")
    assert wrong == []


def test_every_worker_module_stands_in_a_room():
    """A new module goes into a room (or the foundation), so the directions below cover it."""
    loose = [name for name in _modules() if name.startswith("worker.") and _room(name) not in ROOMS]
    assert loose == []


def test_the_worker_rooms_import_only_in_their_directions():
    """The engine never imports the queue side nor the queue side the engine; each room
    imports only the rooms written above."""
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        room = _room(name)
        if room is None:
            continue
        for imported in filter(None, (_ours(n, modules) for n in _imports(path))):
            other = _room(imported)
            if other is not None and other != room and other not in ROOMS[room]:
                wrong.append(f"{name} ({room}) imports {imported} ({other})")
    assert wrong == []


def test_no_import_circle():
    """Following what modules import, anywhere in them, never comes back to where it started."""
    modules = _modules()
    graph = {name: {m for m in filter(None, (_ours(n, modules) for n in _imports(path))) if m != name}
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


def test_the_layering_check_sees_imports_inside_functions(tmp_path: Path):
    """The check reads a function's import and a TYPE_CHECKING one as it reads one at the top."""
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from worker.queue import intake\n"
                     "def f():\n    from worker.queue.publisher import Publisher\n")
    assert {"worker.queue.intake", "worker.queue.publisher.Publisher"} <= _imports(probe, "worker.engine.probe")
