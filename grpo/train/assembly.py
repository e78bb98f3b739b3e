"""The engine of a run: its models loaded, the pieces in which GRPO and PPO differ chosen
once, and what was decided on the way returned as `Decisions` (grpo.train.step), never
written back into the config or onto the model; and the Generator that samples the policy,
built beside it (grpo.rollout.generator).
"""

from __future__ import annotations

import torch
from torch import nn

from grpo.config import Config
from grpo.infra.devices import attention_for, autocast_dtype, resolve_device
from grpo.infra.distributed import SingleProcess, World
from grpo.rewards import WeightedReward
from grpo.rewards.adapters import ModelReward, ProcessModelReward
from grpo.rewards.model import RewardModel
from grpo.rollout import check_context
from grpo.rollout.generator import Generator, GeneratorSpec
from grpo.rollout.tools import Toolbox
from grpo.rollout.worker import build_generator
from grpo.train.layouts import chunkable_head, decide_layouts
from grpo.train.models import (
    GivenPolicy,
    apply_lora,
    count_parameters,
    enable_checkpointing,
    policy_model,
    policy_tokenizer,
    tie_gradients_in_place,
    trainable_parameters,
)
from grpo.train.networks import build_reference
from grpo.train.optimizers import build_optimizer
from grpo.train.scorers import build_scorer
from grpo.train.seams import build_baseline, build_critic, build_kl
from grpo.train.step import Decisions, Engine


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
    given: GivenPolicy | None = None,
) -> Engine:
    """Load the models onto `device` (train.device's) and choose, once, the pieces in which
    GRPO and PPO differ. Over several processes, the policy and the critic are sharded
    (FSDP2) and the reference is a full replica (grpo.infra.distributed says why). What
    samples the policy is the run's Generator (`build_run_generator`), built beside it.
    `given`: the model and tokenizer handed to grpo.train, used instead of loading c.model."""
    device = resolve_device(c.train.device) if device is None else device
    tokenizer = policy_tokenizer(c.model, given)
    attention = attention_for(c.train.attention, c.rollout.max_new_tokens, device)
    compute_dtype = autocast_dtype(c.train.autocast, device)
    policy, decisions = load_policy(c, attention, device, world, given)
    reference = build_reference(
        policy,
        beta=c.loss.beta,
        lora=bool(c.lora.r),
        dtype=compute_dtype,
        full_state_dict=world.full_state_dict,
        chunked_head=decisions.chunked_head,
        stored=None if c.train.reference_dtype == "auto" else getattr(torch, c.train.reference_dtype),
        layout=decisions.no_grad_passes,  # its passes run as the policy's without a gradient
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


def load_policy(
    c: Config, attention: str | None, device: torch.device, world: World, given: GivenPolicy | None = None
) -> tuple[nn.Module, Decisions]:
    """The policy (with its LoRA adapters), whole, and what was decided for it: which forward
    layouts (checkpointed; packed, shared prompt) serve its architecture, tried once on a
    small batch before sharding, and whether its head runs chunk by chunk (one probe pass):
    returned, for the engine to hand to the passes of the policy and of its reference."""
    policy = policy_model(c.model, given, c.train.dtype, attention, device, c.lora.quantize)  # handed over, or loaded
    check_context(policy, c.rollout.max_prompt_length, c.rollout.max_new_tokens)  # before any step
    checkpointing = c.train.gradient_checkpointing and enable_checkpointing(policy)
    if c.lora.r:
        policy = apply_lora(policy, c.lora.r, c.lora.alpha, c.lora.target_modules, adapter=c.lora.init_adapter)
    taken = decide_layouts(policy, checkpointing, c.train.layout, world=world)
    chunked = c.train.chunked_head and chunkable_head(policy) is not None
    return policy, Decisions(
        checkpointing=taken.checkpointing,
        layout=taken.layout(taken.checkpointing),
        chunked_head=chunked,
        no_grad_layout=taken.plain,
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
