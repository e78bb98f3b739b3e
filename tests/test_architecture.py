"""The shape the code keeps (issue 10): the critic is asked about only inside its classes, no
keyword argument is swallowed silently, and rewards and evaluation know no task."""

import ast
import re
from pathlib import Path

import grpo

PACKAGE = Path(grpo.__file__).parent


def sources(*parts):
    root = PACKAGE.joinpath(*parts)
    return sorted(root.rglob("*.py")) if root.is_dir() else [root]


def test_nothing_outside_the_critic_classes_asks_whether_there_is_a_critic():
    hits = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in sources()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"critic is (not )?None|critic is\b", line)
    ]
    assert hits == []


def test_no_function_swallows_unknown_keywords():
    swallowing = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and node.args.kwarg is not None:
                if node.args.kwarg.arg == "_":
                    swallowing.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert swallowing == []


def imported_modules(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_rewards_and_eval_import_no_task():
    edges = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path in sources("rewards") + sources("eval")
        for module in imported_modules(path)
        if module == "grpo.tasks" or module.startswith("grpo.tasks.")
    ]
    assert edges == []
