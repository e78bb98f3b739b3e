"""The shape the code keeps (issue 10): the critic is asked about only inside its classes, no
keyword argument is swallowed silently, and rewards and evaluation know no task; and (issues 22,
37) the import graph of grpo/ has no cycle, counting the imports inside functions: a lazy import
defers loading a heavy third-party module (torch, transformers, vLLM), it does not make a cycle
among our own modules acceptable; and (issue 57) the floors stand in order: the config package
imports only errors, refusals and infra, and no two modules share a file name."""

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

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


# ---- the import graph has no cycle --------------------------------------------------------------


def module_names(root):
    """Every module of the package at `root`: dotted name -> its file."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _is_type_checking(test):
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_that_run(tree):
    """The import statements of a module that may run: when it is imported (in its body, and the
    blocks, try/except and class bodies in it) or later (in a function), as `import x` for a
    call `importlib.import_module("x")` too; not those under `if TYPE_CHECKING:`, which never run."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _is_import_module(node):
            yield ast.Import(names=[ast.alias(name=node.args[0].value)])
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            pending += node.orelse
        else:
            pending += ast.iter_child_nodes(node)


def _is_import_module(node):
    """A call `import_module("a.b")` or `importlib.import_module("a.b")` with a literal name."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return False
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    return name == "import_module" and isinstance(node.args[0].value, str)


def _with_parents(name):
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def import_graph(root):
    """module -> the modules of the package that must have run for it to run, or for one of its
    functions to (an import inside a function counts as much as one at the top).

    Importing `pkg.sub` runs pkg/__init__.py first, so it needs `pkg` too, except where `pkg`
    holds the importing module itself (then it is already running and gives the module object).
    `from pkg import name` needs the submodule `pkg.name` when there is one, and otherwise
    `pkg` itself, run to the end (where `name` is bound), even from inside `pkg`."""
    names = module_names(root)
    graph = {}
    for module, path in names.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        running = set(_with_parents(module))  # those that have started when `module` runs
        needs = set()
        for node in imports_that_run(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                targets = [source]
                for alias in node.names:
                    if f"{source}.{alias.name}" in names:
                        targets.append(f"{source}.{alias.name}")
                    else:
                        needs.add(source)  # an attribute bound by the package's own code
            for target in targets:
                needs.update(n for n in _with_parents(target) if n not in running)
        graph[module] = sorted(n for n in needs if n in names and n != module)
    return graph


def find_cycle(graph):
    """One cycle of `graph` as [a, b, ..., a], or None."""
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        path.append(node)
        for target in graph.get(node, ()):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def import_cycle(root):
    """One import cycle of the package at `root` (lazy imports included) as [a, b, ..., a], or None."""
    return find_cycle(import_graph(root))


def test_the_import_graph_has_no_cycle():
    cycle = import_cycle(PACKAGE)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def write_package(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize(
    "files,cycle",
    [
        # Two modules that import each other, however they name it.
        ({"a.py": "from pkg import b\n", "b.py": "import pkg.a\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
        ({"a.py": "from .b import f\n", "b.py": "from . import a\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
        # An attribute of the package, taken by a module the package's __init__ imports first.
        (
            {"__init__.py": "from pkg.a import f\nX = 1\n", "a.py": "from pkg import X\ndef f(): pass\n"},
            ["pkg", "pkg.a", "pkg"],
        ),
        # Importing pkg.sub.mod runs pkg/sub/__init__.py, which imports the importer.
        (
            {"a.py": "import pkg.sub.m\n", "sub/__init__.py": "from pkg import a\n", "sub/m.py": ""},
            ["pkg.a", "pkg.sub", "pkg.a"],
        ),
        # Inside a class body or a try block, the import runs at import time too.
        (
            {
                "a.py": "class A:\n    from pkg import b\n",
                "b.py": "try:\n    import pkg.a\nexcept ImportError:\n    pass\n",
            },
            ["pkg.a", "pkg.b", "pkg.a"],
        ),
        # Inside a function (a lazy import), or by importlib with the module's name, it runs later:
        # still a cycle.
        ({"a.py": "from pkg import b\n", "b.py": "def f():\n    from pkg import a\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
        (
            {
                "a.py": "import importlib\ndef f():\n    return importlib.import_module('pkg.b')\n",
                "b.py": "import pkg.a\n",
            },
            ["pkg.a", "pkg.b", "pkg.a"],
        ),
        # Not cycles: under TYPE_CHECKING, a sibling taken from the package, a lazy third-party import.
        (
            {
                "a.py": "from pkg import b\n",
                "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
            },
            None,
        ),
        ({"__init__.py": "from pkg.a import f\n", "a.py": "from pkg import b\ndef f(): pass\n", "b.py": ""}, None),
        ({"a.py": "from pkg import b\n", "b.py": "def f():\n    import torch\n    import json\n"}, None),
    ],
)
def test_the_cycle_check_sees_every_import_cycle(tmp_path, files, cycle):
    files = {"__init__.py": "", **files}
    root = write_package(tmp_path, {f"pkg/{name}": text for name, text in files.items()})
    assert import_cycle(root) == cycle


def test_a_cycle_through_an_import_inside_a_function_fails_the_check(tmp_path):
    """The check on a planted package: a imports b when it is imported, b imports a only inside
    a function (so that Python never fails on it); at module granularity that is a cycle."""
    root = write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import g\n\ndef f():\n    return g()\n",
            "pkg/b.py": "def g():\n    from pkg.a import f\n\n    return f\n",
        },
    )
    assert import_cycle(root) == ["pkg.a", "pkg.b", "pkg.a"]
    (root / "b.py").write_text("def g():\n    return None\n")  # the lazy import gone: no cycle
    assert import_cycle(root) is None


# ---- the floors: the config stands on errors, refusals and infra alone --------------------------

# What grpo/config/ may import (each a module, or a package with everything below it): the
# schema is read by every floor above it, so it knows no decoder, engine or training code.
CONFIG_MAY_IMPORT = ("grpo.config", "grpo.errors", "grpo.refusals", "grpo.infra")


def _within(module, allowed):
    return any(module == a or module.startswith(a + ".") for a in allowed)


def imports_outside(graph, package, allowed):
    """'a -> b' for each module `a` of `package` (the package and all below it) that needs a
    module `b` of the graph outside `allowed` (lazy imports included, as `import_graph` counts)."""
    return [
        f"{module} -> {needed}"
        for module, needs in sorted(graph.items())
        if _within(module, [package])
        for needed in needs
        if not _within(needed, allowed)
    ]


def test_the_config_imports_only_errors_refusals_and_infra():
    assert imports_outside(import_graph(PACKAGE), "grpo.config", CONFIG_MAY_IMPORT) == []


def test_the_floor_check_sees_an_import_from_above(tmp_path):
    """A planted package: its config takes a name of the rollout package inside a function."""
    root = write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/errors.py": "",
            "pkg/config/__init__.py": "from pkg.config.a import f\n",
            "pkg/config/a.py": "from pkg.errors import E\n\ndef f():\n    from pkg.rollout.x import g\n",
            "pkg/rollout/__init__.py": "",
            "pkg/rollout/x.py": "",
        },
    )
    allowed = ("pkg.config", "pkg.errors")
    assert imports_outside(import_graph(root), "pkg.config", allowed) == [
        "pkg.config.a -> pkg.rollout",
        "pkg.config.a -> pkg.rollout.x",
    ]
    (root / "config" / "a.py").write_text("from pkg.errors import E\n")
    assert imports_outside(import_graph(root), "pkg.config", allowed) == []


# ---- no two modules share a file name -------------------------------------------------------------


def shared_names(root):
    """Each file name (but __init__.py) that two or more modules under `root` bear -> their paths:
    a traceback, an editor's tab and `-k` name a module by its file name alone."""
    paths = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.name != "__init__.py":
            paths[path.name].append(str(path.relative_to(root)))
    return {name: found for name, found in paths.items() if len(found) > 1}


def test_no_two_modules_share_a_file_name():
    assert shared_names(PACKAGE) == {}
