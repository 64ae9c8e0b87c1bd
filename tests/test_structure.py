"""The package's shape: no import cycles, no private names across modules, no import-time
asserts."""

from __future__ import annotations

import ast
from pathlib import Path

import django_idempotency
from django_idempotency import _problems

PACKAGE = Path(django_idempotency.__file__).parent
MODULES = {
    ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
    for path in PACKAGE.rglob("*.py")
}


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules that ``name`` imports, at module level or inside functions."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {module for module in found if module in MODULES and module != name}


def test_no_import_cycles():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    # __init__ loads its public names lazily; a package's own __init__ is not an edge.
    graph["django_idempotency"] = set()
    cycles: list[list[str]] = []

    def visit(name: str, trail: list[str]) -> None:
        for target in sorted(graph[name]):
            if target in trail:
                cycles.append([*trail[trail.index(target) :], target])
            elif target not in done:
                visit(target, [*trail, target])
        done.add(name)

    done: set[str] = set()
    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    assert cycles == [], " | ".join(" -> ".join(c) for c in cycles)


def test_no_module_of_the_package_asserts_at_import():
    # ``python -O`` drops asserts: a check made at import time would silently vanish.
    for path in MODULES.values():
        tree = ast.parse(path.read_text(), str(path))
        top_level = [node for node in tree.body if isinstance(node, ast.Assert)]
        assert not top_level, f"{path.name} asserts at import time (line {top_level[0].lineno})"


def test_no_module_imports_another_modules_private_names():
    """Private modules (``_store``) hold the implementation behind the public ones, and any
    module may import them; a private name (``_store._claim``) stays in its module."""
    offenders = []
    short = {name.rpartition(".")[2] for name in MODULES}
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "django_idempotency"
            ):
                offenders += [
                    f"{path.name}: {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and f"{node.module}.{a.name}" not in MODULES
                ]
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in short
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and f"django_idempotency.{node.value.id}.{node.attr}" not in MODULES
            ):
                offenders.append(f"{path.name}: {node.value.id}.{node.attr}")
    assert offenders == []


def test_every_problem_is_listed_once() -> None:
    """``ALL_PROBLEMS`` is written by hand beside the constants: a problem added without it
    would be missing from the OpenAPI schema's enum of codes and from the ninja API's
    answers."""
    declared = [value for value in vars(_problems).values() if isinstance(value, _problems.Problem)]
    assert set(_problems.ALL_PROBLEMS) == set(declared)
    assert len(_problems.ALL_PROBLEMS) == len(declared)
    codes = [problem.code for problem in _problems.ALL_PROBLEMS]
    assert len(set(codes)) == len(codes)
    assert all(code.startswith("idempotency_") for code in codes)
