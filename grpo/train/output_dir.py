"""A run's output_dir: which files are the run's, when a folder may be used (a new run, a
resume, --overwrite), what a resume may change, and the logs beside metrics.jsonl.

One run per folder: a folder that holds a run (logged steps or a checkpoint) is continued
with --resume or emptied with --overwrite, never mixed into. --overwrite removes the files
in `RUN_FILES` and nothing else. A resume rewinds the logs to the checkpoint it continues
from, so that what the stopped run logged after it is redone once, not twice.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from grpo.config import Config, config_to_dict
from grpo.errors import UserError
from grpo.infra.checkpoint import list_checkpoints
from grpo.infra.logging import JsonlSink, read_metrics, truncate_metrics
from grpo.infra.space import writing

__all__ = [
    "RESUME_FIXED",
    "RUN_FILES",
    "check_resume_config",
    "prepare_output",
    "record_update",
    "rewind_logs",
    "write_samples",
]

# What a checkpoint holds depends on these keys: resuming with other values would load
# weights into another model or continue another algorithm. Everything else (more steps,
# logging, checkpointing, the learning rate, ...) may change on resume.
RESUME_FIXED = (
    "model",
    "algorithm",
    "seed",
    "data.path",
    "data.prompt_column",
    "data.split",
    "data.shuffle",
    "rollout.group_size",
    "rollout.prompts_per_step",
    "train.dtype",
    "train.iterations",
    "train.epochs",
    "train.minibatches",
    "loss.baseline",
    "loss.kl_in",
    "loss.supervision",
    "value.model",
    "lora.r",
    "lora.alpha",
    "lora.target_modules",
)
# Files a run writes into output_dir (what --overwrite removes; nothing else is touched).
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "samples.jsonl",
    "summary.json",
    "reward_model_updates.jsonl",
    "checkpoints",
    "final",
    "tensorboard",
    "wandb",
    "wandb_run_id",
    "reward_model",
)


def prepare_output(out: Path, *, resume: bool, overwrite: bool, clear: bool, metrics_path: Path) -> bool:
    """Check output_dir (with `overwrite`, the process that holds the lock, `clear`, empties
    it of an earlier run's files); whether there is a checkpoint to resume."""
    if overwrite:
        if not clear:
            return False
        for name in RUN_FILES:
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        return False
    completed = read_metrics(metrics_path)
    has_checkpoint = bool(list_checkpoints(out))
    if resume:
        if not has_checkpoint and completed:
            raise UserError(
                f"--resume: output_dir '{out}' has {len(completed)} logged step(s) but no checkpoint to continue "
                "from; pass --overwrite to start afresh"
            )
        return has_checkpoint  # nothing done yet: --resume starts from the beginning
    if completed or has_checkpoint:
        raise UserError(
            f"output_dir '{out}' already holds a run; pass --resume to continue it, --overwrite to start "
            "afresh, or choose another output_dir"
        )
    return False


def _dotted(tree: dict, key: str):
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def check_resume_config(c: Config, state: dict) -> None:
    """A UserError when `c` changes what the checkpoint `state` holds (`RESUME_FIXED`)."""
    saved = state.get("config")
    if saved is None:
        return  # a checkpoint from before configs were recorded
    ours = config_to_dict(c)
    if (saved.get("loss", {}).get("beta", 0) == 0) != (c.loss.beta == 0):
        raise UserError(
            "--resume: loss.beta cannot change between 0 and non-zero (it decides whether a reference model is held)"
        )
    changed = [k for k in RESUME_FIXED if _dotted(saved, k) != _dotted(ours, k)]
    if changed:
        detail = ", ".join(f"{k}: {_dotted(saved, k)!r} -> {_dotted(ours, k)!r}" for k in changed)
        raise UserError(
            f"--resume: the config changes what the checkpoint holds ({detail}); resume with the "
            "checkpoint's values, or start afresh with --overwrite"
        )


def rewind_logs(out: Path, step: int, metrics: dict | None) -> None:
    """The logs as they were at the checkpoint of `step` that a resume continues from: what
    the stopped run logged after it is redone. `metrics`: the checkpoint's own copy of step
    `step`'s line, written back when the log lacks it (its write had failed)."""
    metrics_path = out / "metrics.jsonl"
    truncate_metrics(metrics_path, step)
    if metrics and not any(m["step"] == step for m in read_metrics(metrics_path)):
        JsonlSink(metrics_path).log(step, metrics)
    truncate_metrics(out / "samples.jsonl", step)
    truncate_metrics(out / "reward_model_updates.jsonl", step, key="before_step")


def write_samples(path: Path, step: int, result, prompt_column: str) -> None:
    """samples.jsonl: the completions of the step's first prompt, with their rewards (and a
    multi-turn rollout's messages, tool turns included)."""
    batch = result.rollout
    with writing(path), open(path, "a", encoding="utf-8") as f:
        for i in range(min(batch.group_size, len(batch))):  # the first prompt's group
            reward = float(result.scores[i])
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "prompt": batch.rows[i][prompt_column],
                        "completion": batch.completions[i],
                        "reward": reward if math.isfinite(reward) else None,
                        # A multi-turn rollout's whole conversation: the model's turns and the tool messages.
                        **({} if batch.messages is None else {"messages": batch.messages[i]}),
                    }
                )
                + "\n"
            )


def record_update(out: Path, before_step: int, iteration: int, update: dict, updater, save: bool) -> None:
    """reward_model_updates.jsonl: one iterative-RL update of the reward model (and, with
    `save`, the updated model in reward_model/)."""
    path = out / "reward_model_updates.jsonl"
    with writing(path), open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"before_step": before_step, "after_iteration": iteration, **update}) + "\n")
    if save:
        with writing(out / "reward_model"):
            updater.model.save(out / "reward_model")
