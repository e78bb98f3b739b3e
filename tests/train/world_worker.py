"""One optimizer step on a fixed rollout, in this process or in every process of a torchrun
launch (tests/train/test_distributed.py runs both and compares the weights).

    torchrun --standalone --nproc_per_node 2 -m tests.train.world_worker POLICY REFERENCE PROMPTS OUT

The rollout is hand-built (prompts, completions of different lengths, fixed rewards); each
process takes its share of the groups, as `grpo train` gives each its share of the prompts.
The policy starts at POLICY and the reference at REFERENCE (different weights, so that the
KL and its gradient are not 0).
"""

import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from grpo.config import config_from_dict
from grpo.infra.distributed import SingleProcess, init_world
from grpo.rewards import WeightedReward
from grpo.rollout.weights import policy_weights
from grpo.train.checkpointing import Checkpointer
from grpo.train.loop import build_engine
from grpo.train.step import train_step

from tests.train.test_assembled_step import ADAM_EPS, T_LEN, fixed_rewards, fixed_rollout

LR = 1e-2

# GRPO: 4 prompts x G=3. The last two groups have no spread (all equal rewards): with
# drop_zero_std_groups, process 1 of 2 keeps none of its rows.
GRPO_PROMPTS = ["ab"] * 3 + ["cab"] * 3 + ["c"] * 3 + ["ba"] * 3
GRPO_COMPLETIONS = ["7", "3a7c", "b0", "77", "c1a2b", "", "7", "7", "7", "b0", "b0", "b0"]
# PPO: 4 prompts x G=1.
PPO_PROMPTS = ["a", "cab", "b0", "c"]
PPO_COMPLETIONS = ["3a7c", "7", "c1a2b", "77"]

LORA = {"r": 8, "alpha": 32}

# name: (algorithm, loss, train, lora)
CASES = {
    "grpo-seq-mean-token-mean": ("grpo", {}, {}, {}),
    "grpo-token-mean-micro-batches": ("grpo", {"aggregation": "token-mean"}, {"micro_batch_size": 2}, {}),
    "grpo-sum-norm-batch-scale": ("grpo", {"aggregation": "seq-mean-token-sum-norm", "scale": "batch"}, {}, {}),
    "grpo-drop-zero-std-groups": ("grpo", {"drop_zero_std_groups": True}, {"micro_batch_size": 2}, {}),
    # Micro-batches by real tokens: the processes' rows differ in length, so in passes needed.
    "grpo-token-budget": ("grpo", {"aggregation": "token-mean"}, {"micro_batch_tokens": 9}, {}),
    "ppo": ("ppo", {}, {}, {}),
    # Two updates: the first moves lora_B off 0, so that the second gives lora_A a gradient too.
    "grpo-lora": ("grpo", {}, {"epochs": 2}, LORA),
    # Process 1 keeps no row (a placeholder's passes): the reference's passes, the policy with
    # its adapters off, run as many times in each process as its rows need.
    "grpo-lora-drop-zero-std-groups": ("grpo", {"drop_zero_std_groups": True}, {"micro_batch_size": 2}, LORA),
}


def share_of(rollout, world):
    """This process's groups of the fixed rollout: what its generator would have sampled."""
    groups = len(rollout) // rollout.group_size // world.world_size  # per process
    rows = groups * rollout.group_size
    return rollout.select(torch.arange(world.rank * rows, (world.rank + 1) * rows))


def run_case(name, policy, reference, prompts_file, world):
    """The case's weights after one step (whole, as plain tensors) and its metrics. With LoRA,
    also what a sampler is sent (`policy_weights`: read from the shards, as a generator
    process's publish does, and gathered, as a vLLM engine's), the policy after the
    reference's reset (the adapters merged into the base) and what `final/` then holds."""
    algorithm, loss, train, lora = CASES[name]
    prompts, completions = (GRPO_PROMPTS, GRPO_COMPLETIONS) if algorithm == "grpo" else (PPO_PROMPTS, PPO_COMPLETIONS)
    group_size = 3 if algorithm == "grpo" else 1
    c = config_from_dict(
        {
            "algorithm": algorithm,
            "model": policy,
            "seed": 0,
            "output_dir": "unused",
            "data": {"path": prompts_file},
            "rewards": [{"function": "exact_answer"}],
            "rollout": {
                "group_size": group_size,
                "prompts_per_step": len(prompts) // group_size,
                "max_new_tokens": T_LEN,
                "min_new_tokens": 0,
            },
            "train": {
                "steps": 1,
                "lr": LR,
                "epochs": 1,
                "minibatches": 1,
                "max_grad_norm": 1.0,
                "device": "cpu",
                **train,
            },
            "loss": {"beta": 0.1, **loss},
            "lora": lora,
        }
    )
    torch.manual_seed(0)
    e = build_engine(c, [WeightedReward(name="fixed", fn=fixed_rewards, weight=1.0)], torch.device("cpu"), world)

    e.reference.load_state_dict(AutoModelForCausalLM.from_pretrained(reference).state_dict())
    share = share_of(fixed_rollout(e.tokenizer, prompts, group_size, completions), world)
    for group in e.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    metrics = train_step(e, share)
    weights = {f"policy.{k}": v.clone() for k, v in world.full_state_dict(e.policy).items()}
    for network in e.critic.networks:
        weights.update({f"critic.{k}": v.clone() for k, v in world.full_state_dict(network).items()})
    if lora:
        weights.update({f"published.{k}": v.clone() for k, v in policy_weights(e.policy)})
        with world.gathered(e.policy):
            weights.update({f"gathered.{k}": v.clone() for k, v in policy_weights(e.policy)})
        e.reference.reset_to(e.policy)  # train.iterations: the adapters merged into the shards of the base
        weights.update({f"reset.{k}": v.clone() for k, v in world.full_state_dict(e.policy).items()})
        with tempfile.TemporaryDirectory() as final:  # process 0 alone writes (and reads) it
            Checkpointer(e, c, None, None).save_final(Path(final))
            if world.is_main:
                saved = AutoModelForCausalLM.from_pretrained(final).state_dict()
                weights.update({f"final.{k}": v for k, v in saved.items()})
    return weights, {
        k: metrics.metrics[k]
        for k in ("loss", "kl", "entropy", "grad_norm", "clip_fraction", "reward/mean", "tokens/trained")
    }


def run_all(policy, reference, prompts_file, world=SingleProcess()):
    return {name: run_case(name, policy, reference, prompts_file, world) for name in CASES}


if __name__ == "__main__":
    torch.set_num_threads(1)
    policy_dir, reference_dir, prompts, out = sys.argv[1:5]
    world = init_world(torch.device("cpu"), "gloo")
    results = run_all(policy_dir, reference_dir, prompts, world)
    if world.is_main:
        torch.save(results, out)
    world.close()
