"""The run's configuration, as typed dataclasses: every field with its default and its
documentation (`grpo train --help` prints them).

The algorithm is a preset for exactly the three places where GRPO and PPO differ
(DeepSeekMath §4.1): where the baseline comes from (`loss.baseline`), where the KL goes
(`loss.kl_in`) and which estimator measures it (`loss.kl_estimator`). Keys left unset take
the preset's value (`PRESETS`); keys set explicitly win.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Literal

from grpo.config.fields import opt
from grpo.rollout.decoders import NAMES as DECODERS


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
