"""What a run refuses, in one table: every combination of features, and every option value,
that cannot run (a plain range check, "must be >= 1", is not one), worded once, here.

A row names the refusal, the config key its one-line message starts with, what is refused,
the reason (str.format fields filled in by the check) and the limit behind it: an engine's,
the math's, or this design's (not built yet). The config check (`grpo.config.checks`), the
checks that need an engine's facts (`grpo.train.preflight`: the sampler's, the launch's) and
the decoders raise a row by name;
docs/refusals.md lists the rows and their limits (tests/test_refusals.py keeps the two
alike). A row that goes goes with the one `if` that raises it.

A leaf: it imports nothing of grpo but grpo.errors, so that config, infra and rollout all
read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from grpo.errors import UserError

__all__ = ["REFUSALS", "Refusal", "refusal", "refuse"]


@dataclass(frozen=True)
class Refusal:
    key: str  # what the message starts with: the config key to change
    what: str  # the combination (or the value) refused, as docs/refusals.md lists it
    reason: str  # the rest of the one line; {fields} filled in by the check
    limit: str  # the engine's, the math's or the design's limit behind it, for docs/refusals.md


REFUSALS: dict[str, Refusal] = {
    # ---- rewards
    "process+function": Refusal(
        "rewards.{i}.process",
        "`rewards[].process: true` on a reward function",
        "only reward models have a process mode; a function returns its own steps",
        "none: a function scores steps by returning them (docs/reward-models.md)",
    ),
    "process-model+outcome": Refusal(
        "rewards.{i}.process",
        "a process reward model with `loss.supervision: outcome`",
        "needs loss.supervision: process",
        "math: an outcome loss takes one reward per completion, not one per step",
    ),
    "reward-model+timeout": Refusal(
        "rewards.{i}",
        "`rewards[].timeout` or `rewards[].isolate` on a reward model",
        "timeout and isolate apply to reward functions, not reward models",
        "design: they contain user code; a reward model is our own forward pass",
    ),
    # ---- the loss
    "group+one-sample": Refusal(
        "rollout.group_size",
        "`loss.baseline: group` with `rollout.group_size: 1`",
        "the group baseline needs at least 2 completions per prompt, got {group_size}",
        "math: the baseline is the group's mean and std; one sample has no std",
    ),
    "group+kl-in-reward": Refusal(
        "loss.kl_in",
        "`loss.baseline: group` with `loss.kl_in: reward`",
        "the group baseline takes sequence rewards, so the KL goes in the loss ('loss')",
        "math: the group baseline normalises one reward per completion; a per-token penalty has no place in it",
    ),
    "drop-zero-std+one-sample": Refusal(
        "loss.drop_zero_std_groups",
        "`loss.drop_zero_std_groups` with `rollout.group_size: 1`",
        "needs rollout.group_size >= 2 (a group of one has no spread)",
        "math: a group of one always has zero spread",
    ),
    "process+critic": Refusal(
        "loss.supervision",
        "`loss.supervision: process` with `loss.baseline: critic`",
        "process supervision needs the group baseline (loss.baseline: group)",
        "design: process advantages are normalised over the group (DeepSeekMath §4.1.3); GAE over step rewards "
        "is not built",
    ),
    "multi-turn+process": Refusal(
        "rollout.tools / rollout.environment / rollout.agent",
        "`rollout.tools`, `rollout.environment` or `rollout.agent` with `loss.supervision: process`",
        "process supervision of multi-turn rollouts is not supported; use loss.supervision: outcome",
        "design: steps are character offsets in one completion's text; placing them around tool messages is not built",
    ),
    "agent+tools": Refusal(
        "rollout.agent",
        "`rollout.agent` with `rollout.tools` or `rollout.environment`",
        "an agent program runs its own turns and tools, while rollout.tools and rollout.environment are grpo's own "
        "turn loop's; give the agent its tools (it sends them with its requests), or drop rollout.agent",
        "design: one loop drives an episode, the agent's or grpo's",
    ),
    "sampler-logprobs+hf": Refusal(
        "train.old_logprobs",
        "`train.old_logprobs: sampler` with `rollout.sampler: hf`",
        "sampler needs a sampler that returns log-probs (fast or vllm); transformers' generate (rollout.sampler: hf) "
        "gives none",
        "engine: `generate` returns no log-probs of the tokens it drew",
    ),
    # ---- sampling
    "fast-only": Refusal(
        "rollout.{name}",
        "`rollout.draw: fast` (the fast loop's draw) with `rollout.sampler: hf` or `vllm`, or `auto` where it picks "
        "hf; `rollout.draw: generate` with `vllm`",
        "{value} is the fast loop's {name}; rollout.sampler: {sampler} draws its own way; set rollout.{name}: "
        "{default} (or sample with the fast loop)",
        "engine: `generate` and vLLM draw with their own random numbers",
    ),
    "lora+sampler": Refusal(
        "rollout.sampler",
        "LoRA (`lora.r` > 0) with `rollout.sampler: fast`",
        "{sampler} cannot decode a LoRA-wrapped policy; use {auto} (falls back to {fallback}) or {able}",
        "design: the fast loop fuses the base model's weight matrices, without the adapters",
    ),
    "adapter+iterations": Refusal(
        "lora.save",
        "`lora.save: adapter` or `both` with `train.iterations` >= 2 and a reference (`loss.beta` > 0)",
        "{save} keeps an adapter of the base the run started from, but between iterations the adapter is merged "
        "into the base (the reference's reset) and starts again from zero; set lora.save: merged, or train.iterations: 1",
        "math: the adapters of several iterations add up to a change of higher rank than lora.r, which no one adapter holds",
    ),
    "sampler+model": Refusal(
        "rollout.sampler",
        "a decoder named in `rollout.sampler` with a model it cannot run (the fast loop: a model outside the Llama "
        "family, or a sliding window shorter than the sequence; vLLM on a CPU: a head size its attention lacks)",
        "{sampler} cannot decode this model: {why}; use {others}",
        "engine: each decoder's own (docs/speed.md, docs/vllm.md)",
    ),
    "vllm+top_p+min_p": Refusal(
        "rollout.sampler",
        "`rollout.sampler: vllm` with both `rollout.top_p` and `rollout.min_p`",
        "vllm applies min_p before top_p (generate after), so it cannot sample rollout.top_p and rollout.min_p "
        "together as the other decoders do; set one of them",
        "engine: vLLM's order of the sampling filters",
    ),
    "server+not-vllm": Refusal(
        "rollout.vllm.server",
        "`rollout.vllm.server` without `rollout.sampler: vllm`",
        "the server samples with rollout.sampler: vllm; set it",
        "engine: the server is a vLLM engine",
    ),
    "transport-nccl": Refusal(
        "rollout.vllm.transport",
        "`rollout.vllm.transport: nccl` (or any transport but `file`)",
        "{transport} is not available in this version; use file (trainer and server on one machine)",
        "not built: vLLM's GPU-to-GPU weight transfer cannot be tested without GPUs (docs/vllm-server.md)",
    ),
    # ---- asynchronous rollouts
    "async+hf": Refusal(
        "rollout.async",
        "asynchronous rollouts (`rollout.async.max_staleness` >= 1) with `rollout.sampler: hf`",
        "rollout.sampler: hf (transformers' generate) returns no log-probs, which a stale batch's ratio needs; "
        "use fast, auto or vllm",
        "engine: `generate` returns no log-probs, and the weights that drew a stale batch are gone",
    ),
    "async+auto-hf": Refusal(
        "rollout.async",
        "asynchronous rollouts with `rollout.sampler: auto` on a model only `generate` can sample",
        "rollout.sampler: auto chose transformers' generate for this model (the fast loop cannot run it), which "
        "returns no log-probs, and a stale batch's ratio needs the sampling policy's; use rollout.sampler: vllm, or "
        "no rollout.async",
        "engine: as `async+hf`; known once the model is (docs/speed.md lists what the fast loop runs)",
    ),
    "async+server+torchrun": Refusal(
        "rollout.async",
        "asynchronous rollouts with `rollout.vllm.server` under torchrun (several processes)",
        "the generator processes of {world_size} training processes cannot share one vLLM server in this version; "
        "set rollout.async.max_staleness: 0 (process 0 then pushes for all), or rollout.vllm.server: '' (an engine "
        "in each generator)",
        "not built: a server holds one version of the weights at a time, and each process's generator samples ahead "
        "on its own schedule, outside the process group: one push per version needs them to agree when it happens",
    ),
    "async+recompute-uncorrected": Refusal(
        "train.old_logprobs",
        "`train.old_logprobs: recompute` with asynchronous rollouts and `loss.engine_correction: none`",
        "recompute with rollout.async anchors the ratio at the current weights, and only loss.engine_correction "
        "(token_tis or sequence_mask) then corrects for the weights that sampled; set one, or use auto",
        "math: without the correction nothing weighs a stale batch for the weights that drew it (docs/async.md)",
    ),
    # ---- iterative RL
    "iterative+no-reward-model": Refusal(
        "reward_model_update.verifier",
        "`reward_model_update.verifier` with no reward model among `rewards`",
        "there is no reward model to update; add a rewards entry with a `model`",
        "none: there is nothing to train",
    ),
    "iterative+function-reward": Refusal(
        "reward_model_update.reward",
        "`reward_model_update.reward` naming a reward function",
        "rewards.{index} is not a reward model",
        "none: a function has no weights to train",
    ),
    "iterative+one-iteration": Refusal(
        "reward_model_update.verifier",
        "`reward_model_update.verifier` with `train.iterations: 1`",
        "the reward model is updated between iterations; set train.iterations >= 2",
        "math: DeepSeekMath's Algorithm 1 updates the reward model between iterations",
    ),
    # ---- QLoRA (lora.quantize)
    "quantize+iterations": Refusal(
        "lora.quantize",
        "`lora.quantize` (a 4-bit base) with `train.iterations` >= 2 and a reference (`loss.beta` > 0)",
        "the reference becomes the policy between iterations by merging the adapter into the base, which in 4 bits "
        "rounds most of it away; set lora.quantize: none, train.iterations: 1, or loss.beta: 0",
        "math: a merge into 4-bit weights loses the adapter's small deltas to their quantization step (TRL #3466)",
    ),
    # ---- the optimizer
    "in-backward+clipping": Refusal(
        "train.max_grad_norm",
        "`train.optimizer_in_backward` with `train.max_grad_norm` > 0",
        "train.optimizer_in_backward steps each weight as soon as its gradient is complete, before the global "
        "norm that clipping divides by exists (got max_grad_norm {max_norm}); set train.max_grad_norm: 0",
        "math: clipping by the global norm needs every gradient at once, which the step in the backward never holds",
    ),
    "in-backward+token-budget": Refusal(
        "train.micro_batch_tokens",
        "`train.optimizer_in_backward` with `train.micro_batch_tokens`",
        "train.optimizer_in_backward steps at every backward pass, so a minibatch must be one pass, and "
        "train.micro_batch_tokens: {tokens} may split it into several; set train.micro_batch_tokens: 0",
        "math: accumulating micro-batches' gradients holds the whole gradient, which the step in the backward "
        "exists not to hold",
    ),
    "in-backward+accumulation": Refusal(
        "train.micro_batch_size",
        "`train.optimizer_in_backward` with several micro-batches a minibatch",
        "train.optimizer_in_backward steps at every backward pass, so a minibatch must be one pass: "
        "{micro} completions a pass for the {rows} of a minibatch; set train.micro_batch_size: 0 (or more "
        "train.minibatches)",
        "math: accumulating micro-batches' gradients holds the whole gradient, which the step in the backward "
        "exists not to hold",
    ),
    # ---- the launch (torchrun)
    "nccl+cpu": Refusal(
        "train.backend",
        "`train.backend: nccl` on a CPU",
        "nccl needs CUDA devices, but this run is on the {device} (train.device: {setting}); use gloo or auto",
        "engine: NCCL runs on CUDA devices only",
    ),
    "torchrun+uneven-prompts": Refusal(
        "rollout.prompts_per_step",
        "`rollout.prompts_per_step` not a multiple of the number of processes",
        "{prompts} prompts cannot be split evenly over {world_size} processes (each samples prompts_per_step / "
        "world_size prompts with all their completions); use a multiple of {world_size}",
        "design: a group never spans processes, and every process samples as many prompts",
    ),
    "adamw_8bit+torchrun": Refusal(
        "train.optimizer",
        "`train.optimizer: adamw_8bit` under torchrun (several processes)",
        "adamw_8bit runs in one process in this version (this launch has {world_size}): bitsandbytes cannot step "
        "FSDP2's sharded weights; use adamw, whose moments FSDP2 splits over the processes",
        "engine: bitsandbytes' optimizer kernels register no DTensor sharding rule; stepping each process's local "
        "shards, with their 8-bit state saved per process, is not built",
    ),
    "in-backward+torchrun": Refusal(
        "train.optimizer_in_backward",
        "`train.optimizer_in_backward` under torchrun (several processes)",
        "train.optimizer_in_backward runs in one process in this version (this launch has {world_size}); "
        "set it to false, or run on one process",
        "design: stepping FSDP2's shards as their reduce-scattered gradients arrive is not built",
    ),
    "quantize+torchrun": Refusal(
        "lora.quantize",
        "`lora.quantize` (a 4-bit base) under torchrun (several processes)",
        "a 4-bit base trains in one process in this version (this launch has {world_size}); set lora.quantize: none "
        "to shard a LoRA run over the processes, or run on one process",
        "not built: FSDP2 shards plain tensors, and bitsandbytes' packed 4-bit weights with their quantization state "
        "are not; sharding them as peers do (QLoRA with FSDP's own wrapper) is not built here",
    ),
    # ---- a policy handed to grpo.train as an object
    "given-policy+async": Refusal(
        "rollout.async",
        "asynchronous rollouts with a model or tokenizer handed to `grpo.train` as an object",
        "a model or tokenizer handed to grpo.train cannot reach the generator's process, which loads the policy "
        "from `model`; save them (save_pretrained) and name the folder in model, or set rollout.async.max_staleness: 0",
        "not built: the generator's process loads its copy of the policy from a folder or hub id",
    ),
    "given-model+critic": Refusal(
        "value.model",
        "PPO's critic (`loss.baseline: critic`) with no `value.model` and a model handed to `grpo.train`",
        "the critic starts from the policy's folder, and the model handed to grpo.train has none here; name the "
        "critic's start in value.model (a folder or hub id)",
        "not built: the value model loads its backbone from a folder or hub id",
    ),
    "given-model+quantize": Refusal(
        "lora.quantize",
        "`lora.quantize` with a model handed to `grpo.train`",
        "{quantize} loads the base from `model` in 4 bits, and a model handed to grpo.train is used as it was "
        "loaded; load it in 4 bits yourself (BitsAndBytesConfig) and leave lora.quantize: none",
        "design: a loaded model is trained as it is; quantizing it again in place is not built",
    ),
}


def refusal(name: str, /, **fields) -> str:
    """The one-line message of row `name`, its {fields} filled in: 'key: reason'."""
    row = REFUSALS[name]
    return f"{row.key}: {row.reason}".format(**fields)


def refuse(name: str, /, **fields) -> NoReturn:
    """Raise row `name` as a UserError (`refusal`'s line)."""
    raise UserError(refusal(name, **fields))
