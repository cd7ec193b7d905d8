"""The house rules of docs/architecture.md, checked on the source: bench → pipeline → serving and never back, no
import circle, pipeline/'s verbs at its top and its building blocks in packages, serving/'s functions short."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "serving", "bench")
# The entry points, the verbs of one file and the four modules every verb uses; anything else goes in a package.
PIPELINE_TOP = {"__init__", "__main__", "cli", "config", "precision", "artifacts", "errors",
                "predict", "verify", "demo", "serve"}
MAX_SERVING_FUNCTION_LINES = 60


def _module_files() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _module_files()


def _imported(name: str, path: Path) -> set[str]:
    """The project's modules that `name` imports anywhere in its file (a function's lazy import counts too: a
    circle through it is still a circle), with the packages whose __init__ an import runs on the way. Its own
    packages are left out: they are imported before it runs."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                module = ".".join(parts[:i])
                if module in MODULES and module != name and not name.startswith(module + "."):
                    found.add(module)
    return found


GRAPH = {name: _imported(name, path) for name, path in MODULES.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
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
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_in_a_circle():
    assert _circles(GRAPH) == []


@pytest.mark.parametrize(("package", "forbidden"), [("serving", ("pipeline", "bench")), ("pipeline", ("bench",))])
def test_dependencies_point_one_way(package, forbidden):
    wrong = sorted(f"{name} imports {target}" for name, targets in GRAPH.items() if name.split(".")[0] == package
                   for target in targets if target.split(".")[0] in forbidden)
    assert wrong == []


def test_pipeline_shows_its_verbs_at_the_top():
    top = {path.stem for path in (ROOT / "pipeline").glob("*.py")}
    assert top - PIPELINE_TOP == set(), "a building block belongs in a package of pipeline/ (docs/architecture.md)"
    assert PIPELINE_TOP - top == set()


def test_serving_functions_are_short():
    long = []
    for path in sorted((ROOT / "serving").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_SERVING_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
