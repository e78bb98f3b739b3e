"""Tasks as plugins (rows + verifier + answer extractor), the built-in arithmetic task, and
the tiny models it runs on (no hub download needed).

`load_task(spec)` resolves a built-in name ("arithmetic") or a user's 'pkg.module:name' to a
`Task`; the built-in task is registered exactly as a user's would be (see `grpo.tasks.base`).
"""

from grpo.tasks.base import TASKS, Task, load_task

__all__ = ["TASKS", "Task", "load_task"]
