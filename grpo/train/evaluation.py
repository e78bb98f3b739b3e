"""Evaluation in the loop: held-out pass@k and maj@k while training, the best policy kept.

The `eval` section names held-out problems (as `grpo eval --data` takes them) and what checks
them (a task, or a reward function and a threshold; by default the run's first function
reward); `held_out` reads and checks both before any model loads. A run's `Evaluation`
measures the policy with `grpo.eval.runner.evaluate` at step 0, every eval.every steps and at
the last step: the numbers `grpo eval` gives on that step's weights with the same options,
since the evaluation draws from its own seed and the run's random state is put back after it
(a resumed run stays the run never interrupted). Under torchrun each process samples its
share of the problems and every process gets the numbers of all of them.

With train.keep_best, an evaluation that beats the best so far saves the policy as
output_dir/best/ (as final/ is written; a folder beside, then renamed); the best value and
step travel in the checkpoints and in best/ itself, so that a resumed run never replaces
best/ with a worse policy. After each evaluation the reward-hacking alarm
(`grpo.eval.alarm`) compares the training reward's trend with the held-out metric.
The user's guide: docs/evaluation.md.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.config import Config
from grpo.data import is_reasoning_gym, with_system_prompt
from grpo.errors import UserError
from grpo.eval.alarm import Alarm
from grpo.eval.command import REASONING_GYM_TASK, answer_extractor, data_task, load_data, parse_ks, try_on_rows
from grpo.eval.runner import Verifier, evaluate, reward_verifier, task_verifier
from grpo.infra.seed import rng_state, set_rng_state
from grpo.infra.space import writing
from grpo.tasks import load_task

__all__ = ["BEST", "Evaluation", "HeldOut", "NoEvaluation", "held_out", "metrics_of"]

BEST = "best"  # output_dir/best/: the best evaluated policy (train.keep_best)
RECORD = "best.json"  # in best/: the metric, its value and the step of the policy saved there


@dataclass
class HeldOut:
    """What the evaluations measure, read and checked before any model loads: the rows, the
    verifier, the k of pass@k and maj@k, and `evaluate`'s sampling options."""

    rows: list[dict]
    verifier: Verifier
    ks: list[int]
    prompt_column: str
    options: dict  # n, temperature, top_p, max_new_tokens, batch_size, seed, draw


def _renamed(err: UserError, names: dict[str, str]) -> UserError:
    """`err` with the option it starts with (grpo eval's, or data's) named as the eval key."""
    text = str(err)
    for old, new in names.items():
        if text.startswith(old):
            return UserError(new + text[len(old) :])
    return err


def _rows(c: Config, prompt_column: str) -> list[dict]:
    """The held-out rows: 'TASK:N' generated as `grpo eval --data` generates them (the same
    rows), anything else read as data.path is, from eval.split and eval.config; each given
    data.system_prompt, as the training prompts are; the first eval.prompts of them."""
    ev = c.eval
    try:
        rows = load_data(ev.data, prompt_column, load_task, split=ev.split, config=ev.config)  # as grpo eval's
    except UserError as err:
        names = {"--data:": "eval.data:", "--split:": "eval.split:", "--data-config:": "eval.config:"}
        raise _renamed(err, {**names, "--prompt-column:": "eval.prompt_column:"})
    rows = with_system_prompt(rows, prompt_column, c.data.system_prompt)
    return rows[: ev.prompts] if ev.prompts else rows


def _verifier(c: Config, prompt_column: str) -> tuple[Verifier, str]:
    """The verifier eval.task or eval.verifier names; else the task of a 'TASK:N' (or a
    reasoning-gym) eval.data; else the run's first function reward. With its label."""
    ev = c.eval
    try:
        extract = answer_extractor(None, ev.answer_pattern)
    except UserError as err:
        raise _renamed(err, {"--answer-pattern:": "eval.answer_pattern:"}) from None
    if ev.verifier is not None:
        threshold = 0.5 if ev.threshold is None else ev.threshold
        verifier = reward_verifier(ev.verifier, threshold, prompt_column=prompt_column, extract=extract)
        return verifier, f"eval.verifier {ev.verifier!r}"
    named = data_task(ev.data)
    spec = ev.task or (named[0] if named else REASONING_GYM_TASK if is_reasoning_gym(ev.data) else None)
    if spec is not None:
        try:
            task = load_task(spec)
        except UserError as err:
            raise UserError(f"eval.task: {err}") from err
        verifier = task_verifier(task, prompt_column=prompt_column, threshold=ev.threshold, extract=extract)
        return verifier, f"task {task.name!r}"
    functions = [r.function for r in c.rewards if r.function is not None]
    if not functions:
        raise UserError(
            "eval: nothing checks the held-out answers: give eval.task or eval.verifier (the run has no function reward to use)"
        )
    threshold = 0.5 if ev.threshold is None else ev.threshold
    name = functions[0] if isinstance(functions[0], str) else None
    verifier = reward_verifier(functions[0], threshold, prompt_column=prompt_column, extract=extract, name=name)
    return verifier, f"reward {name or 'rewards[0]'!r} as the held-out verifier"


def held_out(c: Config) -> HeldOut | None:
    """The eval section's rows and verifier, read and tried on every row (a row the verifier
    cannot read fails now, in one line); None without eval.data."""
    ev = c.eval
    if not ev.data:
        return None
    prompt_column = ev.prompt_column or c.data.prompt_column
    rows = _rows(c, prompt_column)
    verifier, label = _verifier(c, prompt_column)
    try_on_rows(verifier, rows, label, prompt_column, command="train", data_option="eval.data")
    ks = sorted(set(ev.k)) if ev.k else parse_ks(None, ev.n)
    keep = c.train.keep_best
    if keep is not None and int(keep.rpartition("@")[2]) not in ks:
        raise UserError(f"train.keep_best: {keep} is not measured: eval.k is {', '.join(map(str, ks))}")
    options = dict(
        n=ev.n,
        temperature=ev.temperature,
        top_p=ev.top_p,
        max_new_tokens=ev.max_new_tokens or c.rollout.max_new_tokens,
        batch_size=ev.batch_size,
        seed=ev.seed,
        draw=c.rollout.draw,
    )
    return HeldOut(rows, verifier, ks, prompt_column, options)


def metrics_of(report: dict) -> dict[str, float | None]:
    """An evaluation's metrics (a report of `evaluate`) as a step's line holds them:
    eval/pass@K and eval/maj@K with their 95% interval (eval/pass@K_lo, _hi), the shares of
    samples cut at max_new_tokens and without an answer, and the time it took."""
    out: dict[str, float | None] = {}
    for name in ("pass@k", "maj@k"):
        short = name.removesuffix("k")  # pass@, maj@
        for k, value in report[name].items():
            lo, hi = report[f"{name}_ci"][k]
            # Plain floats (maj@k's are numpy's): a checkpoint holds the step's line.
            out[f"eval/{short}{k}"], out[f"eval/{short}{k}_lo"], out[f"eval/{short}{k}_hi"] = map(
                float, (value, lo, hi)
            )
    out["eval/truncated"] = report["truncated"]
    out["eval/no_answer"] = report["no_answer"]
    out["time/eval"] = report["time_s"]
    return out


class NoEvaluation:
    """No eval section: nothing measured, nothing kept (the null object of `Evaluation`)."""

    latest: dict = {}

    def due(self, step: int) -> bool:
        return False

    def record(self, metrics: dict) -> None:
        pass

    def resume(self) -> None:
        pass

    def check_stop(self, step: int) -> str | None:
        return None

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state) -> None:
        pass


class Evaluation:
    """The run's evaluations of its policy on the held-out problems (module doc). `engine`
    is the run's (its policy, tokenizer and processes); `tools`: the run's toolbox (multi-turn
    samples, as training's); `save_best(directory, step, metrics)` writes the policy as final/
    is written, with the card of that step's evaluation."""

    def __init__(self, c: Config, held: HeldOut, engine, *, save_best, tools=None):
        self.held, self.engine, self.world, self.tools = held, engine, engine.world, tools
        self.every, self.last = c.eval.every, c.train.steps
        self.out = Path(c.output_dir)
        self.keep = c.train.keep_best  # the metric best/ is kept by, or None
        self.save_best = save_best
        self.best: dict | None = None  # {"metric", "value", "step"} of the best evaluation so far
        self.alarm = Alarm(c.eval.alarm_window, self.keep or "eval/pass@1")
        self.stop_when_diverging = c.eval.stop_when_diverging
        self.rose = False  # whether the alarm rose at the last evaluation
        self.latest: dict = {}  # the last evaluation's metrics (the progress line shows them)

    def due(self, step: int) -> bool:
        """Whether step `step` (0: before any) is evaluated: 0, every eval.every, the last."""
        return step == 0 or step == self.last or bool(self.every and step % self.every == 0)

    def record(self, metrics: dict) -> None:
        """A training step's metrics: its reward goes to the alarm's trend."""
        self.alarm.record(metrics.get("reward/mean"))

    def __call__(self, step: int) -> dict:
        """Evaluate the policy after `step` steps; the metrics for that step's line (with the
        alarm's), best/ saved when it beats the best so far."""
        report = self.measure()
        metrics = metrics_of(report)
        self.keep_best(step, metrics)
        watched = self.alarm.metric
        if watched in metrics:
            interval = (metrics[f"{watched}_lo"], metrics[f"{watched}_hi"])
            warning = self.alarm.update(step, self.alarm.recent(), metrics[watched], interval)
            self.rose = warning is not None
            if warning and self.world.is_main:
                print(warning, file=sys.stderr)
        metrics.update(self.alarm.metrics())
        self.latest = metrics
        return metrics

    def measure(self) -> dict:
        """`evaluate` on the policy as it is: eval mode, no gradient, the sharded policy
        gathered whole, and every random state as it was before (training's stream goes on
        as if no evaluation had run)."""
        e, held = self.engine, self.held
        policy, state, training = e.policy, rng_state(), e.policy.training
        policy.eval()
        try:
            with torch.no_grad(), self.world.gathered(policy):
                return evaluate(
                    policy,
                    e.tokenizer,
                    held.rows,
                    ks=held.ks,
                    verifier=held.verifier,
                    prompt_column=held.prompt_column,
                    progress=False,
                    tools=self.tools,
                    world=self.world,
                    **held.options,
                )
        finally:
            policy.train(training)
            set_rng_state(state)

    # ---- train.keep_best ---------------------------------------------------------------

    def keep_best(self, step: int, metrics: dict) -> None:
        """Save the policy as best/ when its value of train.keep_best beats the best so far
        (every process decides alike: their numbers are the same)."""
        if self.keep is None:
            return
        value = metrics[self.keep]
        if self.best is not None and not value > self.best["value"]:
            return
        record = {"metric": self.keep, "value": value, "step": step}
        final, tmp, old = self.out / BEST, self.out / f"{BEST}.tmp", self.out / f"{BEST}.old"
        if self.world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        self.save_best(tmp, step, metrics)  # collective: every process gathers, process 0 writes
        if self.world.is_main:
            with writing(tmp / RECORD):
                (tmp / RECORD).write_text(json.dumps(record) + "\n")
            if final.exists():
                final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        self.world.barrier()
        self.best = record

    def resume(self) -> None:
        """On --resume: best/ as a kill left it (a swap cut short put back), and the best so
        far the better of the checkpoint's and best/'s own record (best/ may be newer than the
        checkpoint: a run killed after it saved best/ redoes those steps)."""
        if self.keep is None:
            return
        on_disk = self.world.from_main(lambda: _recorded(self.out))
        if on_disk is not None and on_disk.get("metric") == self.keep:
            if self.best is None or on_disk["value"] > self.best["value"]:
                self.best = on_disk
        elif self.best is not None and self.best.get("metric") != self.keep:
            self.best = None  # kept by another metric: this one starts afresh

    def check_stop(self, step: int) -> str | None:
        """eval.stop_when_diverging: why the run stops after `step` (the alarm rose at this
        step's evaluation), else None. A resumed run goes on until it rises again."""
        if not (self.stop_when_diverging and self.rose):
            return None
        self.rose = False
        kept = " (best/ holds the best evaluated policy)" if self.keep else ""
        return f"stopped after step {step}: the reward-hacking alarm rose (eval.stop_when_diverging){kept}"

    def state_dict(self) -> dict:
        return {"best": self.best, "alarm": self.alarm.state_dict()}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        self.best = state.get("best")
        if state.get("alarm") is not None:
            self.alarm.load_state_dict(state["alarm"])


def _recorded(out: Path) -> dict | None:
    """best/'s record (a swap that a kill cut short put back first), or None without one."""
    final, old = out / BEST, out / f"{BEST}.old"
    if old.exists() and not final.exists():
        old.rename(final)
    try:
        return json.loads((final / RECORD).read_text())
    except (OSError, ValueError):
        return None
