"""The package's structure: imports point down the stages, never in a circle, and no source file
grows past what one reader can hold. Read from the sources with ``ast`` (every import statement,
at module level or inside a function), nothing is imported."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "gla_inductor"

# The stages from the bottom up: a module may import its own stage and the ones below it.
STAGES = [
    ("gla_inductor.config", "gla_inductor.gates", "gla_inductor.reference", "gla_inductor.cache_key",
     "gla_inductor.cost"),
    ("gla_inductor.contract",),
    ("gla_inductor.impl",),
    ("gla_inductor.kernels",),
    ("gla_inductor.ops",),
    ("gla_inductor.lowerings",),
    ("gla_inductor.recognize",),
    ("gla_inductor.backend",),
    ("gla_inductor.explain",),
    ("gla_inductor.distributed",),
]
MAX_LINES = 800


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The package's modules that ``name`` imports: ``from a import b`` names module a.b where
    there is one, else a (b is defined in a)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in found if m in modules and m != name}


def _stage(name: str) -> int:
    for i, prefixes in enumerate(STAGES):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return len(STAGES)  # the package face: above everything


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_stage(graph):
    assert [m for m in graph if _stage(m) == len(STAGES) and m != "gla_inductor"] == []


def test_imports_point_down(graph):
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if _stage(d) > _stage(m))
    assert upward == []


def test_no_import_cycles(graph):
    # a module's package __init__ runs before it: count "a.b imports a" edges only where written
    seen, on_path, cycles = set(), [], []

    def visit(m):
        if m in on_path:
            cycles.append(on_path[on_path.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        on_path.append(m)
        for d in sorted(graph[m]):
            visit(d)
        on_path.pop()

    for m in sorted(graph):
        visit(m)
    assert cycles == []


def test_source_files_stay_readable():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
