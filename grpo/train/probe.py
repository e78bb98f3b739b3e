"""`grpo probe CONFIG`: before a run, what its first step would learn from.

The probe builds the run as `grpo train` builds it (the same checks, then `grpo.train.loop.Run`:
seed, models, generator, prompt stream) and takes step 1's batch with the base policy, so that
with the same config and seed every number it reports is that of the first step's metrics:
the share of groups whose rewards differ (the only ones with an advantage), each group's
pass rate (the share of its samples whose reward is >= a threshold), each reward function's
mean, the share cut at rollout.max_new_tokens and the tokens per sample. The time per step is
measured, not estimated: the probe runs that one step, update included, on its own engine,
which is then thrown away (the first step's time, one-time costs included). Nothing is
written into output_dir. A verdict names the one change to make first (`verdict`); the
user's guide is docs/evaluation.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from grpo.config import Config
from grpo.errors import UserError
from grpo.infra.contain import run_workers
from grpo.infra.devices import resolve_device
from grpo.infra.distributed import SingleProcess
from grpo.infra.logging import Sinks, write_atomic
from grpo.train.loop import Run, as_config, check_inputs
from grpo.train.preflight import preflight
from grpo.train.step import train_step

GO = 0.5  # at least this share of groups whose rewards differ: the run learns from most of its batch
SOME = 0.1  # below this share, almost no group teaches
CUT = 0.5  # at least this share cut at max_new_tokens: the budget, not the model, decides the rewards
ALL_CUT = 0.9  # nothing teaches and (almost) no sample ends: the budget first

# The pass-rate histogram's bins: (label, lowest rate, highest rate), both included.
BINS = (
    ("0", 0.0, 0.0),
    ("(0,1/4]", 1e-12, 0.25),
    ("(1/4,1/2]", 0.25 + 1e-12, 0.5),
    ("(1/2,3/4]", 0.5 + 1e-12, 0.75),
    ("(3/4,1)", 0.75 + 1e-12, 1.0 - 1e-12),
    ("1", 1.0, 1.0),
)

# What a probe reports from the step's own metrics (metrics.jsonl's names), before any update.
FROM_STEP = (
    "reward/mean",
    "reward/std",
    "frac_zero_std_groups",
    "frac_unscored",
    "frac_truncated",
    "completion_length/mean",
    "tokens/completion",
    "time/step",
    "time/generate",
    "time/score",
    "time/update",
)


class _NoFolder:
    """The probe's output folder: claimed by nobody, holding no checkpoint to resume."""

    def claim(self, *, resume: bool, overwrite: bool) -> bool:
        return False


@run_workers()  # its reward and tool workers stop with it
def probe(
    config: Config | dict | str | Path,
    *,
    overrides: list[str] = (),
    prompts: int | None = None,
    threshold: float | None = None,
) -> dict:
    """Sample step 1's batch of `config` (with `overrides`) with the base policy, score it, run
    the step, and return the numbers and the verdict (`report`). `prompts`: sample that many
    prompts instead of rollout.prompts_per_step (then it is not exactly the first step's
    batch); `threshold`: a sample passes at reward >= this (default: eval.threshold, else 0.5)."""
    c = as_config(config, overrides)
    first = prompts is None or prompts == c.rollout.prompts_per_step
    if not first:
        if prompts < 1:
            raise UserError(f"--prompts: must be >= 1, got {prompts}")
        c = as_config(config, [*overrides, f"rollout.prompts_per_step={prompts}"])
    if threshold is None:
        threshold = 0.5 if c.eval.threshold is None else c.eval.threshold
    if not math.isfinite(threshold):
        raise UserError(f"--threshold: must be a finite number, got {threshold}")
    device = resolve_device(c.train.device)
    preflight(c, 1, device)  # one process samples the whole batch
    world = SingleProcess()
    inputs = check_inputs(c, world, _NoFolder(), resume=False, overwrite=False)
    run = Run(c, world, device, _NoFolder(), inputs, Sinks([]), progress=False)
    try:
        run.generator.start(run.engine.policy)
        run.rollouts.ahead = 0  # the probe takes one batch: none is sampled ahead
        run.rollouts.start(run.engine, 0)
        sampled, taken = run.rollouts.take(run.engine, 0)
        result = train_step(run.engine, sampled, 0, taken["time/generate"])
    finally:
        run.rollouts.close()
        run.generator.close()
    names = [w.name for w in run.engine.rewards]
    return report(c, {**result.metrics, **taken}, result.scores, names, threshold, first_step=first)


def pass_rates(scores: torch.Tensor, group_size: int, threshold: float) -> list[float]:
    """Each group's share of samples whose reward is >= `threshold` (an unscored one, NaN, fails)."""
    return (scores.view(-1, group_size) >= threshold).float().mean(1).tolist()


def histogram(rates: list[float]) -> dict[str, float]:
    """The share of groups in each of BINS."""
    return {label: sum(lo <= r <= hi for r in rates) / len(rates) for label, lo, hi in BINS}


def report(
    c: Config, metrics: dict, scores: torch.Tensor, names: list[str], threshold: float, *, first_step: bool = True
) -> dict:
    """The probe's numbers (metrics.jsonl's names where they are the step's), the pass rates
    and the verdict with the change to make. `first_step`: the batch is step 1's (all of
    rollout.prompts_per_step)."""
    ro = c.rollout
    rates = pass_rates(scores, ro.group_size, threshold)
    numbers = {
        "model": c.model,
        "seed": c.seed,
        "first_step": first_step,
        "prompts": ro.prompts_per_step,
        "group_size": ro.group_size,
        "max_new_tokens": ro.max_new_tokens,
        "threshold": threshold,
        **{key: metrics[key] for key in FROM_STEP},
        **{f"reward/{name}": metrics[f"reward/{name}"] for name in names},
        "groups_teaching": None if ro.group_size == 1 else 1.0 - metrics["frac_zero_std_groups"],
        "pass_rates": rates,
        "pass_rate_histogram": histogram(rates),
    }
    numbers["verdict"], numbers["advice"] = verdict(numbers)
    return numbers


def verdict(n: dict) -> tuple[str, str]:
    """The one change to make first, from a probe's numbers (`report`'s), and why; the rules
    in order (docs/evaluation.md): nothing scored; most groups teach (then the budget, or go);
    most of the rest pass everything; (almost) nothing ends; some groups teach; none does."""
    cut, group_size, budget = n["frac_truncated"], n["group_size"], n["max_new_tokens"]
    if n["frac_unscored"] == 1.0:
        return "fix the rewards", (
            "no reward scored any completion (every one returned None): check the reward functions and the data's columns"
        )
    teaching = n["groups_teaching"]
    if teaching is None:  # G = 1 (PPO): the critic's baseline learns from any spread over the batch
        teaching = 1.0 if n["reward/std"] > 0 else 0.0
    if teaching >= GO:
        if cut >= CUT:
            return "raise the budget", (
                f"{cut:.0%} of the samples are cut at rollout.max_new_tokens ({budget}) and scored without their "
                "end: raise rollout.max_new_tokens (or ask for shorter answers)"
            )
        return "go", f"{teaching:.0%} of the groups' rewards differ: train"
    rates = n["pass_rates"]
    solved, failed = sum(r == 1.0 for r in rates) / len(rates), sum(r == 0.0 for r in rates) / len(rates)
    if solved > failed:
        return "make it harder", (
            f"{solved:.0%} of the groups pass every sample (reward >= {n['threshold']:g}): harder prompts or a "
            "stricter reward leave the run something to learn"
        )
    if cut >= ALL_CUT:
        return "raise the budget", (
            f"{cut:.0%} of the samples are cut at rollout.max_new_tokens ({budget}) and almost no group's rewards "
            "differ: raise rollout.max_new_tokens (a model that never ends at any length needs `grpo sft` first)"
        )
    if teaching >= SOME:
        return "raise G", (
            f"only {teaching:.0%} of the groups' rewards differ and most fail every sample: raise "
            f"rollout.group_size (now {group_size}) so that more groups hold a pass, or make the task easier"
        )
    return "warm up", (
        f"{teaching:.0%} of the groups' rewards differ: the model does not hit the reward yet; warm it up with "
        "`grpo sft` on worked answers (docs/sft.md), or make the task easier"
    )


def table(n: dict) -> str:
    """The probe's numbers as a short table and the verdict line."""
    first = " (the first step's batch)" if n["first_step"] else ""
    teaching = n["groups_teaching"]
    rows = [
        ("groups that teach (rewards differ)", "n/a (G = 1)" if teaching is None else f"{teaching:.0%}"),
        (
            f"groups by pass rate (reward >= {n['threshold']:g})",
            "  ".join(f"{label}: {share:.0%}" for label, share in n["pass_rate_histogram"].items()),
        ),
        ("reward", f"mean {n['reward/mean']:.3g}  std {n['reward/std']:.3g}"),
        *[(f"  {key[7:]}", f"mean {value:.3g}") for key, value in n.items() if _is_function_mean(key)],
        (f"cut at max_new_tokens ({n['max_new_tokens']})", f"{n['frac_truncated']:.0%}"),
        ("unscored (every reward None)", f"{n['frac_unscored']:.0%}"),
        ("tokens per sample", f"{n['completion_length/mean']:.1f}"),
        (
            "time per step",
            f"{n['time/step']:.3g} s (sampling {n['time/generate']:.3g} s, scoring {n['time/score']:.3g} s, "
            f"update {n['time/update']:.3g} s)",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    head = f"grpo probe: {n['prompts']} prompts x {n['group_size']} samples{first}, seed {n['seed']}, {n['model']}"
    lines = [head, *(f"  {name.ljust(width)}  {value}" for name, value in rows)]
    return "\n".join([*lines, f"verdict: {n['verdict']}: {n['advice']}"])


def _is_function_mean(key: str) -> bool:
    return key.startswith("reward/") and key not in ("reward/mean", "reward/std")


def write_json(n: dict, path: str | Path) -> None:
    """All of the probe's numbers, its verdict included, as one JSON object in `path`."""
    write_atomic(Path(path), json.dumps(n, indent=2) + "\n")


def command(
    config: str,
    *,
    overrides: list[str] = (),
    prompts: int | None = None,
    threshold: float | None = None,
    json_path: str | None = None,
) -> int:
    """`grpo probe`: the table and the verdict printed, every number in `json_path` if given."""
    from transformers.utils import logging as hf_logging

    if json_path and (Path(json_path).is_dir() or not Path(json_path).parent.is_dir()):
        raise UserError(f"--json: cannot write {json_path!r}: its folder does not exist or it is a folder")
    hf_logging.disable_progress_bar()  # no bars per weight file
    numbers = probe(config, overrides=overrides, prompts=prompts, threshold=threshold)
    if json_path:
        write_json(numbers, json_path)
    print(table(numbers))
    return 0
