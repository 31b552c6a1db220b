"""The shape of the source tree: no import cycles (lazy imports inside functions count), files of one job."""

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "torchtsp"
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The torchtsp modules ``path`` imports, anywhere in it (top level or inside a function)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from . import x` imports module x
    # A module imports a package's __init__ too, which is fine: only edges to real torchtsp modules count.
    return {m for m in found if m in modules and m != name}


@functools.cache  # the source does not change within a session: three tests read one parse of the tree
def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    return {name: imported_modules(path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_lazy_imports():
    # The detector must see an import inside a function body, or it could not find the cycles that hide there.
    graph = import_graph()
    assert "torchtsp.infer" in graph["torchtsp.train.trainer"]


def test_no_import_cycles_under_src():
    graph = {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in import_graph().items()}
    # A package's __init__ that re-exports its own submodules is not a cycle through them.
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_source_files_stay_readable(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES, f"{path} has more than {MAX_LINES} lines: split it"


# The floors of the house (issue #58): a package imports only from the floors below it. What two floors share lives
# below both (at the package root: kv_layouts.py, sizes.py, schemes.py). An edge is one module importing another,
# at its top or inside a function; what that module imports in turn is its own floor's business (docs/design.md,
# "Layout of the code": the root holds both the ground floor and the entry points such as cli.py and trace.py).
FLOORS = {
    "analysis": ("serve", "train", "bench"),
    "infer": ("analysis", "serve", "train", "bench"),
    "parallel": ("infer", "serve", "train", "analysis", "bench"),
    "serve": ("train", "bench", "analysis"),
}


def floor_violations(graph: dict[str, set[str]], floors: dict[str, tuple[str, ...]]) -> list[str]:
    def under(name, package):
        return name == f"torchtsp.{package}" or name.startswith(f"torchtsp.{package}.")

    return sorted(f"{name} -> {dep}" for name, deps in graph.items() for floor, above in floors.items()
                  if under(name, floor) for dep in deps if any(under(dep, a) for a in above))


def test_packages_import_only_from_the_floors_below():
    assert floor_violations(import_graph(), FLOORS) == []


def test_floor_violations_finds_an_edge_upward():
    graph = {"torchtsp.infer.tsp": {"torchtsp.analysis", "torchtsp.sizes"}, "torchtsp.analysis.plan": set()}
    assert floor_violations(graph, FLOORS) == ["torchtsp.infer.tsp -> torchtsp.analysis"]


def test_inference_does_not_import_training():
    # Training uses inference (the end-of-run sample); inference reads no training module (tokenizers live in data/,
    # the generate command's checkpoint loading in generate_job.py).
    graph = import_graph()
    offending = {name: sorted(m for m in deps if m.startswith("torchtsp.train"))
                 for name, deps in graph.items() if name.startswith("torchtsp.infer")}
    assert not any(offending.values()), offending
