"""Tasks as plugins: `load_task` resolves the built-in and a user's task alike, and every
mistake in a spec or a task is a one-line UserError."""

import pytest

from grpo.errors import UserError
from grpo.tasks import TASKS, Task, arithmetic, load_task
from tests.tasks import user_task


def one_line_error(call, *args, **kwargs) -> str:
    with pytest.raises(UserError) as excinfo:
        call(*args, **kwargs)
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_the_builtin_task_is_a_spec_like_a_users():
    assert TASKS == {
        "arithmetic": "grpo.tasks.arithmetic:task",
        "multiply": "grpo.tasks.multiply:task",
        "reasoning_gym": "grpo.tasks.reasoning_gym:task",
    }
    assert load_task("arithmetic") is load_task("grpo.tasks.arithmetic:task") is arithmetic.task
    task = arithmetic.task
    assert (task.verifier, task.extract_answer, task.rows, task.step_verifier, task.threshold) == (
        arithmetic.correctness_reward,
        arithmetic.extract_answer,
        arithmetic.make_rows,
        arithmetic.step_reward,
        0.5,
    )
    assert task.make_rows(3, seed=5) == arithmetic.make_rows(3, seed=5)


def test_a_users_task_by_object_or_by_function():
    assert load_task("tests.tasks.user_task:task") is user_task.task
    assert load_task("tests.tasks.user_task:make_task") is user_task.task
    rows = user_task.task.make_rows(4, seed=1)
    assert rows == user_task.rows(4, seed=1) and all(row["avoid"] == row["prompt"][-1] for row in rows)


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "arithmetc",
            "unknown task 'arithmetc'; did you mean 'arithmetic'? (built-ins: arithmetic, multiply, reasoning_gym; "
            "or give 'pkg.module:name')",
        ),
        (
            "algebra",
            "unknown task 'algebra' (built-ins: arithmetic, multiply, reasoning_gym; or give 'pkg.module:name')",
        ),
        (
            "tests.tasks.no_such_module:task",
            "task 'tests.tasks.no_such_module:task': cannot import module "
            "'tests.tasks.no_such_module' (No module named 'tests.tasks.no_such_module')",
        ),
        (
            "tests.tasks.user_task:nope",
            "task 'tests.tasks.user_task:nope': module 'tests.tasks.user_task' has no attribute 'nope'",
        ),
        ("tests.tasks.user_task:", "task 'tests.tasks.user_task:': expected 'pkg.module:name'"),
        (":task", "task ':task': expected 'pkg.module:name'"),
        (
            "tests.tasks.user_task:not_a_task",
            "task 'tests.tasks.user_task:not_a_task': 'not_a_task' is not a "
            "grpo.tasks.Task or a function that returns one (it is a int)",
        ),
        (
            "tests.tasks.user_task:Task",
            "task 'tests.tasks.user_task:Task': 'Task' is not a grpo.tasks.Task "
            "or a function that returns one (it is a class)",
        ),
        (
            "tests.tasks.user_task:returns_a_dict",
            "task 'tests.tasks.user_task:returns_a_dict': returns_a_dict() returned a dict, not a grpo.tasks.Task",
        ),
        (
            "tests.tasks.user_task:raises",
            "task 'tests.tasks.user_task:raises': calling 'raises' raised RuntimeError: no config for this task",
        ),
        (3, "task 3: expected a built-in name or 'pkg.module:name', got a int"),
    ],
)
def test_load_task_mistakes_are_one_line(spec, message):
    assert one_line_error(load_task, spec) == message


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"verifier": "exact_answer"}, "task 'x': verifier must be a function, got a str"),
        ({"extract_answer": None}, "task 'x': extract_answer must be a function, got a NoneType"),
        ({"rows": [{"prompt": "a"}]}, "task 'x': rows must be a function or None, got a list"),
        ({"threshold": "0.5"}, "task 'x': threshold must be a finite number, got '0.5'"),
        ({"threshold": float("nan")}, "task 'x': threshold must be a finite number, got nan"),
        ({"name": ""}, "task '': name must be a non-empty string"),
    ],
)
def test_a_task_with_a_wrong_field_is_refused_where_it_is_built(fields, message):
    kwargs = {"name": "x", "verifier": user_task.verify, "extract_answer": user_task.extract, **fields}
    assert one_line_error(Task, **kwargs) == message


def test_rows_are_checked():
    message = one_line_error(user_task.verify_only.make_rows, 2, seed=0)
    assert message == "task 'avoid (verify only)' generates no rows (it has no rows function); give data rows"
    message = one_line_error(user_task.task_with_bad_rows.make_rows, 2, seed=0)
    assert message == "task 'bad rows': row 0 is 'abc', not a dict with a 'prompt'"
    short = Task(
        name="short",
        verifier=user_task.verify,
        extract_answer=user_task.extract,
        rows=lambda n, seed: user_task.rows(n - 1, seed=seed),
    )
    assert (
        one_line_error(short.make_rows, 3, seed=0)
        == "task 'short': rows(3, seed=0) returned 2 rows, not a list of 3 rows"
    )
    broken = Task(
        name="broken",
        verifier=user_task.verify,
        extract_answer=user_task.extract,
        rows=lambda n: user_task.rows(n, seed=0),
    )
    assert one_line_error(broken.make_rows, 3, seed=0).startswith("task 'broken': rows(3, seed=0) raised TypeError: ")
