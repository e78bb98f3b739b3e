"""The typed run configuration: a YAML file plus dotted `--set` overrides, validated up front.

Every field carries its documentation (`grpo train --help` prints them all). Validation runs
before any model is loaded: an unknown or misspelt key, a value of the wrong type or an
impossible value raises `UserError` with one line that names the key.

The algorithm is a preset for exactly the three places where GRPO and PPO differ
(DeepSeekMath §4.1): where the baseline comes from (`loss.baseline`: the group of G
samples, or a learned critic), where the KL goes (`loss.kl_in`: the loss, or the per-token
reward) and which estimator measures it (`loss.kl_estimator`: k3 or k1). Keys left unset
take the preset's value; keys set explicitly win.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any, Literal

import yaml

from grpo.errors import UserError
from grpo.rollout.decoders import NAMES as DECODERS
from grpo.rollout.decoders import fast_only_refusal, lora_refusal
from grpo.vllm import split_address, unsupported

__all__ = [
    "AsyncConfig",
    "Config",
    "PRESETS",
    "REQUIRED",
    "as_tree",
    "config_from_dict",
    "config_to_dict",
    "describe_fields",
    "field_default",
    "key_of",
    "load_config",
    "opt",
]


# `opt(REQUIRED, doc)`: a field the caller must give (it has no default).
REQUIRED: Any = dataclasses.MISSING


def opt(default: Any, doc: str, *, key: str | None = None, **kw) -> Any:
    """A dataclass field with its documentation attached: every config of the project (the
    run's, and those of `grpo sft`, `eval`, `rm` and `demo`) declares its fields so, one
    docstring per field; the command-line flags take their help and default from it. `key`:
    the field's name in YAML and --set where it cannot be its Python name (a keyword)."""
    metadata = {"doc": doc, **({"key": key} if key else {})}
    if default is REQUIRED:
        return field(metadata=metadata, **kw)
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


def key_of(f: dataclasses.Field) -> str:
    """A field's config key: its Python name, or the `key` it was declared with (`opt`)."""
    return f.metadata.get("key", f.name)


def as_tree(value: Any) -> Any:
    """A config (or any part of one) as nested dicts and lists under its config keys, as
    `dataclasses.asdict` but keyed by `key_of` (functions and classes kept as they are)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {key_of(f): as_tree(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return type(value)(as_tree(v) for v in value)
    if isinstance(value, dict):
        return {k: as_tree(v) for k, v in value.items()}
    return copy.deepcopy(value)


def field_default(f: dataclasses.Field) -> Any:
    """A field's default (a fresh copy of a mutable one), or REQUIRED when it has none."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@dataclass
class DataConfig:
    path: str = opt(
        "",
        "Prompt data: a .jsonl/.json/.parquet/.csv file, a saved `datasets` directory, a `datasets` name, or 'reasoning_gym:NAME?size=N&seed=S' for rows a reasoning-gym task generates (the `gym` extra; see docs/reasoning-gym.md).",
    )
    prompt_column: str = opt(
        "prompt",
        "Column holding the prompt: a string, or a list of chat messages (then the tokenizer's chat template is applied).",
    )
    split: str = opt("train", "Split to use when `path` is a `datasets` name or a saved DatasetDict.")
    shuffle: bool = opt(True, "Shuffle the prompts by `seed`, reshuffling at each pass over the data.")
    task_options: dict[str, Any] = opt(
        {},
        "With a reasoning_gym:NAME data.path: the task's own options (the fields of its config, e.g. {min_digits: 2}).",
    )


@dataclass
class RewardConfig:
    function: str | Callable | None = opt(
        None,
        "A built-in reward (exact_answer, math_answer, r1_format, reasoning_gym, arithmetic_*) or 'pkg.module:function', called as TRL's GRPOTrainer calls it: fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns) -> list[float | None] (conversational prompts: each completion is [{'role': 'assistant', 'content': text}], with rollout.tools its turns and tool messages; with rollout.environment it may take environments=; sync or async). With loss.supervision: process it may return, per completion, a list of (end, reward) steps (end = character offset one past the step).",
    )
    model: str | None = opt(
        None,
        "A reward model (a directory from `grpo rm train`, or a hub id of a sequence-classification model with one output) scoring prompt + completion.",
    )
    weight: float = opt(1.0, "Weight of this reward in the weighted sum.")
    normalize: bool = opt(
        False,
        "Reward models: standardise the model's scores over each step's batch (mean 0, std 1) before weighting, so they mix with 0/1 rule rewards on a known scale.",
    )
    process: bool = opt(
        False,
        "Reward models with loss.supervision: process: score the prefix ending at each step (a process reward model); steps end at the characters in `step_separator`.",
    )
    step_separator: str = opt("\n", "Process reward models: the characters that end a reasoning step.")
    timeout: float | None = opt(
        None,
        "Functions: seconds one call may take (null = no limit). A call that takes longer fails the step (or scores None, with on_timeout: none). The call is abandoned, not stopped, unless isolate is on.",
    )
    on_timeout: Literal["fail", "none"] = opt(
        "fail",
        "Functions: what a call past `timeout` does: fail the run (a checkpoint of the last completed step is kept), or score the whole batch None for this function.",
    )
    isolate: bool = opt(
        False,
        "Functions: run the function in a worker process, which is killed when a call passes `timeout` (for rewards that run untrusted or runaway code). Costs a round trip per call (benchmarks/README.md).",
    )


@dataclass
class VllmConfig:
    server: str = opt(
        "",
        "'' (default): the engine runs in the training process (colocated, TRL's default), on the policy's device, one per process under torchrun. HOST:PORT: a `grpo vllm-serve --model DIR` server instead, holding the same model (checked before the first step); the weights are pushed to it after every update (see transport), and the other engine options here are then the server's flags. The trainer does not need vLLM installed then.",
    )
    transport: Literal["file", "nccl"] = opt(
        "file",
        "Server mode: how the weights reach the server. file: one safetensors file in /dev/shm (or the temporary folder), read by the server and deleted; trainer and server on one machine. nccl (GPU to GPU, vLLM's weight transfer engine) is not available in this version.",
    )
    timeout: float = opt(
        600.0,
        "Server mode: the seconds one generate request or weight push may take before the run fails (the health check before the first step waits 10).",
    )
    gpu_memory_utilization: float = opt(
        0.3,
        "CUDA: the share of the GPU's memory the colocated engine takes (weights, activations, KV cache); the rest is the trainer's. TRL's colocated default.",
    )
    sleep: bool = opt(
        False,
        "CUDA: sleep mode; the engine frees its KV cache and weights while the update runs (the first cure for a colocated out-of-memory), at the cost of waking it for each step. Nothing on a CPU.",
    )
    kv_cache_gb: int = opt(
        1, "CPU: the engine's KV cache, in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE; an environment value set wins)."
    )
    max_num_seqs: int = opt(256, "Sequences the engine decodes at once (vLLM's max_num_seqs).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "The engine's dtype; auto: train.autocast's where set, else the policy's."
    )
    check_sync: bool = opt(
        True,
        "After each weight sync, check that the engine holds the policy's weights: its log-probs of one fixed 32-token sequence against the trainer's (one short prompt pass each); a run whose engine went stale fails with a clear error instead of training on another model's samples.",
    )
    check_tolerance: float | None = opt(
        None,
        "The check's limit on the mean |log-prob difference| per token; null: 1e-3 for a float32 engine, 5e-2 for 16 bits (a stale engine is off by far more).",
    )


@dataclass
class AsyncConfig:
    max_staleness: int = opt(
        0,
        "K: how many optimizer steps the weights that sampled a batch may lag the weights it trains (its staleness). 0: the synchronous step (sample, then train, one after the other). K >= 1: a generator in a worker process of its own samples the next batches while the trainer trains this one, (K - push_every + 1) // (train.epochs x train.minibatches) steps ahead; a batch older than K is dropped (async/dropped) and sampled again. The old log-probs of the ratio are the sampler's (docs/async.md). With rollout.sampler: vllm the engine runs in the generator process (colocated), or the generator is the client of the vLLM server (rollout.vllm.server): it pushes each version's weights to the server, checks them, and stamps each batch with the version the server confirmed.",
    )
    push_every: int = opt(
        1,
        "With max_staleness >= 1: send the trained weights to the generator after every N optimizer steps (fewer copies; batches up to N - 1 steps staler).",
    )
    threads: int = opt(1, "With max_staleness >= 1: the generator process's torch threads.")
    timeout: float = opt(
        600.0,
        "With max_staleness >= 1: the seconds the trainer waits for one batch before the run fails with a one-line error (a hung or stalled generator); the wait itself is the metric async/queue_wait_s.",
    )


@dataclass
class RolloutConfig:
    group_size: int = opt(
        8, "G: completions sampled per prompt. GRPO's baseline is the group, so G >= 2; PPO may use 1."
    )
    prompts_per_step: int = opt(4, "Prompts per step; a step samples prompts_per_step * group_size completions.")
    max_new_tokens: int = opt(64, "Longest completion, in tokens (generation stops earlier at EOS).")
    min_new_tokens: int = opt(0, "Shortest completion: EOS is suppressed before this many tokens.")
    temperature: float = opt(1.0, "Sampling temperature; log-probabilities in the loss use the same temperature.")
    top_p: float = opt(
        1.0,
        "Nucleus sampling: keep the smallest set of tokens with this much probability (1 = off). A truncation the loss does not score (docs/sampling.md).",
    )
    top_k: int = opt(
        0, "Sample among the k most likely tokens (0 = off). A truncation the loss does not score (docs/sampling.md)."
    )
    min_p: float = opt(
        0.0,
        "Min-p sampling: drop the tokens less likely than min_p times the most likely one, after temperature, top-k and top-p (0 = off; in [0, 1)). Like top_k and top_p a truncation the loss does not score: its log-probabilities are of the untruncated distribution (docs/sampling.md).",
    )
    repetition_penalty: float = opt(
        1.0,
        "Repetition penalty, as transformers' generate applies it (1 = off; > 1 penalises): the score of every token already in the sequence, prompt included, is divided by it (multiplied when negative) before temperature. The loss scores the same penalised distribution, for the policy, the old policy and the reference alike (docs/sampling.md).",
    )
    draw: Literal["generate", "fast"] = opt(
        "generate",
        "How the fast loop computes each token's draw. generate: as transformers' generate does, bit for bit (its LM head matmul, then torch.multinomial's draw: an exponential per vocabulary entry), so the same tokens as rollout.sampler: hf for the same seed. fast: the same distribution, other tokens: one float64 uniform per row looked up in the distribution's cumulative sum (inverse CDF), and, on a CPU with fewer than 12 rows to decode, every matmul as W @ x^T, which MKL runs several times faster there than F.linear (the logits differ in float rounding). Measured: 0.44x the sampling time per token on a 151,936-token vocabulary, 0.63x on SmolLM2-135M (docs/sampling.md). The fast loop only (rollout.sampler: fast, or auto where it picks fast).",
    )
    max_prompt_length: int = opt(
        0,
        "Longest prompt, in tokens (0 = no limit): longer prompts keep their last max_prompt_length tokens (truncated from the left, as TRL does); the metric prompts/truncated counts them. max_prompt_length + max_new_tokens must fit the model's positions.",
    )
    generation_batch_size: int = opt(
        0,
        "Completions generated per call (0 = the whole step at once). Smaller bounds generation memory (the KV cache); results are the same up to sampling order.",
    )
    seed_per_prompt: bool = opt(
        False,
        "Draw each prompt's G completions from their own generator, seeded by the run's seed, the step and the prompt's index in the step's batch: a run's samples, and so its metrics, then do not depend on the number of torchrun processes (nor on generation_batch_size). Off: each process draws each step from one random stream of the sampler's own (seeded by the seed, its rank and the step; apart from the global stream the update draws from), the same tokens as transformers' generate draws from the same stream. On costs one sampling call per prompt and token (per prompt and step with sampler: hf).",
    )
    sampler: Literal[DECODERS] = opt(
        "auto",
        "Decoding loop: 'fast' (grpo's KV-cache loop for Llama/Qwen2/Qwen3/Mistral models: each prompt's prefix computed once for its G completions, no per-token allocations; the same tokens as 'hf' for the same seed), 'hf' (transformers' generate: any model, e.g. with LoRA), 'vllm' (a vLLM engine, options under rollout.vllm; needs vLLM installed, docs/vllm.md; its own random draws, not fast's or hf's), or 'auto' (fast where the model is supported, else hf; never vllm).",
    )
    vllm: VllmConfig = opt(VllmConfig(), "The vLLM engine, with sampler: vllm.")
    tools: list[str | Callable] = opt(
        [],
        "Tools the model may call while it generates (TRL's tools=): 'pkg.module:function' specs (from Python, grpo.train(config, tools=[fn])), plain functions, sync or async, with type hints and a Google-style docstring (their JSON schema, from transformers' get_json_schema, goes into the prompt through the chat template). Needs chat prompts and a chat template with the Qwen2.5/Hermes <tool_call> format (docs/tools.md). A call's result goes back as a tool message, whose tokens are in the completion but not in the loss.",
    )
    environment: str | type | None = opt(
        None,
        "An environment class (TRL's environment_factory=), 'pkg.module:Class' (from Python, grpo.train(config, environment_factory=Class)): one instance per rollout, reset(**row) -> str | None (text appended to the prompt's last message), every public method a tool, an optional get_reward() -> float added as a reward of weight 1; reward functions may take environments= (the instances, in row order). docs/tools.md.",
    )
    max_tool_calls: int | None = opt(
        None,
        "With tools: the most model turns whose tool calls are run in one rollout (TRL's max_tool_calling_iterations; every call of a turn runs); past it the rollout ends at the model's turn. null: no limit but max_new_tokens, which bounds the whole completion, tool messages included.",
    )
    async_: AsyncConfig = opt(
        AsyncConfig(),
        "Asynchronous rollouts: sample the next batches in a worker process while this one trains (docs/async.md).",
        key="async",  # a Python keyword: the field is async_, the config key async
    )
    tool_timeout: float | None = opt(
        30.0,
        "With tools: seconds one tool call may take (null = no limit). A call past it, one that raises, or one that calls sys.exit or os._exit becomes an error message to the model (and counts in tools/failures); the run goes on. The call is abandoned, not stopped, unless tool_isolate is on.",
    )
    tool_isolate: bool = opt(
        False,
        "With tools: run each of rollout.tools in a worker process of its own (as a reward's isolate), imported by its spec: a call past tool_timeout is killed, and one that crashes its process (a segfault) is an error message too. An environment's methods stay in the training process. Costs a round trip per call (docs/tools.md).",
    )


@dataclass
class TrainConfig:
    steps: int = opt(100, "Total RL steps (each: sample, score, advantages, update).")
    iterations: int = opt(
        1,
        "Outer iterations of DeepSeekMath Algorithm 1; the reference model is reset to the policy at the start of each. Steps are split evenly among them.",
    )
    lr: float = opt(
        1e-6, "Policy learning rate (DeepSeekMath: 1e-6 for 7B; ~1e-3 suits tiny models trained from scratch)."
    )
    epochs: int = opt(
        1,
        "mu: update epochs over each step's batch. With 1 the old policy is the current one: no extra forward pass, the ratio is 1.",
    )
    minibatches: int = opt(
        1, "Optimizer steps per epoch: the batch of completions is split into this many minibatches."
    )
    micro_batch_size: int = opt(
        0, "Completions per forward/backward pass within a minibatch (gradient accumulation); 0 = the whole minibatch."
    )
    old_logprobs: Literal["auto", "recompute", "sampler"] = opt(
        "auto",
        "Where the old policy's log-probs (the ratio's anchor, when epochs or minibatches move the policy within a step) come from. recompute: a no-grad pass of the policy over the batch. sampler: the log-probs the sampler returned with its tokens (the fast loop's or vLLM's; an error with transformers' generate, which gives none); the engine correction then has no mismatch to measure. auto: the sampler's where they are the trainer's own up to float rounding (the fast loop on the current float32 weights, no top-p/top-k/min-p/min_new_tokens), else recompute: one forward pass fewer a step; and the sampler's for a batch that earlier weights sampled (rollout.async: the sampling policy's, docs/async.md). recompute with rollout.async: the current weights anchor the ratio and loss.engine_correction weighs each token by pi_current / pi_sampler (decoupled PPO).",
    )
    length_grouping: bool = opt(
        True,
        "Order a minibatch's completions by length before splitting it into micro-batches (micro_batch_size), so that each micro-batch holds completions of similar length; a prompt's completions stay together while the update shares their prompt pass. Every pass is cut to its micro-batch's longest completion either way; this makes that cut deeper. The same gradient as false (only which completions share a pass changes); also orders the reference, old-policy and critic passes.",
    )
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    adam_betas: list[float] = opt([0.9, 0.999], "AdamW betas.")
    warmup_steps: int = opt(0, "Linear learning-rate warm-up, in optimizer steps.")
    schedule: Literal["constant", "linear", "cosine"] = opt("constant", "Learning-rate schedule after warm-up.")
    max_grad_norm: float = opt(1.0, "Clip the gradient norm to this (0 = no clipping).")
    checkpoint_every: int = opt(0, "Also save a resumable checkpoint every N steps (0 = by time only).")
    checkpoint_minutes: float = opt(
        10.0,
        "Save a resumable checkpoint when this many minutes have passed since the last (0 = by steps only); the first after the first step that ends a minute into the run, so that an early fault (a full disk) leaves one to resume (docs/resume.md). A run also saves at the end, and on Ctrl-C, SIGTERM or an error after its first step.",
    )
    keep_checkpoints: int = opt(2, "How many of the newest checkpoints to keep.")
    max_unscored_steps: int = opt(
        5,
        "Stop the run (with a checkpoint) after this many steps in a row where no reward scored any completion (0 = never); each such step warns.",
    )
    log_every: int = opt(
        10,
        "When stderr is not a terminal (a file, a cluster's log), print one plain line every N steps (step, reward, KL, length, s/step) instead of a progress bar; on a terminal the bar. --quiet prints neither.",
    )
    sample_every: int = opt(
        10, "Write a sample of completions with their rewards to samples.jsonl every N steps (0 = never)."
    )
    report_to: list[str] | str | None = opt(
        [],
        "Where the metrics go besides metrics.jsonl, from process 0 (TRL's report_to): a list of tensorboard (output_dir/tensorboard; grpo[tensorboard]), wandb (Weights & Biases; grpo[wandb]; follows WANDB_MODE, e.g. offline, and WANDB_DIR, else output_dir/wandb) and trackio (its local SQLite store under TRACKIO_DIR, no network; grpo[trackio]); one name, or several joined by commas; or none / [] for metrics.jsonl only.",
    )
    tensorboard: bool = opt(False, "true: the same as adding tensorboard to report_to (the older spelling).")
    run_name: str = opt("", "The run's name in wandb and trackio (TRL's run_name); empty: output_dir's folder name.")
    project: str = opt(
        "",
        "The wandb and trackio project the run is filed under (TRL's project); empty: $WANDB_PROJECT for wandb if set, else 'grpo'.",
    )
    device: str = opt(
        "auto",
        "Where the models and batches live: auto (a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N. Under torchrun each process takes the GPU of its LOCAL_RANK (for auto and cuda). The policy, reference, critic, reward models and the sampler's cache all live there.",
    )
    backend: Literal["auto", "nccl", "gloo"] = opt(
        "auto", "torch.distributed backend under torchrun: auto (NCCL on GPUs, gloo on CPUs), nccl or gloo."
    )
    dtype: Literal["float32", "bfloat16"] = opt(
        "float32",
        "Dtype the models are loaded in (the weights, gradients and optimizer state; see autocast for the compute dtype).",
    )
    attention: Literal["auto", "eager", "sdpa", "flash_attention_2"] = opt(
        "auto",
        "Attention kernel of the policy, reference and critic (transformers' attn_implementation). auto: on a CPU, eager up to 512 new tokens (its backward is the faster one at such lengths, benchmarks/README.md; it holds the (B, heads, T, T) scores) and the model's default beyond; on a GPU the model's default (SDPA). flash_attention_2 needs the flash-attn package.",
    )
    gradient_checkpointing: bool = opt(
        True,
        "Activation checkpointing for the policy's update (TRL's default): each layer keeps only its input and recomputes the rest in the backward, one more forward pass of compute for much less activation memory. The update then runs one pass per row, without sharing a group's prompt. false: faster steps where memory allows (measured in benchmarks/README.md). A model without transformers' checkpointing support trains without, with a warning.",
    )
    chunked_head: bool = opt(
        True,
        "Compute the log-probs (reference, old-policy and update passes) and the entropy metric from the last hidden states through the LM head a chunk of positions at a time, the backward recomputing each chunk's logits: no (completions x tokens x vocabulary) logits are ever held. The same numbers as false (full logits, then the log-probs); a model whose logits are not its head's output (soft-capping, a logit scale) or whose head is not a plain linear layer runs that path whatever this says.",
    )
    autocast: Literal["auto", "off", "bfloat16"] = opt(
        "auto",
        "Mixed precision (auto: bfloat16 on a GPU, off on a CPU): run sampling, the reference/old-policy passes and the policy's forward in bfloat16 (torch.autocast; the fast sampler decodes with bf16 weights), keeping weights, gradients and optimizer state in `dtype`. Pays on GPUs and on CPUs with AVX512-BF16/AMX once matmuls are big enough (models of ~1M parameters and up; below that it can be slower; measured in benchmarks/README.md). Changes the numbers (bf16 keeps ~3 significant digits), so runs differ from float32 ones; learning does not (same README).",
    )


@dataclass
class LossConfig:
    baseline: Literal["group", "critic"] | None = opt(
        None,
        "Where advantages come from: 'group' (GRPO: (r - mean) / std over the G samples of a prompt) or 'critic' (PPO: a value model and GAE). Default: the algorithm's.",
    )
    kl_in: Literal["loss", "reward"] | None = opt(
        None,
        "Where the KL penalty goes: 'loss' (GRPO: + beta * KL per token in the loss) or 'reward' (PPO: - beta * KL per token in the reward). Default: the algorithm's.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] | None = opt(
        None, "KL estimator: k3 (GRPO, unbiased and >= 0), k1 (PPO), k2. Default: the algorithm's."
    )
    beta: float = opt(0.04, "KL coefficient. 0 loads no reference model.")
    supervision: Literal["outcome", "process"] = opt(
        "outcome",
        "Outcome: one reward per completion, every token gets its advantage. Process (DeepSeekMath §4.1.3): rewards per reasoning step, normalised over the group; a token's advantage sums the normalised rewards of the steps ending at or after it.",
    )
    scale: Literal["group", "batch", "none"] = opt(
        "group", "GRPO advantage divisor: the group's std (paper), the batch's std, or none (Dr. GRPO)."
    )
    eps: float = opt(1e-4, "Added to the std in the GRPO advantage.")
    aggregation: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = opt(
        "seq-mean-token-mean",
        "How per-token losses are averaged: per sequence then over sequences (DeepSeekMath), over all tokens (DAPO), or summed over a constant max_new_tokens (Dr. GRPO).",
    )
    clip_low: float = opt(0.2, "Lower clip range epsilon: the ratio is clipped at 1 - clip_low.")
    clip_high: float = opt(0.2, "Upper clip range: 1 + clip_high (DAPO's clip-higher uses 0.28).")
    ratio_level: Literal["token", "sequence"] = opt(
        "token", "Importance ratio per token (PPO/GRPO) or per sequence (GSPO)."
    )
    dual_clip: float | None = opt(
        None, "Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (off by default)."
    )
    mask_truncated_completions: bool = opt(
        False,
        "Leave out of the loss the completions cut off at rollout.max_new_tokens (no EOS): their tokens get no gradient and no KL (DAPO's overlong filtering; TRL's mask_truncated_completions). They still count in their group's baseline and in the number of sequences.",
    )
    drop_zero_std_groups: bool = opt(
        False,
        "Leave out of the update the groups whose rewards are all equal (their advantages are all 0; DAPO's dynamic sampling without the refill).",
    )
    engine_correction: Literal["none", "token_tis", "sequence_mask"] | None = opt(
        None,
        "How the loss corrects for the sampler drawing from another distribution than the trainer's old policy (an engine's kernels or bf16; docs/sampling.md), where the rollout carries the sampler's log-probs (an engine's, or the fast loop's): token_tis (truncated importance sampling, Yao et al. 2025: each token's policy-gradient term, not the KL term, weighed by min(pi_old / pi_sampler, engine_correction_cap), detached), sequence_mask (a sequence whose ratio prod_t pi_old / pi_sampler lies outside [1/cap, cap] leaves the loss) or none. Default: token_tis where the sampler draws from the distribution the loss scores, none where it truncates (top_k, top_p, min_p or min_new_tokens: its log-probs are then of the truncated distribution, and the ratio would carry the kept probability mass, not a mismatch). The metrics rollout/mismatch_kl, rollout/mismatch_ratio_max and rollout/frac_corrected are logged either way.",
    )
    engine_correction_cap: float = opt(
        2.0,
        "C (> 1) of loss.engine_correction: token_tis caps each token's weight at C; sequence_mask keeps the sequences whose ratio is within [1/C, C].",
    )
    gamma: float = opt(1.0, "PPO: discount in GAE.")
    lam: float = opt(0.95, "PPO: GAE lambda.")
    whiten_advantages: bool = opt(True, "PPO: whiten the GAE advantages over the batch.")
    value_clip: float | None = opt(0.2, "PPO: clip range of the value loss (null = no clipping).")


@dataclass
class RewardModelUpdateConfig:
    verifier: str | None = opt(
        None,
        "Iterative RL (DeepSeekMath §4.1.4): a reward function (built-in or 'pkg.module:function') that labels the policy's fresh samples; between iterations the reward model keeps training on comparisons of its higher- over lower-scored samples. Unset: the reward model stays fixed.",
    )
    reward: int = opt(
        -1, "Which `rewards` entry is the reward model to train (its index; -1 = the first entry with a `model`)."
    )
    data: str | None = opt(
        None,
        "The reward model's earlier training comparisons (rows prompt, chosen, rejected), the first history that replay draws from.",
    )
    replay: float = opt(
        0.1, "Fraction of the historical comparisons replayed beside the new ones at each update (DeepSeekMath: 10%)."
    )
    prompts: int = opt(16, "Prompts sampled for new comparisons at each update.")
    samples_per_prompt: int = opt(4, "Completions sampled per prompt for new comparisons.")
    max_pairs_per_prompt: int = opt(4, "Most comparisons built from one prompt's samples.")
    lr: float = opt(1e-4, "Reward model learning rate.")
    epochs: int = opt(1, "Epochs over each update's comparisons.")
    batch_size: int = opt(16, "Comparisons per reward-model batch.")
    save: bool = opt(True, "Save the updated reward model to output_dir/reward_model after each update.")


@dataclass
class ValueConfig:
    model: str | None = opt(
        None, "PPO's value model: a causal LM whose backbone gets a scalar head. Default: the policy's `model`."
    )
    lr: float | None = opt(None, "Value model learning rate. Default: train.lr.")


@dataclass
class LoraConfig:
    r: int = opt(
        0,
        "LoRA rank (0 = full fine-tuning). With LoRA the reference is the same weights with the adapter off: no second copy.",
    )
    alpha: float = opt(16.0, "LoRA alpha.")
    target_modules: list[str] | str = opt("all-linear", "Modules to adapt (peft's target_modules).")


@dataclass
class Config:
    algorithm: Literal["grpo", "ppo"] = opt(
        "grpo",
        "The preset for loss.baseline, loss.kl_in and loss.kl_estimator: grpo (group, loss, k3) or ppo (critic, reward, k1).",
    )
    model: str = opt("", "The policy: a Hugging Face causal LM directory or hub id.")
    seed: int = opt(0, "Seed for sampling, shuffling and initialisation.")
    output_dir: str = opt("runs/train", "Where config.yaml, metrics.jsonl, samples.jsonl, checkpoints/ and final/ go.")
    data: DataConfig = opt(DataConfig(), "The prompts.")
    rewards: list[RewardConfig] = opt(
        [], "Reward functions (or models) and their weights; the reward is their weighted sum."
    )
    rollout: RolloutConfig = opt(RolloutConfig(), "Sampling.")
    train: TrainConfig = opt(TrainConfig(), "The optimisation loop.")
    loss: LossConfig = opt(LossConfig(), "The objective.")
    value: ValueConfig = opt(ValueConfig(), "PPO's value model.")
    reward_model_update: RewardModelUpdateConfig = opt(
        RewardModelUpdateConfig(), "Iterative RL: keep training the reward model between iterations."
    )
    lora: LoraConfig = opt(LoraConfig(), "Parameter-efficient fine-tuning.")


# The three places where the algorithms differ.
PRESETS: dict[str, dict[str, str]] = {
    "grpo": {"baseline": "group", "kl_in": "loss", "kl_estimator": "k3"},
    "ppo": {"baseline": "critic", "kl_in": "reward", "kl_estimator": "k1"},
}


# ---- reading --------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if tp is Callable:
        return "a function"
    if tp is type:
        return "a class"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the type hint `tp`; return it converted (int -> float, ...)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            try:
                return _convert(value, option, key)
            except UserError as err:
                errors.append((option, err))
        # A choice among names keeps its own message, with its did-you-mean hint.
        for option, err in errors:
            if typing.get_origin(option) is Literal and value is not None:
                raise UserError(f"{err} (or null)") from None
        raise UserError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in typing.get_args(tp)], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"{key}: expected one of {_type_name(tp)}, got {value!r}{hint}")
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(tp)
            return [_convert(v, item, f"{key}.{i}") for i, v in enumerate(value)]
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return _build(tp, value, key)
    elif origin is dict:  # free-form options (data.task_options): string keys, values as given
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML reads 1e-6 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise UserError(f"{key}: expected a finite number, got {value!r}")
            return number
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool or tp is str:
        if isinstance(value, tp):
            return value
    elif tp is Callable:  # a reward function given from Python
        if callable(value) and not isinstance(value, (str, type)):
            return value
    elif tp is type:  # a class given from Python (rollout.environment)
        if isinstance(value, type):
            return value
    raise UserError(f"{key}: expected {_type_name(tp)}, got {value!r}")


# TRL's GRPOConfig names -> ours (the key with the same meaning, never one spelt alike), or
# None with what to do instead. Looked up by the bare name, in whatever section it was put.
TRL_NAMES: dict[str, tuple[str | None, str]] = {
    "num_generations": ("rollout.group_size", "G, completions per prompt"),
    "per_device_train_batch_size": (
        "rollout.prompts_per_step",
        "prompts per step; TRL counts completions per device: per_device_train_batch_size x processes / num_generations",
    ),
    "generation_batch_size": ("rollout.generation_batch_size", "completions per decoding call"),
    "max_completion_length": ("rollout.max_new_tokens", "longest completion"),
    "max_prompt_length": ("rollout.max_prompt_length", "longest prompt, cut from the left"),
    "max_tool_calling_iterations": ("rollout.max_tool_calls", "model turns whose tool calls run, per rollout"),
    "environment_factory": ("rollout.environment", "the environment class, one instance per rollout"),
    "temperature": ("rollout.temperature", "sampling temperature"),
    "top_p": ("rollout.top_p", "nucleus sampling"),
    "top_k": ("rollout.top_k", "top-k sampling"),
    "min_p": ("rollout.min_p", "min-p sampling"),
    "repetition_penalty": ("rollout.repetition_penalty", "the repetition penalty, which the loss scores too"),
    "learning_rate": ("train.lr", "the policy's learning rate"),
    "num_iterations": (
        "train.epochs",
        "mu, update epochs per batch; our train.iterations resets the reference instead",
    ),
    "max_steps": ("train.steps", "RL steps"),
    "save_steps": ("train.checkpoint_every", "steps between checkpoints"),
    "logging_steps": ("train.log_every", "steps between log lines (when stderr is not a terminal)"),
    "report_to": ("train.report_to", "tensorboard, wandb and/or trackio, besides metrics.jsonl"),
    "run_name": ("train.run_name", "the run's name in wandb and trackio"),
    "project": ("train.project", "the wandb and trackio project"),
    "warmup_steps": ("train.warmup_steps", "learning-rate warm-up"),
    "lr_scheduler_type": ("train.schedule", "constant, linear or cosine"),
    "weight_decay": ("train.weight_decay", "AdamW weight decay"),
    "max_grad_norm": ("train.max_grad_norm", "gradient clipping"),
    "gradient_checkpointing": ("train.gradient_checkpointing", "activation checkpointing"),
    "gradient_accumulation_steps": (
        "train.micro_batch_size",
        "completions per forward/backward pass: a minibatch's completions / gradient_accumulation_steps",
    ),
    "bf16": ("train.autocast", "bfloat16 mixed precision: train.autocast: bfloat16"),
    "epsilon": ("loss.clip_low", "the clip range's lower epsilon (and loss.clip_high); loss.eps is the std's epsilon"),
    "epsilon_high": ("loss.clip_high", "DAPO's clip-higher"),
    "beta": ("loss.beta", "the KL coefficient"),
    "loss_type": (
        "loss.aggregation",
        "grpo/bnpo/dapo/dr_grpo are seq-mean-token-mean/token-mean/token-mean/seq-mean-token-sum-norm",
    ),
    "scale_rewards": ("loss.scale", "group, batch or none"),
    "mask_truncated_completions": ("loss.mask_truncated_completions", "leave cut-off completions out of the loss"),
    "model_name_or_path": ("model", "the policy"),
    "reward_funcs": ("rewards", "a list of {function: ..., weight: ...}"),
    "reward_weights": ("rewards", "each entry's weight"),
    "dataset_name": ("data.path", "a file, a saved datasets directory or a datasets name"),
    "vllm_importance_sampling_correction": (
        "loss.engine_correction",
        "false is none; true is the mode vllm_importance_sampling_mode names",
    ),
    "vllm_importance_sampling_mode": (
        "loss.engine_correction",
        "token_truncate is token_tis; sequence_mask is ours, except that TRL also weighs a kept sequence by its ratio; token_mask and sequence_truncate have no counterpart",
    ),
    "vllm_importance_sampling_clip_max": ("loss.engine_correction_cap", "C, the cap on the ratio"),
    "vllm_importance_sampling_clip_min": (
        "loss.engine_correction_cap",
        "token_tis has no lower bound; sequence_mask's is 1 / loss.engine_correction_cap",
    ),
    "vllm_importance_sampling_cap": ("loss.engine_correction_cap", "C, the cap on the ratio (TRL's older name)"),
    "use_vllm": ("rollout.sampler", "rollout.sampler: vllm samples with a vLLM engine"),
    "vllm_mode": ("rollout.vllm.server", "'' for colocate (the default), HOST:PORT of a `grpo vllm-serve` for server"),
    "vllm_gpu_memory_utilization": ("rollout.vllm.gpu_memory_utilization", "the colocated engine's share of the GPU"),
    "vllm_enable_sleep_mode": ("rollout.vllm.sleep", "the engine frees its memory during the update"),
    "vllm_server_host": ("rollout.vllm.server", "HOST:PORT in one key"),
    "vllm_server_port": ("rollout.vllm.server", "HOST:PORT in one key"),
    "vllm_tensor_parallel_size": (None, "no tensor parallelism: the colocated engine runs whole, one per process"),
}


REPORTERS = ("tensorboard", "wandb", "trackio")


def reporters(train: TrainConfig) -> list[str]:
    """train.report_to as a list of known names, in order and without repeats (one name, or
    several joined by commas as `--set train.report_to=wandb,trackio` gives them; "none", []
    and null for none), with tensorboard added by train.tensorboard: true."""
    given = train.report_to
    names = [] if given is None else given.split(",") if isinstance(given, str) else list(given)
    names = [name.strip() for name in names if name.strip() != "none"]
    for name in names:
        if name not in REPORTERS:
            close = difflib.get_close_matches(str(name), REPORTERS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UserError(
                f"train.report_to: unknown logger {name!r}{hint}; choose among {', '.join(REPORTERS)}, or none"
            )
    if train.tensorboard:
        names.append("tensorboard")
    return list(dict.fromkeys(names))


def _unknown_key(key: str, prefix: str, names: list[str]) -> str:
    full = f"{prefix}.{key}" if prefix else str(key)
    if str(key) in TRL_NAMES:
        ours, meaning = TRL_NAMES[str(key)]
        where = f"it is '{ours}' here ({meaning})" if ours else meaning
        return f"unknown config key '{full}': that is TRL's GRPOConfig name; {where}"
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
    return f"unknown config key '{full}'{hint}"


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {key_of(f): f.name for f in dataclasses.fields(cls)}  # config key -> Python name
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise UserError(_unknown_key(key, prefix, list(names)))
        kwargs[names[key]] = _convert(value, hints[names[key]], full)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node: Any = tree
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise UserError(f"--set {dotted}: '{'.'.join(parts[:i])}' has no item {part}")
            part = int(part)
        elif not isinstance(node, dict):
            raise UserError(f"--set {dotted}: '{'.'.join(parts[:i])}' is not a mapping")
        if last:
            node[part] = value
        else:
            if isinstance(node, dict) and not isinstance(node.get(part), (dict, list)):
                node[part] = {}
            node = node[part]


def parse_override(text: str) -> tuple[str, Any]:
    """'rollout.group_size=4' -> ('rollout.group_size', 4); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set expects key.sub=value, got {text!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise UserError(f"--set {key}: cannot read value {raw!r} ({str(err).splitlines()[0]})") from None
    return key.strip(), value


def config_from_dict(data: dict, overrides: list[str] = ()) -> Config:
    """Build and validate a Config from a mapping (as read from YAML) and `key=value` overrides."""
    if not isinstance(data, dict):
        raise UserError(f"the config must be a mapping of keys to values, got {type(data).__name__}")
    tree = copy.deepcopy(data)  # overrides must not write into the caller's mapping (functions are shared, not copied)
    if isinstance(tree.get("rewards"), list):  # rewards: [fn, ...] from Python, short for {function: fn}
        tree["rewards"] = [{"function": r} if callable(r) else r for r in tree["rewards"]]
    for text in overrides:
        _set_dotted(tree, *parse_override(text))
    config = _build(Config, tree)
    _resolve_presets(config)
    _resolve_engine_correction(config)
    validate(config)
    return config


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read a YAML config file, apply `key=value` overrides, validate."""
    return config_from_dict(read_config_file(path), overrides)


def read_config_file(path: str | Path) -> dict:
    """A YAML config file's mapping, not yet validated (one-line errors for a missing file,
    invalid YAML, or anything but a mapping)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{path}: invalid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: the config must be a mapping of keys to values, got a {type(data).__name__}")
    return data


def _resolve_presets(config: Config) -> None:
    for key, value in PRESETS[config.algorithm].items():
        if getattr(config.loss, key) is None:
            setattr(config.loss, key, value)


def truncates(rollout: RolloutConfig) -> bool:
    """Whether the sampler draws from a truncation of the distribution the loss scores (top_k,
    top_p, min_p, or min_new_tokens holding EOS back; docs/sampling.md)."""
    return rollout.top_k > 0 or rollout.top_p < 1 or rollout.min_p > 0 or rollout.min_new_tokens > 0


def _resolve_engine_correction(config: Config) -> None:
    """loss.engine_correction left unset: token_tis, unless the sampler truncates. A truncated
    distribution's log-probs exceed the loss's by the log of the mass kept at every token, so
    the ratio pi_old / pi_sampler is that mass (< 1) wherever the engine agrees: the weights
    would scale the gradient down by it, and a sequence's product would leave the bounds."""
    if config.loss.engine_correction is None:
        config.loss.engine_correction = "none" if truncates(config.rollout) else "token_tis"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def validate(c: Config) -> None:
    """Impossible values, each reported with its key. Runs before anything is loaded."""
    _require(bool(c.model), "model: required (a Hugging Face model directory or hub id)")
    _require(bool(c.data.path), "data.path: required (a prompt file or a datasets name)")
    _require(
        len(c.rewards) > 0 or c.rollout.environment is not None,
        "rewards: at least one reward is required, e.g. [{function: exact_answer}]",
    )
    for i, r in enumerate(c.rewards):
        _require((r.function is None) != (r.model is None), f"rewards.{i}: give exactly one of 'function' or 'model'")
        _require(
            not r.process or r.model is not None,
            f"rewards.{i}.process: only reward models have a process mode; a function returns its own steps",
        )
        _require(
            not r.process or c.loss.supervision == "process", f"rewards.{i}.process: needs loss.supervision: process"
        )
        _require(bool(r.step_separator), f"rewards.{i}.step_separator: must not be empty")
        _require(math.isfinite(r.weight), f"rewards.{i}.weight: must be a finite number")
        _require(
            r.timeout is None or r.timeout > 0, f"rewards.{i}.timeout: must be > 0 seconds or null, got {r.timeout}"
        )
        _require(
            r.function is not None or (r.timeout is None and not r.isolate),
            f"rewards.{i}: timeout and isolate apply to reward functions, not reward models",
        )
    ro, tr, lo = c.rollout, c.train, c.loss
    if lo.baseline == "group":
        _require(
            ro.group_size >= 2,
            f"rollout.group_size: the group baseline needs at least 2 completions per prompt, got {ro.group_size}",
        )
        _require(
            lo.kl_in == "loss",
            "loss.kl_in: the group baseline takes sequence rewards, so the KL goes in the loss ('loss')",
        )
    _require(ro.group_size >= 1, f"rollout.group_size: must be >= 1, got {ro.group_size}")
    _require(
        not lo.drop_zero_std_groups or ro.group_size >= 2,
        "loss.drop_zero_std_groups: needs rollout.group_size >= 2 (a group of one has no spread)",
    )
    _require(
        ro.max_tool_calls is None or ro.max_tool_calls >= 0,
        f"rollout.max_tool_calls: must be >= 0 or null, got {ro.max_tool_calls}",
    )
    _require(
        ro.tool_timeout is None or ro.tool_timeout > 0,
        f"rollout.tool_timeout: must be > 0 seconds or null, got {ro.tool_timeout}",
    )
    _require(
        not (ro.tools or ro.environment is not None) or lo.supervision == "outcome",
        "rollout.tools / rollout.environment: process supervision of multi-turn rollouts is not supported; use loss.supervision: outcome",
    )
    _require(ro.prompts_per_step >= 1, f"rollout.prompts_per_step: must be >= 1, got {ro.prompts_per_step}")
    _require(ro.max_new_tokens >= 1, f"rollout.max_new_tokens: must be >= 1, got {ro.max_new_tokens}")
    _require(
        0 <= ro.min_new_tokens <= ro.max_new_tokens,
        "rollout.min_new_tokens: must be between 0 and rollout.max_new_tokens",
    )
    _require(ro.temperature > 0, f"rollout.temperature: must be > 0, got {ro.temperature}")
    _require(0 < ro.top_p <= 1, f"rollout.top_p: must be in (0, 1], got {ro.top_p}")
    _require(ro.top_k >= 0, f"rollout.top_k: must be >= 0, got {ro.top_k}")
    _require(0 <= ro.min_p < 1, f"rollout.min_p: must be in [0, 1) (0 = off), got {ro.min_p}")
    _require(
        ro.repetition_penalty > 0, f"rollout.repetition_penalty: must be > 0 (1 = off), got {ro.repetition_penalty}"
    )
    v = ro.vllm
    _require(
        0 < v.gpu_memory_utilization <= 1,
        f"rollout.vllm.gpu_memory_utilization: must be in (0, 1], got {v.gpu_memory_utilization}",
    )
    _require(v.kv_cache_gb >= 1, f"rollout.vllm.kv_cache_gb: must be >= 1, got {v.kv_cache_gb}")
    _require(v.max_num_seqs >= 1, f"rollout.vllm.max_num_seqs: must be >= 1, got {v.max_num_seqs}")
    _require(
        v.check_tolerance is None or v.check_tolerance > 0,
        f"rollout.vllm.check_tolerance: must be > 0 or null, got {v.check_tolerance}",
    )
    refused = fast_only_refusal(ro, ro.sampler)  # auto: known once the model is (the Sampler says then)
    _require(refused is None, refused)
    if ro.sampler == "vllm":
        refused = unsupported(ro)  # an option vLLM cannot sample as the other decoders do
        _require(refused is None, refused)
    if v.server:
        split_address(v.server)  # HOST:PORT, or one line
        _require(ro.sampler == "vllm", "rollout.vllm.server: the server samples with rollout.sampler: vllm; set it")
        _require(
            v.transport == "file",
            f"rollout.vllm.transport: {v.transport} is not available in this version; use file (trainer and server on one machine)",
        )
    _require(v.timeout > 0, f"rollout.vllm.timeout: must be > 0, got {v.timeout}")
    _require(
        ro.generation_batch_size >= 0, f"rollout.generation_batch_size: must be >= 0, got {ro.generation_batch_size}"
    )
    _require(tr.steps >= 1, f"train.steps: must be >= 1, got {tr.steps}")
    _require(
        1 <= tr.iterations <= tr.steps, f"train.iterations: must be between 1 and train.steps, got {tr.iterations}"
    )
    _require(tr.lr > 0, f"train.lr: must be > 0, got {tr.lr}")
    _require(tr.epochs >= 1, f"train.epochs: must be >= 1, got {tr.epochs}")
    batch = ro.prompts_per_step * ro.group_size
    _require(
        1 <= tr.minibatches <= batch,
        f"train.minibatches: must be between 1 and the {batch} completions of a step, got {tr.minibatches}",
    )
    _require(tr.micro_batch_size >= 0, f"train.micro_batch_size: must be >= 0, got {tr.micro_batch_size}")
    _require(
        tr.old_logprobs != "sampler" or ro.sampler != "hf",
        "train.old_logprobs: sampler needs a sampler that returns log-probs (fast or vllm); transformers' generate (rollout.sampler: hf) gives none",
    )
    _require(
        len(tr.adam_betas) == 2 and all(0 <= b < 1 for b in tr.adam_betas), "train.adam_betas: two numbers in [0, 1)"
    )
    _validate_async(c)
    _require(tr.max_grad_norm >= 0, "train.max_grad_norm: must be >= 0")
    _require(tr.log_every >= 1, f"train.log_every: must be >= 1, got {tr.log_every}")
    reporters(tr)  # an unknown name is one line, before anything is loaded
    for name in ("warmup_steps", "checkpoint_every", "sample_every"):
        _require(getattr(tr, name) >= 0, f"train.{name}: must be >= 0")
    _require(tr.keep_checkpoints >= 1, "train.keep_checkpoints: must be >= 1")
    _require(tr.checkpoint_minutes >= 0, f"train.checkpoint_minutes: must be >= 0, got {tr.checkpoint_minutes}")
    _require(tr.max_unscored_steps >= 0, f"train.max_unscored_steps: must be >= 0, got {tr.max_unscored_steps}")
    _require(c.seed >= 0, f"seed: must be >= 0, got {c.seed}")
    _require(ro.max_prompt_length >= 0, f"rollout.max_prompt_length: must be >= 0, got {ro.max_prompt_length}")
    _require(
        re.fullmatch(r"auto|cpu|cuda(:\d+)?", tr.device) is not None,
        f"train.device: expected auto, cpu, cuda or cuda:N, got {tr.device!r}",
    )
    _require(lo.beta >= 0, f"loss.beta: must be >= 0, got {lo.beta}")
    _require(0 < lo.clip_low < 1, f"loss.clip_low: must be in (0, 1), got {lo.clip_low}")
    _require(lo.clip_high > 0, f"loss.clip_high: must be > 0, got {lo.clip_high}")
    _require(lo.dual_clip is None or lo.dual_clip > 1, f"loss.dual_clip: must be > 1, got {lo.dual_clip}")
    _require(lo.eps >= 0, "loss.eps: must be >= 0")
    _require(lo.engine_correction_cap > 1, f"loss.engine_correction_cap: must be > 1, got {lo.engine_correction_cap}")
    _require(0 <= lo.gamma <= 1, f"loss.gamma: must be in [0, 1], got {lo.gamma}")
    _require(0 <= lo.lam <= 1, f"loss.lam: must be in [0, 1], got {lo.lam}")
    _require(lo.value_clip is None or lo.value_clip > 0, "loss.value_clip: must be > 0 or null")
    _require(c.value.lr is None or c.value.lr > 0, "value.lr: must be > 0")
    _require(
        lo.supervision == "outcome" or lo.baseline == "group",
        "loss.supervision: process supervision needs the group baseline (loss.baseline: group)",
    )
    u = c.reward_model_update
    if u.verifier is not None:
        _require(
            not (ro.tools or ro.environment is not None),
            "reward_model_update: iterative RL samples single-turn completions for the reward model; with "
            "rollout.tools / rollout.environment it is not supported yet",
        )
        models = [i for i, r in enumerate(c.rewards) if r.model is not None]
        _require(
            bool(models),
            "reward_model_update.verifier: there is no reward model to update; add a rewards entry with a `model`",
        )
        _require(
            u.reward == -1 or u.reward in models,
            f"reward_model_update.reward: rewards.{u.reward} is not a reward model",
        )
        _require(
            tr.iterations >= 2,
            "reward_model_update.verifier: the reward model is updated between iterations; set train.iterations >= 2",
        )
    _require(0 <= u.replay < 1, f"reward_model_update.replay: must be in [0, 1), got {u.replay}")
    for name in ("prompts", "epochs", "batch_size", "max_pairs_per_prompt"):
        _require(getattr(u, name) >= 1, f"reward_model_update.{name}: must be >= 1")
    _require(
        u.samples_per_prompt >= 2,
        "reward_model_update.samples_per_prompt: comparisons need at least 2 samples per prompt",
    )
    _require(u.lr > 0, "reward_model_update.lr: must be > 0")
    _require(c.lora.r >= 0, "lora.r: must be >= 0")
    refusal = lora_refusal(c.rollout.sampler)
    _require(c.lora.r == 0 or refusal is None, refusal)


def lookahead(c: Config) -> int:
    """The steps the asynchronous generator samples ahead of the trainer: as many as keep every
    batch within rollout.async.max_staleness optimizer steps of the weights it trains, when a
    step takes train.epochs x train.minibatches of them and the generator's weights lag by up
    to push_every - 1 more. 0: the synchronous step."""
    a = c.rollout.async_
    if a.max_staleness == 0:
        return 0
    return (a.max_staleness - a.push_every + 1) // (c.train.epochs * c.train.minibatches)


def _validate_async(c: Config) -> None:
    """rollout.async: its numbers, and what the generator process cannot do yet."""
    a, ro, tr = c.rollout.async_, c.rollout, c.train
    _require(a.max_staleness >= 0, f"rollout.async.max_staleness: must be >= 0, got {a.max_staleness}")
    _require(a.push_every >= 1, f"rollout.async.push_every: must be >= 1, got {a.push_every}")
    _require(a.threads >= 1, f"rollout.async.threads: must be >= 1, got {a.threads}")
    _require(a.timeout > 0, f"rollout.async.timeout: must be > 0 seconds, got {a.timeout}")
    if a.max_staleness == 0:
        return
    updates = tr.epochs * tr.minibatches
    lag = f" and rollout.async.push_every adds {a.push_every - 1}" if a.push_every > 1 else ""
    _require(
        lookahead(c) >= 1,
        f"rollout.async.max_staleness: {a.max_staleness} leaves the generator no step ahead: a step takes "
        f"train.epochs x train.minibatches = {updates} optimizer steps{lag}; set it to at least {updates + a.push_every - 1}",
    )
    _require(
        ro.sampler != "hf",
        "rollout.async: rollout.sampler: hf (transformers' generate) returns no log-probs, which a stale batch's "
        "ratio needs; use fast, auto or vllm",
    )
    _require(
        tr.old_logprobs != "recompute" or c.loss.engine_correction != "none",
        "train.old_logprobs: recompute with rollout.async anchors the ratio at the current weights, and only "
        "loss.engine_correction (token_tis or sequence_mask) then corrects for the weights that sampled; set one, or use auto",
    )
    _require(
        not (ro.tools or ro.environment is not None),
        "rollout.async: multi-turn rollouts (rollout.tools / rollout.environment) are not supported yet",
    )
    _require(c.lora.r == 0, "rollout.async: LoRA (lora.r > 0) is not supported yet")
    # The generator owns the server's weights; iterative RL's sampler, in the trainer, would
    # push its own between iterations, and the server would then refuse the generator's requests.
    _require(
        not (ro.vllm.server and c.reward_model_update.verifier is not None),
        "rollout.async with rollout.vllm.server: iterative RL (reward_model_update.verifier) would push the "
        "trainer's weights into the generator's server between iterations; not supported yet",
    )


# ---- writing and documenting ----------------------------------------------------------------


def config_to_dict(config: Config) -> dict:
    """The config as plain data (what config.yaml and a checkpoint hold): a reward function
    given from Python is written as its 'module:qualname'."""
    from grpo.infra.imports import spec_of

    data = as_tree(config)
    for reward in data["rewards"]:
        if callable(reward["function"]):
            reward["function"] = spec_of(reward["function"])
    rollout = data["rollout"]
    rollout["tools"] = [spec_of(t) if callable(t) else t for t in rollout["tools"]]
    if callable(rollout["environment"]):
        rollout["environment"] = spec_of(rollout["environment"])
    return data


def describe_fields(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every leaf field: the reference printed by --help."""
    rows = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        key = f"{prefix}{key_of(f)}"
        if dataclasses.is_dataclass(hint):
            rows.extend(describe_fields(hint, key + "."))
            continue
        default = field_default(f)
        if (
            typing.get_origin(hint) is list
            and typing.get_args(hint)
            and dataclasses.is_dataclass(typing.get_args(hint)[0])
        ):
            rows.append((key, "[]", f.metadata.get("doc", "")))
            rows.extend(describe_fields(typing.get_args(hint)[0], key + "[]."))
            continue
        shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        rows.append((key, shown, f.metadata.get("doc", "")))
    return rows
