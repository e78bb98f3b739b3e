"""A run's output_dir: which files are the run's, when a folder may be used (a new run, a
resume, --overwrite), what a resume may change, and the logs beside metrics.jsonl.

One run per folder: a folder that holds a run (logged steps or a checkpoint) is continued
with --resume or emptied with --overwrite, never mixed into. A run claims the folder only
once its config is checked, and --overwrite sets the earlier run's files (`RUN_FILES`, and
nothing else) aside in `.overwritten/` until the new run is known to start (its models are
built): a run that fails before that puts them back, and removes a folder it created. A
resume rewinds the logs to the checkpoint it continues from, so that what the stopped run
logged after it is redone once, not twice; with no checkpoint to continue (a disk that
filled before the first), it starts afresh and keeps the logged steps in `previous/`.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import sys
from pathlib import Path

from grpo.config import Config, config_to_dict
from grpo.errors import UserError, first_line
from grpo.infra.checkpoint import list_checkpoints
from grpo.infra.lock import LOCK_FILE, DirectoryLock, NoLock
from grpo.infra.logging import JsonlSink, read_metrics, truncate_metrics
from grpo.infra.space import writing

__all__ = [
    "RESUME_FIXED",
    "RUN_FILES",
    "OutputFolder",
    "check_resume_config",
    "record_update",
    "rewind_logs",
    "sample_rows",
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
    "data.config",
    "data.prompt_column",
    "data.split",
    "data.shuffle",
    "rollout.group_size",
    "rollout.prompts_per_step",
    "train.dtype",
    "train.iterations",
    "train.epochs",
    "train.minibatches",
    "train.optimizer",
    "train.optimizer_in_backward",
    "loss.baseline",
    "loss.kl_in",
    "loss.supervision",
    "value.model",
    "lora.r",
    "lora.alpha",
    "lora.target_modules",
    "lora.init_adapter",  # its rank and target modules shape the adapter the checkpoint holds
)
# Files a run writes into output_dir (what --overwrite removes; nothing else is touched),
# and the logs a --resume with no checkpoint set aside (`previous`, `previous-2`, ...).
PREVIOUS = "previous"
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "samples.jsonl",
    "summary.json",
    "reward_model_updates.jsonl",
    "checkpoints",
    "final",
    "best",  # train.keep_best's best evaluated policy, and its swap's folders (grpo.train.evaluation)
    "best.tmp",
    "best.old",
    "hub.tmp",  # train.hub_strategy every_save: a checkpoint's model while it is pushed (grpo.train.hub)
    "tensorboard",
    "wandb",
    "wandb_run_id",
    "reward_model",
    PREVIOUS,
)
ASIDE = ".overwritten"  # --overwrite: the earlier run's files, until the new run is known to start
DISCARDED = ".overwritten.discard"  # ... and once it is, while they are removed


class OutputFolder:
    """output_dir as a run holds it: locked by process 0 (the only process that touches it),
    claimed once the config is checked, and left as it was found by a run that never started."""

    def __init__(self, out: Path, *, main: bool):
        self.out, self.main = Path(out), main
        self.lock = DirectoryLock(self.out) if main else NoLock()
        self.created: list[Path] = []  # the folders this run made (removed again if it never starts)
        self.held = self.started = False

    def claim(self, *, resume: bool, overwrite: bool) -> bool:
        """Lock the folder and check it against --resume / --overwrite (setting an earlier
        run's files aside); whether there is a checkpoint to resume."""
        out = self.out
        if out.exists() and not out.is_dir():
            raise UserError(f"output_dir '{out}' is a file, not a directory")
        if self.main:
            self.created = [p for p in (out, *out.parents) if not p.exists()]
        self.lock.acquire()  # before anything in the folder is read, let alone moved
        self.held = True
        if not self.main:
            return resume and bool(list_checkpoints(out))  # process 0 alone reads the logs and moves files
        _recover(out)  # what a run killed before it started left set aside
        return _prepare(out, resume=resume, overwrite=overwrite)

    def start(self) -> None:
        """The run is known to start (its models are built): the earlier run that --overwrite
        set aside goes now. Process 0, before the run writes its first file."""
        self.out.mkdir(parents=True, exist_ok=True)
        if (self.out / ASIDE).exists():
            (self.out / ASIDE).rename(self.out / DISCARDED)
            shutil.rmtree(self.out / DISCARDED)
        self.started = True

    def release(self) -> None:
        """Unlock. A run that never started leaves the folder as it found it: the files
        --overwrite set aside put back, and a folder it created removed (its lock file too)."""
        try:
            if self.main and self.held and not self.started:
                _recover(self.out)  # failing, the next run on the folder does it
                if self.created:
                    _remove_created(self.out, self.created)
        except OSError as err:
            print(
                f"grpo: warning: output_dir '{self.out}' is not as the run found it ({first_line(err)})",
                file=sys.stderr,
            )
        finally:
            self.lock.release()


def _entries(out: Path, previous: bool = True) -> list[Path]:
    """The run's files present in `out` (with `previous`, also the logs set aside there)."""
    names = (
        [*RUN_FILES, *sorted(p.name for p in out.glob(f"{PREVIOUS}-*"))]
        if previous
        else [n for n in RUN_FILES if n != PREVIOUS]
    )
    return [out / name for name in names if (out / name).exists()]


def _remove(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def _move(paths: list[Path], folder: Path) -> None:
    if paths:
        folder.mkdir()
        for path in paths:
            path.rename(folder / path.name)


def _remove_created(out: Path, created: list[Path]) -> None:
    """Remove the folder a run made, and those above it that it made, with what it wrote there
    (a dashboard's first files, say); one that holds anything else stays."""
    _remove(_entries(out))
    (out / LOCK_FILE).unlink(missing_ok=True)  # while still locked: no other run holds it
    for folder in created:  # the innermost first
        if any(folder.iterdir()):
            break
        folder.rmdir()


def _recover(out: Path) -> None:
    """Put back the earlier run that --overwrite set aside for a run that did not start (this
    one, or one killed as it started), removing what that run wrote in its place."""
    if (out / DISCARDED).exists():  # a run killed while it removed them: it had started
        shutil.rmtree(out / DISCARDED)
    aside = out / ASIDE
    if aside.is_dir():
        _remove(_entries(out))
        for path in aside.iterdir():
            path.rename(out / path.name)
        aside.rmdir()


def _prepare(out: Path, *, resume: bool, overwrite: bool) -> bool:
    """What the run does with the folder's earlier run; whether there is a checkpoint to resume."""
    if overwrite:
        _move(_entries(out), out / ASIDE)
        return False
    steps = len(read_metrics(out / "metrics.jsonl"))
    if list_checkpoints(out):
        if resume:
            return True
        raise UserError(
            f"output_dir '{out}' already holds a run; pass --resume to continue it, --overwrite to start "
            "afresh, or choose another output_dir"
        )
    if not steps:
        return False  # nothing done yet: a new run, and --resume starts from the beginning
    if not resume:
        raise UserError(
            f"output_dir '{out}' holds {steps} logged step(s) but no checkpoint; pass --resume to start afresh "
            f"keeping them in {PREVIOUS}/, --overwrite to start afresh without them, or choose another output_dir"
        )
    previous = out / PREVIOUS
    for n in itertools.count(2):  # an earlier start afresh's logs stay where they are
        if not previous.exists():
            break
        previous = out / f"{PREVIOUS}-{n}"
    _move(_entries(out, previous=False), previous)
    print(
        f"grpo: warning: --resume: output_dir '{out}' has {steps} logged step(s) but no checkpoint to continue "
        f"from; starting afresh, their logs kept in {previous}",
        file=sys.stderr,
    )
    return False


_ABSENT = object()


def _dotted(tree: dict, key: str, absent=None):
    for part in key.split("."):
        tree = tree.get(part, absent) if isinstance(tree, dict) else absent
    return tree


def check_resume_config(c: Config, state: dict) -> None:
    """A UserError when `c` changes what the checkpoint `state` holds (`RESUME_FIXED`)."""
    saved = state.get("config")
    if saved is None:
        return  # a checkpoint from before configs were recorded
    ours = config_to_dict(c)
    defaults = config_to_dict(Config())

    def held(key: str):
        """The checkpoint's value; a key newer than its config (train.optimizer) had its default then."""
        value = _dotted(saved, key, _ABSENT)
        return _dotted(defaults, key) if value is _ABSENT else value

    if (saved.get("loss", {}).get("beta", 0) == 0) != (c.loss.beta == 0):
        raise UserError(
            "--resume: loss.beta cannot change between 0 and non-zero (it decides whether a reference model is held)"
        )
    changed = [k for k in RESUME_FIXED if held(k) != _dotted(ours, k)]
    if changed:
        detail = ", ".join(f"{k}: {held(k)!r} -> {_dotted(ours, k)!r}" for k in changed)
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


def _number(value) -> float | None:
    """A score or an advantage as JSON writes it: None where it is not finite (no score)."""
    value = float(value)
    return value if math.isfinite(value) else None


def sample_rows(step: int, result, prompt_column: str) -> list[dict]:
    """The samples of step `step` (a `grpo.train.step.StepResult`): the completions of its
    first prompt, one row each, with their reward, each reward function's unweighted score
    (as the metrics name it: reward/<name>), their advantage, whether they were cut at
    max_new_tokens, the columns the reward functions gave with log_extra and a multi-turn
    rollout's messages (tool turns included). samples.jsonl and the dashboards' tables get
    these same rows."""
    batch = result.rollout
    rows = []
    for i in range(min(batch.group_size, len(batch))):  # the first prompt's group
        rows.append(
            {
                "step": step,
                "prompt": batch.rows[i][prompt_column],
                "completion": batch.completions[i],
                "reward": _number(result.scores[i]),
                **{f"reward/{name}": _number(scores[i]) for name, scores in result.per_function.items()},
                "advantage": None if result.advantages is None else _number(result.advantages[i]),
                "truncated": None if result.truncated is None else bool(result.truncated[i]),
                **{column: values[i] for column, values in result.columns.items()},
                # A multi-turn rollout's whole conversation: the model's turns and the tool messages.
                **({} if batch.messages is None else {"messages": batch.messages[i]}),
            }
        )
    return rows


def write_samples(path: Path, rows: list[dict]) -> None:
    """samples.jsonl: `rows` (`sample_rows`) appended, one JSON object a line."""
    with writing(path), open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))


def record_update(out: Path, before_step: int, iteration: int, update: dict, updater, save: bool) -> None:
    """reward_model_updates.jsonl: one iterative-RL update of the reward model (and, with
    `save`, the updated model in reward_model/)."""
    path = out / "reward_model_updates.jsonl"
    with writing(path), open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"before_step": before_step, "after_iteration": iteration, **update}) + "\n")
    if save:
        with writing(out / "reward_model"):
            updater.model.save(out / "reward_model")
