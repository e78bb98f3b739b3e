"""`grpo compare A.yaml B.yaml`: two runs on the same data and budget, side by side.

The second config takes the first one's data, seed, step count, prompts per step and
completion length, so that the comparison is about the algorithms (or whatever else the
two configs differ in), not about what they were given. Each run trains in its own process
so that each peak memory reading is its own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grpo.config import config_from_dict, config_to_dict, load_config
from grpo.errors import UserError
from grpo.eval.command import no_answer_warning
from grpo.infra.child import train_in_child
from grpo.tasks import Task, load_task
from grpo.train.preflight import check_installed, check_sampler

# What the second run takes from the first: the same data and budget.
ALIGNED = [
    "data.path",
    "data.prompt_column",
    "data.split",
    "data.task_options",
    "seed",
    "train.steps",
    "rollout.prompts_per_step",
    "rollout.max_new_tokens",
]

ROWS = [
    ("models held", "models", "{:d}"),
    ("parameters held", "parameters", "{:,d}"),
    ("peak memory (MB)", "peak_memory_mb", "{:.0f}"),
    ("generated tokens", "generated_tokens", "{:,d}"),
    ("time per step (s)", "time_per_step_s", "{:.3f}"),
    ("total time (s)", "time_s", "{:.1f}"),
    ("final reward (last 5 steps)", "reward/final", "{:.3f}"),
    ("accuracy (pass@1)", "accuracy", "{:.3f}"),
    ("majority vote (maj@{n})", "maj@n", "{:.3f}"),
    ("no final answer (fraction)", "no_answer", "{:.3f}"),
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


def _verifier(task: Task | None, rows: list[dict], answer: str | None, answer_pattern: str | None):
    """The task's verifier, with the answer extractor that --answer or --answer-pattern name
    (else the task's own), tried on every row as `grpo eval` tries it; None without a task."""
    from grpo.eval.command import answer_extractor, try_on_rows
    from grpo.eval.runner import task_verifier

    extract = answer_extractor(answer, answer_pattern)
    if task is None:
        if extract is not None:
            raise UserError(
                "compare: --answer and --answer-pattern read the answers of the evaluation; give --task too"
            )
        return None
    verifier = task_verifier(task, extract=extract)
    try_on_rows(verifier, rows, f"task {task.name!r}", "prompt", command="compare", data_option="--eval-data")
    return verifier


def _evaluate(model_dir: Path, verifier, rows: list[dict], n: int, seed: int, progress: bool) -> dict:
    """The final model measured as `grpo eval` measures it (grpo.eval.runner.evaluate): n
    samples per problem; pass@1, maj@n and the fraction of samples without an answer."""
    if verifier is None:
        return {"accuracy": None}
    from grpo.eval.runner import evaluate_saved

    result = evaluate_saved(model_dir, rows, n=n, ks=sorted({1, n}), verifier=verifier, seed=seed, progress=progress)
    result.pop("per_prompt")
    return {
        "accuracy": result["pass@k"]["1"],
        "maj@n": result["maj@k"][str(n)],
        "no_answer": result["no_answer"],
        "eval": result,
    }


def format_table(names: list[str], runs: list[dict], *, n: int | None = None) -> str:
    """The side-by-side markdown table; `n`, the samples per problem, names the maj@n row."""
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key, fmt in ROWS:
        cells = ["n/a" if run.get(key) is None else fmt.format(run[key]) for run in runs]
        lines.append(f"| {label.format(n='n' if n is None else n)} | " + " | ".join(cells) + " |")
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
    answer: str | None = None,
    answer_pattern: str | None = None,
    progress: bool = True,
) -> dict:
    """Run both configs (with `overrides` applied to both) and return the side-by-side summary.

    With `task` (a built-in task name or 'pkg.module:name', see `grpo.tasks.load_task`), each
    final model is evaluated as `grpo eval` does it, n samples per problem, with the task's
    verifier on `eval_data`, or on 100 rows the task generates: accuracy (pass@1), maj@n and
    the fraction of samples without a final answer. The answers (maj@n's votes) are read by
    `answer` ('pkg.module:fn') or `answer_pattern` (a regex, see
    grpo.eval.command.pattern_extractor), else by the task's extractor; when most samples have
    none, a warning says so (stderr, compare.md and compare.json's "warnings").
    """
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"compare: '{out}' is not empty; remove it or pass another --output")
    a = config_to_dict(load_config(config_a, overrides))
    b, changed = aligned_configs(a, config_to_dict(load_config(config_b, overrides)))
    # The task and its problems are checked before either run trains, not after both.
    accuracy_task = None if task is None else _load_task(task)
    eval_rows = _eval_rows(accuracy_task, eval_data, a["seed"])
    verifier = _verifier(accuracy_task, eval_rows, answer, answer_pattern)
    names = [f"A: {Path(config_a).stem}", f"B: {Path(config_b).stem}"]
    for label, config in (("a", a), ("b", b)):  # both validated as they will run, before either trains
        config["output_dir"] = str(out / label)
        check_sampler(config_from_dict(config))
        check_installed(config_from_dict(config))
    out.mkdir(parents=True, exist_ok=True)
    runs, warnings = [], []
    for name, (label, config) in zip(names, (("a", a), ("b", b))):
        run = train_in_child(config, out / f"{label}.yaml", progress=progress)
        run.update(_evaluate(out / label / "final", verifier, eval_rows, n, config["seed"], progress))
        warning = no_answer_warning("compare", run.get("no_answer") or 0.0, f"{name}: ")
        if warning:
            print(warning, file=sys.stderr)
            warnings.append(warning)
        runs.append(run)
    table = format_table(names, runs, n=n if verifier is not None else None)
    summary = {
        "names": names,
        "aligned": changed,
        "runs": [{k: v for k, v in run.items() if k != "metrics"} for run in runs],
        "table": table,
        "n": n if verifier is not None else None,
        "warnings": warnings,
    }
    (out / "compare.json").write_text(json.dumps(summary, indent=2) + "\n")
    note = (
        ("B took A's data and budget: " + "; ".join(changed))
        if changed
        else "Both configs had the same data and budget."
    )
    said = "".join(f"\n{warning}\n" for warning in warnings)
    (out / "compare.md").write_text(f"# {names[0]} vs {names[1]}\n\n{note}\n\n{table}\n{said}")
    return summary
