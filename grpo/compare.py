"""`grpo compare A.yaml B.yaml`: two runs on the same data and budget, side by side.

The second config takes the first one's data, seed, step count, prompts per step and
completion length, so that the comparison is about the algorithms (or whatever else the
two configs differ in), not about what they were given. Each run trains in its own process
so that each peak memory reading is its own.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpo.config import config_from_dict, config_to_dict, load_config
from grpo.errors import UserError
from grpo.infra.child import train_in_child
from grpo.tasks import Task, load_task

# What the second run takes from the first: the same data and budget.
ALIGNED = ["data.path", "data.prompt_column", "data.split", "data.task_options", "seed", "train.steps",
           "rollout.prompts_per_step", "rollout.max_new_tokens"]

ROWS = [
    ("models held", "models", "{:d}"),
    ("parameters held", "parameters", "{:,d}"),
    ("peak memory (MB)", "peak_memory_mb", "{:.0f}"),
    ("generated tokens", "generated_tokens", "{:,d}"),
    ("time per step (s)", "time_per_step_s", "{:.3f}"),
    ("total time (s)", "time_s", "{:.1f}"),
    ("final reward (last 5 steps)", "reward/final", "{:.3f}"),
    ("accuracy (pass@1)", "accuracy", "{:.3f}"),
]


def _get(tree: dict, dotted: str):
    for key in dotted.split("."):
        tree = tree[key]
    return tree


def _set(tree: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        tree = tree[key]
    tree[last] = value


def aligned_configs(a: dict, b: dict) -> tuple[dict, list[str]]:
    """b with a's data and budget; and the keys that had to change."""
    b = json.loads(json.dumps(b))
    changed = []
    for key in ALIGNED:
        if _get(b, key) != _get(a, key):
            changed.append(f"{key}: {_get(b, key)!r} -> {_get(a, key)!r}")
            _set(b, key, _get(a, key))
    return b, changed


def _load_task(spec: str) -> Task:
    try:
        return load_task(spec)
    except UserError as err:
        raise UserError(f"compare --task: {err}") from err


def _eval_rows(task: Task | None, eval_data: str | None, seed: int) -> list[dict]:
    """The problems the accuracy is measured on: --eval-data, else 100 the task generates."""
    if task is None:
        return []
    if eval_data:
        from grpo.data import load_rows

        return load_rows(eval_data)
    if task.rows is None:
        raise UserError(f"compare: task {task.name!r} generates no rows; give --eval-data")
    return task.make_rows(100, seed=seed + 1000)


def _accuracy(model_dir: Path, task: Task | None, rows: list[dict], n: int, seed: int) -> float | None:
    if task is None:
        return None
    from grpo.eval.runner import evaluate_saved, task_verifier

    result = evaluate_saved(model_dir, rows, n=n, ks=[1], verifier=task_verifier(task), seed=seed, progress=False)
    return result["pass@k"]["1"]


def format_table(names: list[str], runs: list[dict]) -> str:
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key, fmt in ROWS:
        cells = ["n/a" if run.get(key) is None else fmt.format(run[key]) for run in runs]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare(
    config_a: str,
    config_b: str,
    output: str | Path,
    *,
    overrides: list[str] = (),
    task: str | None = None,
    eval_data: str | None = None,
    n: int = 8,
    progress: bool = True,
) -> dict:
    """Run both configs (with `overrides` applied to both) and return the side-by-side summary.

    With `task` (a built-in task name or 'pkg.module:name', see `grpo.tasks.load_task`), each
    final model's accuracy (pass@1 over n samples) is measured with the task's verifier on
    `eval_data`, or on 100 rows the task generates.
    """
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"compare: '{out}' is not empty; remove it or pass another --output")
    a = config_to_dict(load_config(config_a, overrides))
    b, changed = aligned_configs(a, config_to_dict(load_config(config_b, overrides)))
    # The task and its problems are checked before either run trains, not after both.
    accuracy_task = None if task is None else _load_task(task)
    eval_rows = _eval_rows(accuracy_task, eval_data, a["seed"])
    names = [f"A: {Path(config_a).stem}", f"B: {Path(config_b).stem}"]
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for label, config in (("a", a), ("b", b)):
        config["output_dir"] = str(out / label)
        config_from_dict(config)  # validated as it will run
        run = train_in_child(config, out / f"{label}.yaml", progress=progress)
        run["accuracy"] = _accuracy(out / label / "final", accuracy_task, eval_rows, n, config["seed"])
        runs.append(run)
    table = format_table(names, runs)
    summary = {
        "names": names,
        "aligned": changed,
        "runs": [{k: v for k, v in run.items() if k != "metrics"} for run in runs],
        "table": table,
    }
    (out / "compare.json").write_text(json.dumps(summary, indent=2) + "\n")
    note = ("B took A's data and budget: " + "; ".join(changed)) if changed else "Both configs had the same data and budget."
    (out / "compare.md").write_text(f"# {names[0]} vs {names[1]}\n\n{note}\n\n{table}\n")
    return summary
