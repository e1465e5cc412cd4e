"""The engine stays in small named parts: no function in ``nanovllm/engine/`` over 60 lines, and the model
runner and the engine each under 300 lines. Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "src" / "nanovllm" / "engine"
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300
SMALL_CLASSES = {"model_runner.py": "ModelRunner", "llm_engine.py": "LLMEngine"}


def lines(node: ast.AST) -> int:
    """Lines from a definition's first decorator to its last line."""
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return node.end_lineno - first + 1


def engine_modules() -> dict[str, ast.Module]:
    return {path.name: ast.parse(path.read_text(), str(path)) for path in sorted(ENGINE.glob("*.py"))}


def test_no_engine_function_is_over_60_lines():
    long = [f"{name}:{node.lineno} {node.name} ({lines(node)} lines)"
            for name, tree in engine_modules().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines(node) > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: split them into named steps: {long}"


def test_the_model_runner_and_the_engine_are_under_300_lines():
    modules = engine_modules()
    for file, name in SMALL_CLASSES.items():
        found = [n for n in modules[file].body if isinstance(n, ast.ClassDef) and n.name == name]
        assert found, f"class {name} is no longer in engine/{file}; update this test"
        assert lines(found[0]) < MAX_CLASS_LINES, f"{name} has {lines(found[0])} lines, {MAX_CLASS_LINES} at most"


def test_the_measure_counts_what_it_claims():
    tree = ast.parse("@decorator\ndef f():\n    a = 1\n    return a\n\n\nclass C:\n    x = 1\n")
    function, cls = tree.body
    assert lines(function) == 4 and lines(cls) == 2
