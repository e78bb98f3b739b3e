"""The outer loop: DeepSeekMath Algorithm 1, for GRPO and PPO alike.

for iteration in 1..I:              reference <- policy
    for step in 1..M:               sample a batch of prompts; sample G outputs each;
                                    score; advantages; mu epochs of updates
    (iterative RL, with a verifier: the reward model trains on the policy's new samples)

Everything is validated before any model is loaded and before output_dir is touched: the
config, the reward functions, tools and environment, the data, the models' configs. A run
writes config.yaml, metrics.jsonl, samples.jsonl, checkpoints/ and final/ into `output_dir`,
and `resume=True` continues from the newest checkpoint so that the metrics are those of a
run never interrupted. Beside the loop: `grpo.train.checkpointing` (the checkpoints, both
formats, and when they are due), `grpo.train.output_dir` (which folder a run may use, what a
resume may change, the logs) and `grpo.train.signals` (Ctrl-C and SIGTERM).
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
from grpo.data import PromptStream, load_rows
from grpo.errors import Stopped, UserError
from grpo.infra.checkpoint import load_latest_checkpoint
from grpo.infra.contain import run_workers
from grpo.infra.distributed import SingleProcess, World, check_launch, init_world, launched_world_size
from grpo.infra.logging import JsonlSink, Sinks, open_dashboards, read_metrics, write_atomic
from grpo.infra.progress import Progress
from grpo.infra.space import no_space
from grpo.infra.seed import seed_everything
from grpo.rewards import WeightedReward, load_rewards
from grpo.rewards.adapters import ModelReward, ProcessModelReward
from grpo.rewards.model import RewardModel, load_pairs
from grpo.infra.hf import load_tokenizer, model_config
from grpo.rollout import check_context
from grpo.rollout.generator import Generator, GeneratorSpec
from grpo.rollout.worker import build_generator, refuse_in_generator
from grpo.rollout.tools import Toolbox
from grpo.infra.devices import attention_for, autocast_dtype, resolve_device
from grpo.infra.hf import load_causal_lm
from grpo.train.models import (
    apply_lora,
    count_parameters,
    enable_checkpointing,
    tie_gradients_in_place,
    trainable_parameters,
)
from grpo.train.layouts import chunkable_head, decide_layouts, layout_of
from grpo.train.networks import build_reference
from grpo.infra.memory import return_freed_memory
from grpo.train.optimizers import build_optimizer
from grpo.train.optimizers import missing as optimizer_missing
from grpo.train.checkpointing import Checkpointer, kept
from grpo.train.iterative import RewardModelUpdater
from grpo.train.output_dir import OutputFolder, check_resume_config, record_update, rewind_logs, write_samples
from grpo.train.scoring import build_scorer
from grpo.train.seams import build_baseline, build_critic, build_kl
from grpo.train.signals import Signals
from grpo.train.step import Decisions, Engine, train_step
from grpo.train.rollouts import Rollouts
from grpo.train.rollouts import summary as async_summary
from grpo.vllm import missing
from grpo.vllm.decoder import close_shared_engine


@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path
    metrics: list[dict]
    models_held: int
    summary: dict


def as_config(config: Config | dict | str | Path, overrides: list[str] = (), given: dict | None = None) -> Config:
    """`config` (a Config, a mapping or a YAML path) with `overrides`; `given`: the rewards
    (a `rewards` list) and rollout's `tools` and `environment` that grpo.train's arguments
    replace, put in before the config is validated (functions and classes as given)."""
    if given:
        if isinstance(config, Config):
            tree = as_tree(config)  # functions and classes kept as they are
        else:
            tree = dict(config) if isinstance(config, dict) else read_config_file(config)
        if "rewards" in given:
            tree["rewards"] = given["rewards"]
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


def check_models(c: Config) -> None:
    """Every model the run loads exists (its config read, no weights), and prompts of
    rollout.max_prompt_length fit the policy's positions: found before output_dir is touched."""
    check_context(model_config(c.model), c.rollout.max_prompt_length, c.rollout.max_new_tokens)
    if c.loss.baseline == "critic" and c.value.model:
        model_config(c.value.model, "value.model")
    for r in c.rewards:
        if r.model is not None:
            model_config(r.model, "reward model")


def load_reward_models(
    c: Config, functions: dict[int, WeightedReward], device: torch.device
) -> tuple[list[WeightedReward], dict[int, RewardModel]]:
    """All rewards in config order: the resolved functions and the loaded reward models (on `device`)."""
    rewards, models = [], {}
    for i, r in enumerate(c.rewards):
        if r.function is not None:
            rewards.append(functions[i])
            continue
        models[i] = RewardModel.from_pretrained(r.model, device=device)
        if r.process:
            fn = ProcessModelReward(models[i], separator=r.step_separator, normalize=r.normalize)
        else:
            fn = ModelReward(models[i], normalize=r.normalize)
        name = f"model:{r.model}"
        if any(w.name == name for w in rewards):
            name += f"#{i}"
        rewards.append(WeightedReward(name=name, fn=fn, weight=r.weight))
    return rewards, models


def build_engine(
    c: Config,
    rewards: list[WeightedReward],
    device: torch.device | None = None,
    world: World = SingleProcess(),
) -> Engine:
    """Load the models onto `device` (train.device's) and choose, once, the pieces in which
    GRPO and PPO differ. Over several processes, the policy and the critic are sharded
    (FSDP2) and the reference is a full replica (grpo.infra.distributed says why). What
    samples the policy is the run's Generator (`build_run_generator`), built beside it."""
    device = resolve_device(c.train.device) if device is None else device
    tokenizer = load_tokenizer(c.model)
    attention = attention_for(c.train.attention, c.rollout.max_new_tokens, device)
    compute_dtype = autocast_dtype(c.train.autocast, device)
    policy = load_causal_lm(c.model, c.train.dtype, attention=attention, device=device)
    check_context(policy, c.rollout.max_prompt_length, c.rollout.max_new_tokens)  # before any step
    checkpointing = c.train.gradient_checkpointing and enable_checkpointing(policy)
    if c.lora.r:
        policy = apply_lora(policy, c.lora.r, c.lora.alpha, c.lora.target_modules)
    # Which forward layouts (checkpointed; packed, shared prompt) serve this architecture, tried once on a
    # small batch before sharding; the reference's copy inherits the verdicts. The chunked head's one
    # probe pass, whole (before sharding), likewise.
    checkpointing = decide_layouts(policy, checkpointing, c.train.layout, world=world)
    chunked = c.train.chunked_head and chunkable_head(policy) is not None
    decisions = Decisions(checkpointing=checkpointing, layout=layout_of(policy, checkpointing), chunked_head=chunked)
    reference = build_reference(
        policy,
        beta=c.loss.beta,
        lora=bool(c.lora.r),
        dtype=compute_dtype,
        full_state_dict=world.full_state_dict,
        chunked_head=chunked,
        stored=None if c.train.reference_dtype == "auto" else getattr(torch, c.train.reference_dtype),
    )  # copied before sharding
    tie_gradients_in_place(policy)  # after the reference's copy: its weights take no gradient
    critic = build_critic(c, attention, compute_dtype, device, world)
    policy = world.shard(policy)
    for network in critic.networks:
        world.shard(network)
    kl = build_kl(c)

    groups = [{"params": trainable_parameters(policy), "lr": c.train.lr}]
    groups += critic.param_groups(c.value.lr or c.train.lr)
    optimizer = build_optimizer(c.train, groups, updates=c.train.steps * c.train.epochs * c.train.minibatches)
    return Engine(
        policy=policy,
        tokenizer=tokenizer,
        rewards=rewards,
        score=build_scorer(c),
        reference=reference,
        baseline=build_baseline(c, tokenizer, kl, world),
        kl=kl,
        critic=critic,
        optimizer=optimizer,
        rollout=c.rollout,
        train=c.train,
        loss=c.loss,
        prompt_column=c.data.prompt_column,
        decisions=decisions,
        device=device,
        compute_dtype=compute_dtype,
        world=world,
    )


def models_held(e: Engine, c: Config) -> int:
    """The models a run holds, counted as the papers count them: policy, reference (unless
    beta = 0), value model (PPO) and reward. The reward counts once when it is given by rule
    functions, and once per reward model: GRPO holds 3, PPO 4."""
    reward_models = sum(1 for r in c.rewards if r.model is not None)
    rule_rewards = any(r.function is not None for r in c.rewards)
    return 1 + int(e.reference.held) + e.critic.held + max(reward_models, int(rule_rewards))


def parameters_held(e: Engine, reward_models: dict[int, RewardModel]) -> int:
    """Parameters of every network held: policy, a reference copy, critic, reward models."""
    networks = [e.policy, *e.reference.networks, *e.critic.networks, *(rm.model for rm in reward_models.values())]
    return sum(count_parameters(n) for n in networks)


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


def build_run_generator(c: Config, e: Engine, tools: Toolbox | None = None) -> Generator:
    """What samples the run's batches (and iterative RL's): in this process, or with
    rollout.async in a worker process of its own (one per torchrun process). `tools`: the
    run's tools and environment (multi-turn rollouts), None for single-turn ones."""
    worker = c.rollout.async_.max_staleness > 0
    spare = 0 if worker else sampling_room(e)
    spec = GeneratorSpec.of(c, autocast=e.compute_dtype, rank=e.world.rank, device=str(e.device), spare_bytes=spare)
    return build_generator(spec, e.tokenizer, tools=tools, world=e.world, worker=worker)


def sampling_room(e: Engine) -> int:
    """The memory a sampling in this process may spend beyond its own without holding more
    than the update does: the bytes of the policy's gradients, which the update holds all at
    once and which are freed before the next sampling (zero_grad sets them to None). The
    fast loop spends it on packed copies of its single matrices (`FastDecoder`), so that a
    step samples faster at no higher peak. 0 where the update does not hold them all (the
    step in the backward holds one tensor's at a time), on a GPU (where nothing is packed),
    and under torchrun (the gradients are sharded; the sampling gathers whole weights)."""
    if e.device.type != "cpu" or e.world.world_size > 1 or not e.optimizer.holds_all_gradients:
        return 0
    return sum(p.numel() * p.element_size() for p in e.policy_params)


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
    """What a step's progress shows (the bar's fields, a plain line's): reward, KL, length."""
    return {
        "reward": metrics["reward/mean"],
        "kl": metrics.get("kl"),
        "length": f"{metrics['completion_length/mean']:.1f}",
    }


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
) -> TrainResult:
    """Train a policy with GRPO or PPO as `config` says (a Config, a mapping, or a YAML path).

    `rewards`, when given, replaces the config's rewards (as TRL's `reward_funcs` does):
    each a function, a spec string, or a dict as a `rewards` entry of a config. `tools` and
    `environment_factory` (TRL's arguments of those names), when given, replace
    rollout.tools and rollout.environment: functions (or specs) and a class (docs/tools.md).

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
    c = as_config(config, overrides, given)
    device = resolve_device(c.train.device)
    backend = check_launch(launched_world_size(), c, device)
    world = init_world(device, backend)
    try:
        return _train(c, world, device, resume=resume, progress=progress, overwrite=overwrite)
    finally:
        # Under torchrun, vLLM's engine is shut down while the process group is still there
        # (at exit, after world.close(), its shutdown would fail on the destroyed group).
        if world.world_size > 1:
            close_shared_engine()
        world.close()


def _train(
    c: Config, world: World, device: torch.device, *, resume: bool, progress: bool, overwrite: bool = False
) -> TrainResult:
    out = Path(c.output_dir)
    folder = OutputFolder(out, main=world.is_main)

    def inputs():
        """Everything that can be wrong with the input, found before any model is loaded
        (in every process: one that fails stops them all). The config's mistakes come first,
        then the folder's: nothing in output_dir is touched before the config is known good."""
        functions = resolve_functions(c)
        toolbox = Toolbox.from_config(c.rollout)  # the tools' schemas built, the environment probed
        if not c.rewards and not (toolbox is not None and toolbox.owns_reward):
            raise UserError(
                "rewards: at least one reward is required (or a rollout.environment with a get_reward method)"
            )
        absent = missing() if c.rollout.sampler == "vllm" and not c.rollout.vllm.server else None  # a server needs none
        absent = absent or optimizer_missing(c.train.optimizer)
        if absent is not None:
            raise UserError(absent)
        u = c.reward_model_update
        verifier = load_rewards([(u.verifier, 1.0)])[0] if u.verifier else None
        rows = (
            load_rows(
                c.data.path, prompt_column=c.data.prompt_column, split=c.data.split, task_options=c.data.task_options
            )
            if c.data.path
            else environment_rows(c)
        )
        if toolbox is not None:
            toolbox.check_prompts(rows, c.data.prompt_column)
        check_models(c)
        resumable = folder.claim(resume=resume, overwrite=overwrite)
        state = load_latest_checkpoint(out, world_size=world.world_size, rank=world.rank) if resumable else None
        if state is not None:
            check_resume_config(c, state)
        return functions, verifier, rows, state, toolbox

    def dashboards(state):
        """train.report_to's services, started by process 0 before any model is loaded: a
        missing package or a refusal stops every process, in one line, before any step."""
        if not world.is_main:
            return Sinks([])
        return open_dashboards(
            reporters(c.train),
            out,
            config=config_to_dict(c),
            run_name=c.train.run_name or out.resolve().name,
            project=c.train.project,
            first_step=int(state["step"]) + 1 if state else 1,
            resume=state is not None,
        )

    opened = Sinks([])
    try:
        functions, verifier, rows, state, toolbox = world.checked(inputs)
        opened = world.checked(lambda: dashboards(state))
        return _run(c, world, device, folder, functions, verifier, rows, state, opened, progress, toolbox)
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


def _run(
    c: Config,
    world: World,
    device: torch.device,
    folder: OutputFolder,
    functions,
    verifier,
    rows,
    state,
    dashboards: Sinks,
    progress: bool,
    toolbox: Toolbox | None = None,
) -> TrainResult:
    if c.train.return_freed_memory:
        return_freed_memory()  # before the first model's tensors, for the rest of this process
    seed_everything(c.seed)  # the same in every process: the models start the same
    rewards, reward_models = load_reward_models(c, functions, device)
    if toolbox is not None:
        rewards += toolbox.rewards()  # the environment's get_reward, weight 1 (as TRL adds it)
    e = build_engine(c, rewards, device, world)
    generator = build_run_generator(c, e, toolbox)
    try:
        generator.start(e.policy)  # vLLM's engine built, a server admitted: before output_dir changes
        return _steps(
            c,
            world,
            folder,
            e,
            generator,
            rows=rows,
            state=state,
            dashboards=dashboards,
            progress=progress,
            reward_models=reward_models,
            verifier=verifier,
        )
    finally:
        generator.close()


def _steps(
    c: Config,
    world: World,
    folder: OutputFolder,
    e: Engine,
    generator: Generator,
    *,
    rows: list[dict],
    state: dict | None,
    dashboards: Sinks,
    progress: bool,
    reward_models: dict[int, RewardModel],
    verifier: WeightedReward | None,
) -> TrainResult:
    """The run's steps, once its models and its generator are built."""
    out = Path(c.output_dir)
    metrics_path = out / "metrics.jsonl"
    updater = build_updater(c, verifier, reward_models, rows, world) if verifier else NoUpdater()
    # Each step's batch, over the run's one prompt stream: sampled here when the step takes it,
    # or by a generator process ahead of the step (rollout.async).
    rollouts = Rollouts(c, e, generator, rows)
    checkpoints = Checkpointer(e, c, rollouts, updater)  # the stream's position with the weights
    if world.world_size > 1:
        seed_everything(c.seed + 1_000_003 * world.rank)  # each process samples its own stream
    if world.is_main:
        folder.start()  # the models are built: --overwrite's earlier run goes
        write_atomic(out / "config.yaml", yaml.safe_dump(config_to_dict(c), sort_keys=False))

    start = 0
    if state is not None:
        start = checkpoints.restore(state)
        if world.is_main:  # what the stopped run logged after its checkpoint is redone
            rewind_logs(out, start, state.get("metrics"))
    sinks = Sinks([JsonlSink(metrics_path), dashboards] if world.is_main else [])
    steps_per_iteration = math.ceil(c.train.steps / c.train.iterations)
    held = models_held(e, c)
    unscored = 0
    completed, last_metrics = start, None  # steps done (saved or to be saved), and the last one's metrics

    # On a terminal a progress bar; redirected to a file or a cluster's log, one plain line
    # every train.log_every steps (a bar there is one ever-growing line).
    bar = Progress(
        c.train.steps, initial=start, desc=c.algorithm, every=c.train.log_every, enabled=progress and world.is_main
    )
    rollouts.start(e, start)  # from the weights and the stream's position just restored
    with Signals() as signals:
        try:
            for step in range(start, c.train.steps):
                iteration = step // steps_per_iteration
                # What a checkpoint of the steps completed so far needs, should this step fail
                # before it changes any weight.
                snapshot = checkpoints.snapshot()
                if step > 0 and step % steps_per_iteration == 0:
                    # Algorithm 1, between iterations: the reward model learns from the policy's
                    # new samples (iterative RL), then the reference becomes the policy.
                    update = updater.update(e.policy, e.version, rollouts.generator)
                    if update is not None:
                        snapshot["updates"] = None  # the reward model moved: this step cannot be undone
                        if world.is_main:  # every process's replica is the same
                            record_update(out, step + 1, iteration, update, updater, c.reward_model_update.save)
                    e.reference.reset_to(e.policy)
                began = time.perf_counter()
                sampled, taken = rollouts.take(e, step)  # this process's share of the step's prompts
                result = train_step(e, sampled, step, taken["time/generate"])
                result.metrics.update(taken)
                result.metrics.update(rollouts.after_update(e))  # the new weights to the generator, when due
                if rollouts.asynchronous:
                    result.metrics["time/step"] = time.perf_counter() - began
                number = completed = step + 1
                snapshot = None
                metrics = last_metrics = {"step": number, "iteration": iteration + 1, **result.metrics, "models": held}
                sinks.log(number, metrics)
                bar.update(1, **_progress_fields(metrics))
                if world.is_main and c.train.sample_every and number % c.train.sample_every == 0:
                    write_samples(out / "samples.jsonl", number, result, c.data.prompt_column)
                unscored = unscored + 1 if metrics["frac_unscored"] == 1.0 else 0
                give_up = bool(c.train.max_unscored_steps) and unscored >= c.train.max_unscored_steps
                if unscored and world.is_main:
                    print(
                        f"grpo: warning: step {number}: no reward scored any completion (every reward returned None)",
                        file=sys.stderr,
                    )
                # Saving and stopping are collective: every process does both at the same step.
                due = checkpoints.due(number)
                stop, due = world.max(torch.tensor([signals.received or 0, int(due)])).tolist()
                if due or stop or give_up:
                    checkpoints.save(number, iteration, metrics=metrics)
                if stop:
                    raise Stopped(
                        f"stopped by {Signals.name(stop)} after step {number}; "
                        f"checkpoint saved: continue with `grpo train CONFIG --resume`",
                        128 + stop,
                    )
                if give_up:
                    raise UserError(
                        f"no reward scored any completion in {unscored} steps in a row (steps {number - unscored + 1}-{number}): "
                        "check the reward functions and the data's columns (train.max_unscored_steps sets the limit)"
                    )
        except (Stopped, KeyboardInterrupt):
            raise
        except Exception as err:
            # One process alone cannot save a sharded checkpoint. Over several, a UserError
            # (bad input, a failing reward) was agreed by all (world.checked): they save
            # together; any other error may be one process's, and the periodic checkpoints
            # and signal stops (both collective) are what survives it.
            agreed = world.world_size == 1 or isinstance(err, UserError)
            full = no_space(err)  # a write failed for lack of space (a log's, a checkpoint's)
            fix = "free space" if full is not None else "fix the cause"
            iteration = max(completed - 1, 0) // steps_per_iteration  # that of the last completed step
            saved = (
                checkpoints.save_after_failure(completed, iteration, snapshot, last_metrics, fix=fix)
                if agreed
                else None
            )
            if full is not None:
                raise UserError(f"{full} [{saved or kept(out, fix)}]") from err
            if isinstance(err, UserError) and saved is not None:
                raise UserError(f"{err} [{saved}]") from err
            if saved is not None and world.is_main:
                print(f"grpo: {saved}", file=sys.stderr)
            raise
        finally:
            rollouts.close()  # a generator's queue is discarded; a resume samples it again
            bar.close()
            sinks.close()
    checkpoints.save_final(out / "final")
    world.barrier()
    metrics = read_metrics(metrics_path)
    summary = run_summary(c, metrics, held, parameters_held(e, reward_models))
    if world.is_main:
        write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return TrainResult(out, out / "final", metrics, held, summary)
