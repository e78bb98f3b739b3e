"""The outer loop: DeepSeekMath Algorithm 1, for GRPO and PPO alike.

for iteration in 1..I:              reference <- policy
    for step in 1..M:               sample a batch of prompts; sample G outputs each;
                                    score; advantages; mu epochs of updates
    (iterative RL, with a verifier: the reward model trains on the policy's new samples)

Everything is validated before any model is loaded and before output_dir is touched
(`check_inputs`): the config, the reward functions, tools and environment, the data, the
models' configs. Then a `Run` is built once from the config: the processes, the output
folder, the engine (`grpo.train.assembly`), the generator and the rollouts over the run's one
prompt stream (`grpo.train.rollouts`), the checkpointer and the sinks; its methods are the
loop. A run writes config.yaml, metrics.jsonl, samples.jsonl, checkpoints/ and final/ into
`output_dir`, and `resume=True` continues from the newest checkpoint so that the metrics are
those of a run never interrupted. Beside the loop: `grpo.train.checkpointing` (the
checkpoints, both formats, and when they are due), `grpo.train.output_dir` (which folder a
run may use, what a resume may change, the logs) and `grpo.train.signals` (Ctrl-C and
SIGTERM).
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from grpo.config import Config, as_tree, config_from_dict, config_to_dict, load_config, read_config_file, reporters
from grpo.data import GIVEN_DATASET, PromptStream, check_chat_template, given_rows, load_rows
from grpo.errors import Stopped, UserError
from grpo.infra.checkpoint import load_latest_checkpoint
from grpo.infra.contain import run_workers
from grpo.infra.distributed import SingleProcess, World, init_world, launched_world_size
from grpo.infra.logging import JsonlSink, Sinks, open_dashboards, read_metrics, write_atomic
from grpo.infra.progress import Progress
from grpo.infra.space import no_space
from grpo.infra.seed import seed_everything
from grpo.rewards import WeightedReward, load_rewards
from grpo.rewards.model import RewardModel, load_pairs
from grpo.infra.hf import model_config
from grpo.train.models import GivenPolicy, check_given, given_model_name, given_policy, policy_config, policy_tokenizer
from grpo.rollout import check_context
from grpo.rollout.worker import refuse_in_generator
from grpo.rollout.agents import agent_reward, load_agent
from grpo.rollout.tools import Toolbox
from grpo.infra.devices import resolve_device
from grpo.infra.memory import return_freed_memory
from grpo.train.checkpointing import Checkpointer, kept
from grpo.train.evaluation import BEST, Evaluation, HeldOut, NoEvaluation, held_out
from grpo.train.hub import check_hub, hub_for
from grpo.train.iterative import RewardModelUpdater
from grpo.train.output_dir import (
    OutputFolder,
    check_resume_config,
    record_update,
    rewind_logs,
    sample_rows,
    write_samples,
)
from grpo.train.preflight import preflight
from grpo.train.signals import Signals
from grpo.train.assembly import build_engine, build_run_generator, load_reward_models, models_held, parameters_held
from grpo.train.step import train_step
from grpo.train.rollouts import Rollouts
from grpo.train.rollouts import summary as async_summary


@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path
    metrics: list[dict]
    models_held: int
    summary: dict


def as_config(config: Config | dict | str | Path, overrides: list[str] = (), given: dict | None = None) -> Config:
    """`config` (a Config, a mapping or a YAML path) with `overrides`; `given`: the rewards
    (a `rewards` list), rollout's `tools` and `environment`, the `model` and data's `path`
    that grpo.train's arguments replace, put in before the config is validated (functions
    and classes as given; a model or dataset object as the name config.yaml records)."""
    if given:
        if isinstance(config, Config):
            tree = as_tree(config)  # functions and classes kept as they are
        else:
            tree = dict(config) if isinstance(config, dict) else read_config_file(config)
        if "rewards" in given:
            tree["rewards"] = given["rewards"]
        if "model" in given:
            tree["model"] = given["model"]
        if "data.path" in given:
            tree["data"] = {**(tree.get("data") or {}), "path": given["data.path"]}
        rollout = dict(tree.get("rollout") or {})
        rollout.update({key: given[key] for key in ("tools", "environment") if key in given})
        return config_from_dict({**tree, "rollout": rollout}, overrides)
    if isinstance(config, Config):
        return config_from_dict(config_to_dict(config), overrides) if overrides else config
    if isinstance(config, dict):
        return config_from_dict(config, overrides)
    return load_config(config, overrides)


def resolve_functions(c: Config) -> dict[int, WeightedReward]:
    """The function rewards, resolved (and so checked) before any model is loaded."""
    entries = [(i, r) for i, r in enumerate(c.rewards) if r.function is not None]
    options = [{"timeout": r.timeout, "on_timeout": r.on_timeout, "isolate": r.isolate} for _, r in entries]
    resolved = load_rewards([(r.function, r.weight) for _, r in entries], options=options)
    return {i: w for (i, _), w in zip(entries, resolved)}


def check_models(c: Config, policy: GivenPolicy | None = None) -> None:
    """Every model the run loads exists (its config read, no weights), and prompts of
    rollout.max_prompt_length fit the policy's positions (`policy`: the model handed to
    grpo.train, if any): found before output_dir is touched."""
    check_context(policy_config(c.model, policy), c.rollout.max_prompt_length, c.rollout.max_new_tokens)
    if c.loss.baseline == "critic" and c.value.model:
        model_config(c.value.model, "value.model")
    for r in c.rewards:
        if r.model is not None:
            model_config(r.model, "reward model")


def run_summary(c: Config, metrics: list[dict], models: int, parameters: int) -> dict:
    """What a run cost and what it reached, for comparing runs (`summary.json`)."""
    times = sorted(m["time/step"] for m in metrics)
    last = [m["reward/mean"] for m in metrics[-5:] if m["reward/mean"] is not None]
    return {
        "algorithm": c.algorithm,
        "models": models,
        "parameters": parameters,
        "steps": len(metrics),
        "prompts": len(metrics) * c.rollout.prompts_per_step,
        "generated_tokens": sum(m["tokens/completion"] for m in metrics),
        "time_s": sum(times),
        "time_per_step_s": times[len(times) // 2] if times else None,
        "peak_memory_mb": max((m["memory/peak_mb"] for m in metrics), default=None),
        "reward/final": sum(last) / len(last) if last else None,
        **async_summary(metrics),  # rollout.async: staleness and drops
    }


def environment_rows(c: Config) -> list[dict]:
    """No data (data.path empty, one rollout.environment): as TRL drives such a run, a step's
    worth of rows whose prompt is an empty user message, to which each rollout's reset appends
    its task (validate allows it only with one environment)."""
    return [{c.data.prompt_column: [{"role": "user", "content": ""}]} for _ in range(c.rollout.prompts_per_step)]


def build_updater(
    c: Config,
    verifier: WeightedReward,
    models: dict[int, RewardModel],
    rows: list[dict],
    world: World = SingleProcess(),
) -> RewardModelUpdater:
    """Iterative RL: what keeps training the reward model between iterations (in every
    process, on its replica: grpo.train.iterative)."""
    u = c.reward_model_update
    index = u.reward if u.reward >= 0 else min(models)
    return RewardModelUpdater(
        model=models[index],
        verifier=verifier,
        prompts=PromptStream(rows, seed=c.seed + 1, shuffle=True),
        prompt_column=c.data.prompt_column,
        prompts_per_update=u.prompts,
        samples_per_prompt=u.samples_per_prompt,
        max_pairs_per_prompt=u.max_pairs_per_prompt,
        replay=u.replay,
        fit_kwargs=dict(lr=u.lr, epochs=u.epochs, batch_size=u.batch_size),
        history=load_pairs(u.data) if u.data else [],
        rng=random.Random(c.seed),
        world=world,
    )


class NoUpdater:
    """No iterative reward-model training: the reward stays as it is."""

    def update(self, policy, version, generator) -> None:
        return None

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state) -> None:
        pass


def _progress_fields(metrics: dict) -> dict:
    """What a step's progress shows (the bar's fields, a plain line's): reward, KL, length,
    and the held-out pass@1 where the metrics hold one (the latest evaluation's)."""
    fields = {
        "reward": metrics["reward/mean"],
        "kl": metrics.get("kl"),
        "length": f"{metrics['completion_length/mean']:.1f}",
    }
    if metrics.get("eval/pass@1") is not None:
        fields["pass@1"] = f"{metrics['eval/pass@1']:.3f}"
    return fields


@run_workers()  # its reward and tool workers stop with it
def train(
    config: Config | dict | str | Path,
    *,
    overrides: list[str] = (),
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    rewards: list | None = None,
    tools: list | None = None,
    environment_factory: type | str | None = None,
    dataset=None,
    model=None,
    tokenizer=None,
    train_dataset=None,
    processing_class=None,
) -> TrainResult:
    """Train a policy with GRPO or PPO as `config` says (a Config, a mapping, or a YAML path).

    `rewards`, when given, replaces the config's rewards (as TRL's `reward_funcs` does):
    each a function, a spec string, or a dict as a `rewards` entry of a config. `tools` and
    `environment_factory` (TRL's arguments of those names), when given, replace
    rollout.tools and rollout.environment: functions (or specs) and a class (docs/tools.md).
    `dataset` (TRL's `train_dataset`), when given, replaces data.path: a datasets.Dataset, a
    DatasetDict (its data.split) or a list of dicts. `model`, when given, replaces the
    config's model: a folder or hub id, or a transformers PreTrainedModel already loaded
    (trained in place), with its `tokenizer` (TRL's `processing_class`); docs/training.md#data.

    Under torchrun (`torchrun --nproc_per_node N -m grpo train CONFIG`) every process runs
    this; they split each step's prompts and share one result (grpo.infra.distributed)."""
    refuse_in_generator()  # a script's unguarded call, run again where the generator imports it
    given: dict = {}  # what the arguments replace, before the config is validated
    if rewards is not None:
        given["rewards"] = [{"function": r} if isinstance(r, str) else r for r in rewards]  # a spec string: weight 1
    if tools is not None:
        given["tools"] = list(tools)
    if environment_factory is not None:
        given["environment"] = environment_factory
    dataset = _one_of(dataset=dataset, train_dataset=train_dataset)
    tokenizer = _one_of(tokenizer=tokenizer, processing_class=processing_class)
    if dataset is not None:
        given["data.path"] = GIVEN_DATASET  # what config.yaml records
    if isinstance(model, (str, Path)):
        given["model"], model = str(model), None
    policy = given_policy(model, tokenizer)  # the objects checked, a missing tokenizer loaded
    if model is not None:
        given["model"] = given_model_name(model)
    c = as_config(config, overrides, given)
    check_given(c, policy)
    rows = None
    if dataset is not None:
        d = c.data
        rows = given_rows(dataset, prompt_column=d.prompt_column, split=d.split, system_prompt=d.system_prompt)
    device = resolve_device(c.train.device)
    backend = preflight(c, launched_world_size(), device)  # refusals that need an engine's facts
    world = init_world(device, backend)
    try:
        return _train(c, world, device, resume=resume, progress=progress, overwrite=overwrite, rows=rows, policy=policy)
    finally:
        world.close()  # after the run's generator shut its engine down (`Run.train`), as vLLM's shutdown needs


def _one_of(**arguments):
    """The one of two names of an argument (ours, TRL's) that was given, or None."""
    given = {name: value for name, value in arguments.items() if value is not None}
    if len(given) > 1:
        raise UserError(f"{' and '.join(given)}: two names of one argument; give one")
    return next(iter(given.values()), None)


@dataclass
class Inputs:
    """Everything a run reads before any model is loaded, checked (`check_inputs`)."""

    functions: dict[int, WeightedReward]  # the function rewards, resolved, by their index in c.rewards
    verifier: WeightedReward | None  # iterative RL's (reward_model_update.verifier)
    rows: list[dict]  # the prompts
    state: dict | None  # the checkpoint a resume continues from
    toolbox: Toolbox | None  # the tools and environment of multi-turn rollouts
    policy: GivenPolicy | None = None  # the model and tokenizer handed to grpo.train, if any
    held_out: HeldOut | None = None  # the eval section's rows and verifier (None: no evaluation)


def check_inputs(
    c: Config,
    world: World,
    folder: OutputFolder,
    *,
    resume: bool,
    overwrite: bool,
    rows: list[dict] | None = None,
    policy: GivenPolicy | None = None,
) -> Inputs:
    """Everything that can be wrong with the input, found before any model is loaded (in
    every process: one that fails stops them all). The config's mistakes come first, then
    the folder's: nothing in output_dir is touched before the config is known good. `rows`
    and `policy`: what grpo.train was handed instead of data.path and model (checked)."""
    functions = resolve_functions(c)
    toolbox = Toolbox.from_config(c.rollout)  # the tools' schemas built, the environment probed
    if c.rollout.agent is not None:
        load_agent(c.rollout.agent)  # importable and callable, before any model loads
    if not c.rewards and not (toolbox is not None and toolbox.owns_reward) and c.rollout.agent is None:
        raise UserError("rewards: at least one reward is required (or a rollout.environment with a get_reward method)")
    u = c.reward_model_update
    verifier = load_rewards([(u.verifier, 1.0)])[0] if u.verifier else None
    d = c.data
    if rows is None and d.path:
        rows = load_rows(
            d.path,
            prompt_column=d.prompt_column,
            split=d.split,
            task_options=d.task_options,
            config=d.config,
            system_prompt=d.system_prompt,
        )
    given = rows is not None
    if not given:
        rows = environment_rows(c)
    if toolbox is not None:
        toolbox.check_prompts(rows, c.data.prompt_column)
    held = held_out(c)  # the eval section's rows and verifier, tried on every row
    if given:  # chat prompts (the data's, or made by data.system_prompt) need a chat template
        check_chat_template(rows, d.prompt_column, lambda: policy_tokenizer(c.model, policy), d.system_prompt)
    check_models(c, policy)
    resumable = folder.claim(resume=resume, overwrite=overwrite)
    state = load_latest_checkpoint(folder.out, world_size=world.world_size, rank=world.rank) if resumable else None
    if state is not None:
        check_resume_config(c, state)
    return Inputs(functions, verifier, rows, state, toolbox, policy, held)


def dashboards(c: Config, world: World, state: dict | None) -> Sinks:
    """train.report_to's services, started by process 0 before any model is loaded: a
    missing package or a refusal stops every process, in one line, before any step."""
    if not world.is_main:
        return Sinks([])
    out = Path(c.output_dir)
    return open_dashboards(
        reporters(c.train),
        out,
        config=config_to_dict(c),
        run_name=c.train.run_name or out.resolve().name,
        project=c.train.project,
        first_step=int(state["step"]) + 1 if state else 1,
        resume=state is not None,
    )


def _train(
    c: Config,
    world: World,
    device: torch.device,
    *,
    resume: bool,
    progress: bool,
    overwrite: bool = False,
    rows: list[dict] | None = None,
    policy: GivenPolicy | None = None,
) -> TrainResult:
    out = Path(c.output_dir)
    folder = OutputFolder(out, main=world.is_main)
    opened = Sinks([])
    try:
        world.checked(lambda: check_hub(c) if world.is_main else None)  # process 0 pushes: its token
        inputs = world.checked(
            lambda: check_inputs(c, world, folder, resume=resume, overwrite=overwrite, rows=rows, policy=policy)
        )
        opened = world.checked(lambda: dashboards(c, world, inputs.state))
        return Run(c, world, device, folder, inputs, opened, progress=progress).train()
    except (UserError, Stopped, KeyboardInterrupt):
        raise
    except Exception as err:
        full = no_space(err)  # a write before or after the loop (config.yaml, final/, summary.json)
        if full is None:
            raise
        raise UserError(f"{full} [{kept(out, 'free space')}]") from err
    finally:
        opened.close()  # when the run stopped before its loop (which closes them)
        folder.release()  # a run that never started leaves the folder as it found it


class Run:
    """One run, built once from its validated config and checked inputs: the processes
    (`world`), the output folder, the engine, the generator and the rollouts over the run's
    prompt stream, the checkpointer and the sinks. `train` starts the generator, takes the
    folder (a resume's state restored), runs the steps and writes the final model."""

    def __init__(
        self,
        c: Config,
        world: World,
        device: torch.device,
        folder: OutputFolder,
        inputs: Inputs,
        dashboards: Sinks,
        *,
        progress: bool = True,
    ):
        self.c, self.world, self.folder, self.state, self.progress = c, world, folder, inputs.state, progress
        self.out = Path(c.output_dir)
        if c.train.return_freed_memory:
            return_freed_memory()  # before the first model's tensors, for the rest of this process
        seed_everything(c.seed)  # the same in every process: the models start the same
        rewards, self.reward_models = load_reward_models(c, inputs.functions, device)
        if inputs.toolbox is not None:
            rewards += inputs.toolbox.rewards()  # the environment's get_reward, weight 1 (as TRL adds it)
        if c.rollout.agent is not None:
            rewards.append(agent_reward())  # what each episode's agent returned, weight 1
        self.engine = e = build_engine(c, rewards, device, world, given=inputs.policy)
        if inputs.verifier:
            self.updater = build_updater(c, inputs.verifier, self.reward_models, inputs.rows, world)
        else:
            self.updater = NoUpdater()
        self.generator = build_run_generator(c, e, inputs.toolbox)  # closed by `train`, or here on a failure
        try:
            # Each step's batch, over the run's one prompt stream: sampled here when the step
            # takes it, or by a generator process ahead of the step (rollout.async).
            self.rollouts = Rollouts(c, e, self.generator, inputs.rows)
        except BaseException:
            self.generator.close()
            raise
        # The held-out evaluations (at step 0, every eval.every steps, the last), best/ kept.
        self.evaluation = NoEvaluation()
        if inputs.held_out is not None:
            self.evaluation = Evaluation(c, inputs.held_out, e, save_best=self.save_best, tools=inputs.toolbox)
        # The stream's position, and the evaluation's best so far, with the weights.
        self.checkpoints = Checkpointer(e, c, self.rollouts, self.updater, self.evaluation, rows=len(inputs.rows))
        self.hub = hub_for(c, world, self.checkpoints.save_copy, self.checkpoints.write_card)  # train.push_to_hub
        self.dashboards, self.sinks = dashboards, Sinks([])  # metrics.jsonl opens once the folder is the run's
        self.held = models_held(e, c)
        self.steps_per_iteration = math.ceil(c.train.steps / c.train.iterations)
        self.unscored = 0  # steps in a row where no reward scored any completion
        self.completed, self.last_metrics = 0, None  # steps done (saved or to be saved), and the last one's metrics
        self.snapshot: dict | None = None  # the state as the running step began (`Checkpointer.snapshot`)

    def train(self) -> TrainResult:
        try:
            self.generator.start(
                self.engine.policy
            )  # vLLM's engine built, a server admitted: before output_dir changes
            start = self.begin()
            self.steps(start)
            return self.finish()
        finally:
            self.generator.close()

    def begin(self) -> int:
        """The folder becomes the run's (config.yaml written), a resume's state is restored and
        its logs rewound, metrics.jsonl opened, the generator given its first requests; the
        first step to run."""
        c, world = self.c, self.world
        if world.world_size > 1:
            seed_everything(c.seed + 1_000_003 * world.rank)  # each process samples its own stream
        if world.is_main:
            self.folder.start()  # the models are built: --overwrite's earlier run goes
            write_atomic(self.out / "config.yaml", yaml.safe_dump(config_to_dict(c), sort_keys=False))
        start = 0
        if self.state is not None:
            start = self.checkpoints.restore(self.state)
            if world.is_main:  # what the stopped run logged after its checkpoint is redone
                rewind_logs(self.out, start, self.state.get("metrics"))
        self.completed = start
        self.sinks = Sinks([JsonlSink(self.out / "metrics.jsonl"), self.dashboards] if world.is_main else [])
        self.evaluation.resume()  # best/ as the stopped run left it, if it is better than the checkpoint's
        if start == 0 and self.evaluation.due(0):  # the starting policy's: a line of its own, step 0
            self.sinks.log(0, {"step": 0, **self.evaluation(0)})
        self.rollouts.start(self.engine, start)  # from the weights and the stream's position just restored
        return start

    def steps(self, start: int) -> None:
        """Steps `start` to train.steps. On a terminal a progress bar; redirected to a file or a
        cluster's log, one plain line every train.log_every steps (a bar there is one
        ever-growing line)."""
        c = self.c
        enabled = self.progress and self.world.is_main
        bar = Progress(c.train.steps, initial=start, desc=c.algorithm, every=c.train.log_every, enabled=enabled)
        with Signals() as signals:
            try:
                for step in range(start, c.train.steps):
                    metrics = self.step(step)
                    bar.update(1, **_progress_fields({**self.evaluation.latest, **metrics}))
                    self.after(metrics, signals)
            except (Stopped, KeyboardInterrupt):
                raise
            except Exception as err:
                self.failed(err)
                raise
            finally:
                self.rollouts.close()  # a generator's queue is discarded; a resume samples it again
                bar.close()
                self.sinks.close()

    def step(self, step: int) -> dict:
        """Step `step` (0-based): between iterations, the reward model's update and the
        reference's reset; the batch taken, scored and learnt from; its metrics logged."""
        e, iteration = self.engine, step // self.steps_per_iteration
        # What a checkpoint of the steps completed so far needs, should this step fail before
        # it changes any weight.
        self.snapshot = self.checkpoints.snapshot()
        if step > 0 and step % self.steps_per_iteration == 0:
            self.next_iteration(step, iteration)
        began = time.perf_counter()
        sampled, taken = self.rollouts.take(e, step)  # this process's share of the step's prompts
        result = train_step(e, sampled, step, taken["time/generate"])
        result.metrics.update(taken)
        result.metrics.update(self.rollouts.after_update(e))  # the new weights to the generator, when due
        if self.rollouts.asynchronous:
            result.metrics["time/step"] = time.perf_counter() - began
        number = self.completed = step + 1
        self.snapshot = None
        metrics = {"step": number, "iteration": iteration + 1, **result.metrics, "models": self.held}
        self.last_metrics = metrics
        self.evaluation.record(metrics)  # the training reward, for the reward-hacking alarm
        if self.evaluation.due(number):  # the policy after this step, on the held-out problems
            metrics = self.last_metrics = {**metrics, **self.evaluation(number)}
        self.sinks.log(number, metrics)
        if self.world.is_main and self.c.train.sample_every and number % self.c.train.sample_every == 0:
            rows = sample_rows(number, result, self.c.data.prompt_column)
            write_samples(self.out / "samples.jsonl", rows)
            self.sinks.log_table(number, "samples", rows)  # the same rows, as a table on each dashboard
        return metrics

    def next_iteration(self, step: int, iteration: int) -> None:
        """Algorithm 1, between iterations: the reward model learns from the policy's new
        samples (iterative RL), then the reference becomes the policy."""
        e = self.engine
        update = self.updater.update(e.policy, e.version, self.rollouts.generator)
        if update is not None:
            self.snapshot["updates"] = None  # the reward model moved: this step cannot be undone
            if self.world.is_main:  # every process's replica is the same
                record_update(self.out, step + 1, iteration, update, self.updater, self.c.reward_model_update.save)
        e.reference.reset_to(e.policy)

    def after(self, metrics: dict, signals: Signals) -> None:
        """After a step: the warning for a step no reward scored, and the checkpoint when due,
        on a stop (Ctrl-C, SIGTERM), when the reward-hacking alarm rises with
        eval.stop_when_diverging, or when train.max_unscored_steps gives up. Saving and
        stopping are collective: every process does both at the same step."""
        c, number = self.c, metrics["step"]
        self.unscored = self.unscored + 1 if metrics["frac_unscored"] == 1.0 else 0
        give_up = bool(c.train.max_unscored_steps) and self.unscored >= c.train.max_unscored_steps
        if self.unscored and self.world.is_main:
            print(
                f"grpo: warning: step {number}: no reward scored any completion (every reward returned None)",
                file=sys.stderr,
            )
        due = self.checkpoints.due(number)
        stop, due = self.world.max(torch.tensor([signals.received or 0, int(due)])).tolist()
        diverging = self.evaluation.check_stop(number)  # alike in every process: their numbers are the same
        if due or stop or give_up or diverging:
            self.checkpoints.save(number, (number - 1) // self.steps_per_iteration, metrics=metrics)
        if due and number < c.train.steps and not (stop or give_up or diverging):
            self.hub.after_checkpoint(number)  # hub_strategy every_save (the last step's is final/)
        if diverging:
            raise Stopped(f"{diverging}; checkpoint saved: continue with `grpo train CONFIG --resume`", 1)
        if stop:
            raise Stopped(
                f"stopped by {Signals.name(stop)} after step {number}; "
                f"checkpoint saved: continue with `grpo train CONFIG --resume`",
                128 + stop,
            )
        if give_up:
            raise UserError(
                f"no reward scored any completion in {self.unscored} steps in a row "
                f"(steps {number - self.unscored + 1}-{number}): "
                "check the reward functions and the data's columns (train.max_unscored_steps sets the limit)"
            )

    def failed(self, err: Exception) -> None:
        """After an error in a step: a checkpoint of the last completed step where it can be
        saved, and the error told with what to do (raises a UserError, or returns for the
        caller to raise `err`). One process alone cannot save a sharded checkpoint. Over
        several, a UserError (bad input, a failing reward) was agreed by all (world.checked):
        they save together; any other error may be one process's, and the periodic
        checkpoints and signal stops (both collective) are what survives it."""
        agreed = self.world.world_size == 1 or isinstance(err, UserError)
        full = no_space(err)  # a write failed for lack of space (a log's, a checkpoint's)
        fix = "free space" if full is not None else "fix the cause"
        iteration = max(self.completed - 1, 0) // self.steps_per_iteration  # that of the last completed step
        saved = None
        if agreed:
            saved = self.checkpoints.save_after_failure(
                self.completed, iteration, self.snapshot, self.last_metrics, fix=fix
            )
        if full is not None:
            raise UserError(f"{full} [{saved or kept(self.out, fix)}]") from err
        if isinstance(err, UserError) and saved is not None:
            raise UserError(f"{err} [{saved}]") from err
        if saved is not None and self.world.is_main:
            print(f"grpo: {saved}", file=sys.stderr)

    def save_best(self, directory: Path, step: int, metrics: dict) -> None:
        """train.keep_best's best/: the policy after `step` steps as final/ is written, with
        its card (`metrics`: its evaluation)."""
        self.checkpoints.save_copy(directory)
        self.checkpoints.write_card(directory, step, {"step": step, **metrics})

    def finish(self) -> TrainResult:
        """The final model with its card, summary.json (what the run cost and what it
        reached), then train.push_to_hub's push."""
        out = self.out
        self.checkpoints.save_final(out / "final")
        self.world.barrier()
        metrics = [m for m in read_metrics(out / "metrics.jsonl") if m["step"] > 0]  # not step 0's evaluation
        summary = run_summary(self.c, metrics, self.held, parameters_held(self.engine, self.reward_models))
        if self.world.is_main:
            write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
        best = out / BEST if self.c.train.keep_best else None
        self.hub.at_end(out / "final", self.c.train.steps, best)  # after every file of the run is written
        return TrainResult(out, out / "final", metrics, self.held, summary)
