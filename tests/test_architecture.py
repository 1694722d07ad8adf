"""The package's imports point one way and never go round in a circle.

Reads every module of ``ray_ckpt`` with ``ast`` (nothing is imported: no Ray, well under a second)
and collects each import, at module level, inside functions and under ``if TYPE_CHECKING:`` alike,
relative ones resolved. Fails, naming the edges, on

* an import circle between modules;
* an import circle between the units of ``LAYERS`` (subpackages and the root's modules): peers in
  one layer may import each other one way only;
* an import from a lower layer to a higher one.

``LAYERS`` is DESIGN's "integrations / cli -> client -> coordinator, writers -> capture -> formats,
storage -> vocabulary", with the root's vocabulary in two rows: ``config`` and ``protocol`` speak in
the terms of storage and formats (``EngineConfig`` builds the tiers and retention policies it names;
the messages carry manifest entries), and everything else stands on ``errors``, ``types``,
``metrics`` and ``ray_internals`` (the private Ray APIs), which import nothing of the package.
"""
import ast
import pathlib
from typing import Dict, List, Set, Tuple

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ray_ckpt"

# highest first: a unit may import units of its own row (one way) and of any row below it
LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("ray_ckpt", "ray_ckpt.demo", "ray_ckpt.cli", "ray_ckpt.integrations"),  # public API, entry points
    ("ray_ckpt.client",),
    ("ray_ckpt.coordinator", "ray_ckpt.writers"),
    ("ray_ckpt.capture",),
    ("ray_ckpt.config", "ray_ckpt.protocol"),
    ("ray_ckpt.formats", "ray_ckpt.storage"),
    ("ray_ckpt.errors", "ray_ckpt.types", "ray_ckpt.metrics", "ray_ckpt.ray_internals"),
)
ROW = {unit: i for i, row in enumerate(LAYERS) for unit in row}

# circles known and not yet broken, each with its reason; the test fails on any other circle, and
# on an entry here that is no longer a circle (delete it then)
KNOWN_CIRCLES: Set[frozenset] = set()

Edge = Tuple[str, str, int]  # importer, imported module, line


def _modules() -> Dict[str, pathlib.Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _known(name: str, mods: Dict[str, pathlib.Path]) -> str:
    """The module an imported name lives in: ``ray_ckpt.formats.manifest.FileEntry`` -> ``...manifest``."""
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _edges(mods: Dict[str, pathlib.Path]) -> List[Edge]:
    edges = []
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # ``from pkg import mod`` imports the module; ``from mod import name`` the module
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names]
            for target in targets:
                if target == "ray_ckpt" or target.startswith("ray_ckpt."):
                    target = _known(target, mods)
                    if target != mod:
                        edges.append((mod, target, node.lineno))
    return edges


def _unit(mod: str) -> str:
    return ".".join(mod.split(".")[:2])


def _circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    members.append(m)
                    if m == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


def _describe(circle: List[str], edges: List[Edge], key) -> str:
    inside = set(circle)
    lines = sorted({f"  {a} -> {b} (line {n})" for a, b, n in edges if key(a) in inside and key(b) in inside
                    and key(a) != key(b)})
    return " <-> ".join(circle) + ":\n" + "\n".join(lines)


MODULES = _modules()
EDGES = _edges(MODULES)


def test_every_unit_has_a_layer():
    missing = sorted({_unit(m) for m in MODULES} - set(ROW))
    assert not missing, f"place these in LAYERS (tests/test_architecture.py) and in DESIGN's layout: {missing}"


def test_no_import_circle_between_modules():
    graph: Dict[str, Set[str]] = {}
    for a, b, _ in EDGES:
        graph.setdefault(a, set()).add(b)
    circles = [c for c in _circles(graph) if frozenset(c) not in KNOWN_CIRCLES]
    assert not circles, "import circles:\n" + "\n".join(_describe(c, EDGES, lambda m: m) for c in circles)
    stale = KNOWN_CIRCLES - {frozenset(c) for c in _circles(graph)}
    assert not stale, f"no longer circles: remove them from KNOWN_CIRCLES: {sorted(map(sorted, stale))}"


def test_no_import_circle_between_units():
    graph: Dict[str, Set[str]] = {}
    for a, b, _ in EDGES:
        if _unit(a) != _unit(b):
            graph.setdefault(_unit(a), set()).add(_unit(b))
    circles = _circles(graph)
    assert not circles, "circles between subpackages:\n" + "\n".join(_describe(c, EDGES, _unit) for c in circles)


def test_no_upward_import():
    upward = sorted(f"{a} -> {b} (line {n}): {_unit(a)} may not import {_unit(b)}, a higher layer"
                    for a, b, n in EDGES if _unit(a) in ROW and _unit(b) in ROW and ROW[_unit(b)] < ROW[_unit(a)])
    assert not upward, "upward imports (LAYERS in tests/test_architecture.py):\n" + "\n".join(upward)


def test_the_walk_sees_the_imports():
    """The checks above are only as good as the edges: a few that must be found."""
    found = {(a, b) for a, b, _ in EDGES}
    for edge in [("ray_ckpt.client.engine", "ray_ckpt.client.handle"),  # from .handle import ...
                 ("ray_ckpt.client.reading", "ray_ckpt.storage.sharded_io"),  # from ..storage import sharded_io
                 ("ray_ckpt.cli.main", "ray_ckpt"),  # from .. import __version__ (in a function)
                 ("ray_ckpt.capture.mailbox", "ray_ckpt.protocol"),  # inside a function
                 ("ray_ckpt.client.handle", "ray_ckpt.client.push_batch")]:  # under TYPE_CHECKING
        assert edge in found, edge
