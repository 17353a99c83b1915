"""Code imports only `unipage.*`: the bare names of the sibling folders are taken on PyPI."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BARE = {"kernels", "scheduler", "server", "sim"}
FOLDERS = ("unipage", "kernels", "scheduler", "server", "sim", "tests", "benchmarks", "examples")


def bare_imports(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"line {node.lineno}: {n}" for n in names if n.split(".")[0] in BARE]
    return found


def python_files():
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_the_checker_catches_bare_imports():
    assert bare_imports("import kernels\nfrom sim.x import y\nimport unipage.sim\n") == [
        "line 1: kernels", "line 2: sim.x"]


@pytest.mark.parametrize("path", list(python_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_bare_sibling_imports(path):
    assert bare_imports(path.read_text()) == [], f"{path}: import unipage.<name> instead"


def test_every_subpackage_imports():
    import importlib

    for name in ("unipage", "unipage.kernels", "unipage.scheduler", "unipage.server", "unipage.sim"):
        importlib.import_module(name)
