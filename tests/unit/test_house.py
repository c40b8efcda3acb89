"""The layers point one way: every import inside `src/pipetrain` (those inside functions too) goes to its own room
or a room below it in `FLOORS`, rooms on one floor do not import each other, and no modules import each other in
a circle. Read from the source with `ast`: nothing is imported. The README's layout paragraph draws `FLOORS`."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "pipetrain"

#: The rooms of pipetrain, bottom floor first: a room may import its own floor's modules of its own room, and
#: any room of a lower floor. The top-level `pipetrain` package (the lazy public API) and `__main__` stand above.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "lazy"),
    ("compat",),
    ("blocks", "config", "batchnorm"),
    ("partition",),
    ("plan",),
    ("launch",),
    ("pipeline",),
    ("parallel",),
    ("moe",),
    ("logs", "trace"),
    ("checkpoint",),
    ("data",),
    ("context",),
    ("workloads",),
    ("lora",),
    ("recipe",),
    ("session",),
    ("generate",),
    ("objectives",),
    ("train",),
    ("pipe", "check", "evaluate"),
    ("bench", "lightning"),
    ("cli",),
)
_FLOOR = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}
_FACADE = ("pipetrain", "pipetrain.moved", "pipetrain.__main__")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The pipetrain modules `name` imports anywhere in its file (`from pkg import module` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import pipetrain.a.b.c` of a module a.b: its nearest module
                target = target.rpartition(".")[0]
            if target.startswith("pipetrain") and target != name:
                found.add(target)
    return found


def _room(module: str) -> str | None:
    parts = module.split(".")
    return None if module in _FACADE else parts[1]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) - {"pipetrain"} for name, path in modules.items()}


def test_every_room_has_a_floor():
    rooms = {_room(name) for name in _modules()} - {None}
    assert rooms <= set(_FLOOR), f"rooms without a floor in FLOORS: {sorted(rooms - set(_FLOOR))}"


def test_imports_go_down_or_stay_in_their_room():
    against = []
    for name, targets in _graph().items():
        room = _room(name)
        if room is None:
            continue
        for target in sorted(targets):
            other = _room(target)
            if other is None or (other != room and _FLOOR[other] >= _FLOOR[room]):
                against.append(f"{name} ({room}, floor {_FLOOR[room]}) imports {target} "
                               f"({other}, floor {_FLOOR.get(other, 'top')})")
    assert not against, "imports against the order of rooms:\n" + "\n".join(against)


def test_no_circle_of_modules():
    graph, state, path, circles = _graph(), {}, [], []

    def visit(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(circles)


def test_the_check_sees_a_lazy_import_against_the_order(tmp_path):
    """The test can fail: an import inside a function, from a low room to a high one, is found."""
    module = tmp_path / "pipetrain" / "errors.py"
    module.parent.mkdir()
    module.write_text("def f():\n    from pipetrain.cli.main import main\n    return main\n")
    known = {"pipetrain.errors", "pipetrain.cli.main", "pipetrain.cli"}
    found = _imports("pipetrain.errors", module, known)
    assert found == {"pipetrain.cli.main"}
    assert _FLOOR[_room("pipetrain.cli.main")] > _FLOOR[_room("pipetrain.errors")]
