"""summary.json's entries for the default demo: a model's curves (and, trained, what it cost and
its per-step curves), its pass@k and maj@k per operand length, and an arm over its seeds."""

from __future__ import annotations


def true_accuracy(run: dict) -> list[float]:
    key = "reward/arithmetic_correct" if "reward/arithmetic_correct" in run["metrics"][0] else "reward/mean"
    return [m[key] for m in run["metrics"]]


def model_entry(result: dict, run: dict | None) -> dict:
    """One model's entry in summary.json: its curves, and for trained ones what it cost."""
    entry = {
        "pass@k": result["pass@k"],
        "maj@k": result["maj@k"],
        "pass@k_ci": result["pass@k_ci"],
        "maj@k_ci": result["maj@k_ci"],
        "no_answer": result["no_answer"],
    }
    if run is not None:
        entry.update(
            {
                key: run[key]
                for key in (
                    "models",
                    "parameters",
                    "peak_memory_mb",
                    "time_s",
                    "generated_tokens",
                    "steps",
                    "prompts",
                    "time_per_step_s",
                )
            }
        )
        entry["reward"] = [m["reward/mean"] for m in run["metrics"]]
        entry["true_accuracy"] = true_accuracy(run)
        entry["completion_length"] = [m["completion_length/mean"] for m in run["metrics"]]
        scored = [k for k in run["metrics"][0] if k.startswith("reward/model:")]
        if scored:  # a reward model's mean score per step (beside the true accuracy: hacking shows)
            entry["rm_score"] = [m[scored[0]] for m in run["metrics"]]
        if "rm_updates" in run:  # iterative RL: each update of the reward model
            entry["rm_updates"] = run["rm_updates"]
    return entry


def by_digits(result: dict, rows: list[dict]) -> dict:
    """pass@k and maj@k per operand length, from the per-problem values."""
    groups: dict[int, list[dict]] = {}
    for row, prompt in zip(rows, result["per_prompt"]):
        groups.setdefault(row["digits"], []).append(prompt)
    return {
        str(d): {
            metric: {k: sum(p[metric][k] for p in ps) / len(ps) for k in ps[0][metric]}
            for metric in ("pass@k", "maj@k")
        }
        for d, ps in sorted(groups.items())
    }


def arm_entry(done: list[tuple[int, dict, dict]], rows: list[dict]) -> dict:
    """An arm's entry: each number the mean over seeds; the intervals over problems, of each
    problem's value averaged over seeds; the spread (lowest and highest seed) beside it; and
    every seed's own numbers under per_seed."""
    from grpo.eval.metrics import over_seeds

    per_seed = [
        {"seed": seed, **model_entry(result, run), "by_digits": by_digits(result, rows)} for seed, run, result in done
    ]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    entry = over_seeds([result for _, _, result in done])
    averaged = {"per_prompt": entry.pop("per_prompt")}  # each problem's values averaged over seeds
    for key in ("no_answer", "peak_memory_mb", "time_s", "generated_tokens", "time_per_step_s"):
        entry[key] = mean([s[key] for s in per_seed])
    for key in ("models", "parameters", "steps", "prompts"):
        entry[key] = per_seed[0][key]
    for key in ("reward", "true_accuracy", "completion_length", "rm_score"):
        if key in per_seed[0]:
            entry[key] = [mean(values) for values in zip(*(s[key] for s in per_seed))]
    entry["by_digits"] = by_digits(averaged, rows)
    entry["per_seed"] = per_seed
    return entry
