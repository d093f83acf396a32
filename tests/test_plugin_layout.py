"""The plugin's shape: modules split by concept before they grow long, and no import circles.

The plugin is ``vllm_eagle2/`` and ``kernels/`` (installed as ``vllm_eagle2.kernels``). Read from
the source with ``ast``, so these run in a second and import nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def plugin_modules() -> dict[str, Path]:
    """Dotted name -> file of every plugin module, as installed."""
    modules = {}
    for folder, package in ((ROOT / "vllm_eagle2", "vllm_eagle2"), (ROOT / "kernels", "vllm_eagle2.kernels")):
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The plugin modules ``name`` imports anywhere in its file (inside functions and under
    ``TYPE_CHECKING`` too: a circle broken by a late import is still a circle). Its own parent
    packages are left out: Python runs them first whatever a module imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            candidates = submodules if len(submodules) == len(node.names) else [base, *submodules]
        else:
            continue
        found.update(c for c in candidates if c in modules and c != name and not name.startswith(c + "."))
    return found


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_plugin_modules_import_each_other_in_a_circle():
    modules = plugin_modules()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert sum(len(deps) for deps in graph.values()) > 100  # the scan sees the plugin's imports
    assert import_circles(graph) == []


def test_the_circle_finder_finds_a_circle_through_a_late_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("name", sorted(plugin_modules()))
def test_plugin_modules_stay_within_the_line_cap(name):
    lines = len(plugin_modules()[name].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{name}: {lines} lines; split it by concept"


def long_functions(path: Path) -> list[tuple[str, int]]:
    """Functions of ``path`` longer than the cap, from ``def`` to their last line, but for Triton
    kernels (``@triton.jit``: one launch is one function, split only at a cost)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any("triton.jit" in ast.unparse(d) for d in node.decorator_list):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append((node.name, lines))
    return found


def test_plugin_functions_stay_within_the_line_cap_outside_triton_kernels():
    too_long = {name: long_functions(path) for name, path in plugin_modules().items()}
    assert {name: found for name, found in too_long.items() if found} == {}


def test_the_function_cap_exempts_triton_kernels_only(tmp_path):
    body = "\n".join(["    x = 1"] * MAX_FUNCTION_LINES)
    source = tmp_path / "m.py"
    source.write_text(f"@triton.jit\ndef kernel():\n{body}\n\ndef helper():\n{body}\n")
    assert long_functions(source) == [("helper", MAX_FUNCTION_LINES + 1)]
