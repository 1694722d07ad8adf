"""The package's imports point one way and never go round in a circle.

Reads every module of ``ray_ckpt`` with ``ast`` (nothing is imported: no Ray, well under a second)
and collects each import, at module level, inside functions and under ``if TYPE_CHECKING:`` alike,
relative ones resolved. Fails, naming the edges, on

* an import circle between modules;
* an import circle between the units of ``LAYERS`` (subpackages and the root's modules): peers in
  one layer may import each other one way only;
* an import from a lower layer to a higher one;
* in every package below the root, a circle between the package's own modules (taken together: its
  ``__init__`` runs before any module under it is imported) and its subpackages, each taken whole
  (``integrations/rllib/`` and ``integrations/rllib/replay/``, ``rllib/`` and ``rllib/base/``): a
  subpackage sits wholly below or wholly above its parent's modules, and its siblings;
* a name with a leading underscore imported from another module of the package (``from .x import
  _y``), except from the two modules that hold the private Ray and RLlib APIs (``ray_internals`` and
  ``integrations/rllib/base/_rllib_internals``). What is used across modules is public in its module.

``LAYERS`` is DESIGN's "integrations / cli -> client -> coordinator, writers -> capture -> formats,
storage -> vocabulary", with the root's vocabulary in two rows: ``config`` and ``protocol`` speak in
the terms of storage and formats (``EngineConfig`` builds the tiers and retention policies it names;
the messages carry manifest entries), and everything else stands on ``errors``, ``types``,
``metrics``, ``ray_internals`` (the private Ray APIs) and ``interfaces`` (the extension points), which
import nothing of the package.
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
    ("ray_ckpt.errors", "ray_ckpt.types", "ray_ckpt.metrics", "ray_ckpt.ray_internals", "ray_ckpt.interfaces"),
)
ROW = {unit: i for i, row in enumerate(LAYERS) for unit in row}

# circles known and not yet broken, each with its reason; the test fails on any other circle, and
# on an entry here that is no longer a circle (delete it then)
KNOWN_CIRCLES: Set[frozenset] = set()

Edge = Tuple[str, str, int]  # importer, imported module, line

# the modules whose private names may be imported elsewhere: they name the private Ray / RLlib APIs
INTERNALS = ("ray_ckpt.ray_internals", "ray_ckpt.integrations.rllib.base._rllib_internals")

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


def _private_imports(mods: Dict[str, pathlib.Path]) -> List[Tuple[str, str, str, int]]:
    """``(importer, module imported from, name, line)`` of every ``from <ray_ckpt module> import _name``
    (a private module imported by name counts as its own private name)."""
    found = []
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not (source == "ray_ckpt" or source.startswith("ray_ckpt.")):
                continue
            for alias in node.names:
                if not alias.name.startswith("_") or alias.name.startswith("__"):
                    continue
                module = f"{source}.{alias.name}" if f"{source}.{alias.name}" in mods else _known(source, mods)
                if module != mod:
                    found.append((mod, module, alias.name, node.lineno))
    return found


def _package_unit(package: str, mod: str, packages: Set[str]) -> str:
    """``mod`` seen from ``package``: the subpackage of ``package`` it lies in, or ``package`` itself
    (the package's own modules, its ``__init__`` among them, are one unit)."""
    rest = mod[len(package) + 1:].split(".") if mod != package else []
    return f"{package}.{rest[0]}" if rest and f"{package}.{rest[0]}" in packages else package


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


def test_no_circle_between_a_package_and_its_subpackages():
    """Every package at its own level: its own modules (one unit) and each subpackage (one unit)
    import each other one way only. The root is left to ``LAYERS`` (its modules are rows of their own)."""
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    found = []
    for package in sorted(packages - {"ray_ckpt"}):
        def key(m: str, package: str = package) -> str:
            return _package_unit(package, m, packages)
        inside = [(a, b, n) for a, b, n in EDGES
                  if (a == package or a.startswith(package + ".")) and (b == package or b.startswith(package + "."))]
        graph: Dict[str, Set[str]] = {}
        for a, b, _ in inside:
            if key(a) != key(b):
                graph.setdefault(key(a), set()).add(key(b))
        found += [f"in {package}: " + _describe(c, inside, key) for c in _circles(graph)]
    assert not found, "circles between a package's own modules and its subpackages:\n" + "\n".join(found)


def test_no_private_name_imported_across_modules():
    """``from .x import _y`` only from the internals modules."""
    unlisted = [f"  {importer} (line {line}) imports {name} from {module}"
                for importer, module, name, line in _private_imports(MODULES) if module not in INTERNALS]
    assert not unlisted, ("private names imported from another module (make them public where they are "
                          "used across modules):\n" + "\n".join(sorted(unlisted)))


def test_the_walk_sees_the_imports():
    """The checks above are only as good as the edges: a few that must be found."""
    found = {(a, b) for a, b, _ in EDGES}
    for edge in [("ray_ckpt.client.engine", "ray_ckpt.client.handle"),  # from .handle import ...
                 ("ray_ckpt.client.reading", "ray_ckpt.storage.sharded_io"),  # from ..storage import sharded_io
                 ("ray_ckpt.cli.main", "ray_ckpt"),  # from .. import __version__ (in a function)
                 ("ray_ckpt.capture.mailbox", "ray_ckpt.protocol"),  # inside a function
                 ("ray_ckpt.client.handle", "ray_ckpt.client.push_batch")]:  # under TYPE_CHECKING
        assert edge in found, edge
    private = {(a, b, n) for a, b, n, _ in _private_imports(MODULES)}
    assert ("ray_ckpt.integrations.rllib.replay.journal", "ray_ckpt.integrations.rllib.base._rllib_internals",
            "_rllib_internals") in private  # from ..base import _rllib_internals as internals


def test_the_package_rule_sees_a_circle():
    """The per-package check finds a subpackage and its parent's modules importing each other."""
    packages = {"p", "p.sub"}
    edges = [("p.top", "p.sub.low", 1), ("p.sub.low", "p.names", 2)]
    graph: Dict[str, Set[str]] = {}
    for a, b, _ in edges:
        graph.setdefault(_package_unit("p", a, packages), set()).add(_package_unit("p", b, packages))
    assert _circles(graph) == [["p", "p.sub"]]
