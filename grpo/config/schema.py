"""The run's configuration, as typed dataclasses: every field with its default and one or two
sentences of documentation (`grpo train --help` prints them), and where more is needed the
docs/ page that explains.

The algorithm is a preset for exactly the three places where GRPO and PPO differ
(DeepSeekMath §4.1): where the baseline comes from (`loss.baseline`), where the KL goes
(`loss.kl_in`) and which estimator measures it (`loss.kl_estimator`). Keys left unset take
the preset's value (`PRESETS`); keys set explicitly win.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Literal

from grpo.config.fields import Frozen, opt

# rollout.sampler's values: auto, and the names of the decoder registry
# (`grpo.rollout.decoders.NAMES`, which a test holds equal), written here so that the config
# imports no decoder.
SAMPLERS = ("auto", "fast", "hf", "vllm")


@dataclass
class DataConfig(Frozen):
    path: str = opt(
        "",
        "Prompt data: a .jsonl/.json/.parquet/.csv file, a saved `datasets` directory or name, 'reasoning_gym:NAME?size=N&seed=S' (docs/reasoning-gym.md), or 'verifiers:ID', a verifiers taskset's tasks (docs/tools.md#verifiers-tasksets).",
    )
    prompt_column: str = opt(
        "prompt",
        "Column holding the prompt: a string, or a list of chat messages (then the tokenizer's chat template is applied).",
    )
    config: str | None = opt(
        None,
        "The dataset's configuration (load_dataset's second argument, e.g. main for openai/gsm8k); an unknown one is answered with the dataset's list.",
    )
    split: str = opt("train", "Split to use when `path` is a `datasets` name or a saved DatasetDict.")
    system_prompt: str = opt(
        "",
        "A system message put before every prompt; a plain-string prompt then becomes a chat (user message) rendered by the model's chat template.",
    )
    shuffle: bool = opt(True, "Shuffle the prompts by `seed`, reshuffling at each pass over the data.")
    task_options: dict[str, Any] = opt(
        {},
        "With a reasoning_gym:NAME data.path: the task's own options (the fields of its config, e.g. {min_digits: 2}); with a verifiers:ID one, the fields of the taskset's config (docs/tools.md#verifiers-tasksets).",
    )


@dataclass
class RewardConfig(Frozen):
    function: str | Callable | None = opt(
        None,
        "A built-in reward (exact_answer, math_answer, r1_format, reasoning_gym, arithmetic_*) or 'pkg.module:function', called by keyword as TRL's GRPOTrainer calls it and returning a float or None per completion (docs/training.md#rewards).",
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
        "Functions: seconds one call may take (null = no limit); a call past it fails the step, or scores None with on_timeout: none (docs/safety.md).",
    )
    on_timeout: Literal["fail", "none"] = opt(
        "fail",
        "Functions: what a call past `timeout` does: fail the run (a checkpoint of the last completed step is kept), or score the whole batch None for this function.",
    )
    isolate: bool = opt(
        False,
        "Functions: run the function in a worker process, killed when a call passes `timeout` (for untrusted or runaway code); a round trip per call (docs/safety.md).",
    )


@dataclass
class VllmConfig(Frozen):
    server: str = opt(
        "",
        "'' (default): the engine runs in the training process (colocated). HOST:PORT: a `grpo vllm-serve` server holding the same model, its weights pushed after every update (docs/vllm-server.md).",
    )
    transport: Literal["file", "nccl"] = opt(
        "file",
        "Server mode: how the weights reach the server. file: a safetensors file in /dev/shm that the server reads, trainer and server on one machine (docs/vllm-server.md).",
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
        "CUDA: the engine frees its KV cache and weights while the update runs (the first cure for a colocated out-of-memory), waking for each step; nothing on a CPU (docs/vllm.md).",
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
        "After each weight sync, check that the engine holds the policy's weights (its log-probs of one fixed sequence against the trainer's); a stale engine stops the run in one line (docs/vllm.md).",
    )
    check_tolerance: float | None = opt(
        None,
        "The check's limit on the mean |log-prob difference| per token; null: 1e-3 for a float32 engine, 5e-2 for 16 bits (a stale engine is off by far more).",
    )


@dataclass
class AsyncConfig(Frozen):
    max_staleness: int = opt(
        0,
        "K: how many optimizer steps the weights that sampled a batch may lag the weights it trains. 0: the synchronous step; K >= 1: a generator process samples the next batches while this one trains (docs/async.md).",
    )
    push_every: int = opt(
        1,
        "With max_staleness >= 1: send the trained weights to the generator after every N optimizer steps (fewer copies; batches up to N - 1 steps staler).",
    )
    threads: int = opt(1, "With max_staleness >= 1: the generator process's torch threads.")
    timeout: float = opt(
        600.0,
        "With max_staleness >= 1: the seconds the trainer waits for one batch before the run stops in one line (a hung generator); docs/async.md#faults.",
    )


@dataclass
class RolloutConfig(Frozen):
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
        "Min-p sampling: drop the tokens less likely than min_p times the most likely one (0 = off; in [0, 1)). A truncation the loss does not score (docs/sampling.md).",
    )
    repetition_penalty: float = opt(
        1.0,
        "Repetition penalty, as transformers' generate applies it (1 = off; > 1 penalises the tokens already in the sequence). The loss scores the same penalised distribution (docs/sampling.md).",
    )
    chat_template_kwargs: dict[str, Any] = opt(
        {},
        "Extra arguments of the chat template when it renders a chat prompt (TRL's chat_template_kwargs), e.g. {enable_thinking: false} for Qwen3.",
    )
    draw: Literal["auto", "generate", "fast"] = opt(
        "auto",
        "How tokens are drawn: auto (the fast loop's fast draw; other samplers their own), generate (generate's tokens bit for bit; not with vllm) or fast (the same distribution, drawn more cheaply; the fast loop only). docs/sampling.md.",
    )
    max_prompt_length: int = opt(
        0,
        "Longest prompt, in tokens (0 = no limit): a longer prompt keeps its last max_prompt_length tokens, as TRL cuts it (docs/training.md#the-model-and-the-data).",
    )
    generation_batch_size: int = opt(
        0,
        "Completions generated per call (0 = the whole step at once). Smaller bounds generation memory (the KV cache); results are the same up to sampling order.",
    )
    seed_per_prompt: bool = opt(
        False,
        "Draw each prompt's G completions from a seed of its own (the run's seed, the step, the prompt's index), so that the samples do not depend on the number of processes; slower sampling (docs/scale-out.md).",
    )
    sampler: Literal[SAMPLERS] = opt(
        "auto",
        "Decoding loop: fast (our KV-cache loop for Llama-family models), hf (transformers' generate, any model), vllm (a vLLM engine, docs/vllm.md), or auto (fast where it can, else hf). docs/speed.md.",
    )
    vllm: VllmConfig = opt(VllmConfig(), "The vLLM engine, with sampler: vllm.")
    tools: list[str | Callable] = opt(
        [],
        "Tools the model may call while it generates (TRL's tools=): 'pkg.module:function' specs or functions with type hints and a docstring. Needs chat prompts and a template in a rollout.tool_format; tool tokens stay out of the loss (docs/tools.md).",
    )
    environment: str | type | Callable | dict[str, str | type | Callable] | None = opt(
        None,
        "An environment class (TRL's environment_factory=) or 'pkg.module:Class', one instance per rollout; a mapping of names to classes (each row's 'environment' field picks one); or an OpenEnv environment, client factory or server URL (docs/tools.md).",
    )
    environment_action: str | type | None = opt(
        None,
        "With an OpenEnv rollout.environment: its Action class, 'pkg.module:Class', whose fields (but metadata) are the tool's parameters; null: read from the environment class or the server's /schema (docs/tools.md#openenv).",
    )
    environment_reward: Literal["last", "sum"] = opt(
        "last",
        "With an OpenEnv rollout.environment: an episode's reward, the last observation's reward (as TRL's OpenEnv examples keep it) or the sum of its observations' rewards (docs/tools.md#openenv).",
    )
    max_tool_calls: int | None = opt(
        None,
        "With tools: the most model turns whose tool calls run in one rollout (TRL's max_tool_calling_iterations); null: no limit but max_new_tokens (docs/tools.md).",
    )
    async_: AsyncConfig = opt(
        AsyncConfig(),
        "Asynchronous rollouts: sample the next batches in a worker process while this one trains (docs/async.md).",
        key="async",  # a Python keyword: the field is async_, the config key async
    )
    agent: str | Callable | None = opt(
        None,
        "An agent program agent(base_url, row, *, model) -> reward ('pkg.module:function'): each rollout is one call, driving the policy through an OpenAI-compatible endpoint (docs/tools.md#agent-programs-the-openai-compatible-endpoint).",
    )
    tool_timeout: float | None = opt(
        30.0,
        "With tools: seconds one tool call may take (null = no limit); a call past it, or one that raises or exits, becomes an error message to the model and the run goes on (docs/tools.md).",
    )
    tool_isolate: bool = opt(
        False,
        "With tools: run each of rollout.tools in a worker process of its own, so that a call past tool_timeout is killed and a crash is an error message; a round trip per call (docs/tools.md).",
    )
    tool_format: Literal["auto", "hermes", "qwen3", "llama3"] = opt(
        "auto",
        "With tools: how the model writes calls, hermes (<tool_call> JSON: Qwen2.5), qwen3 (Qwen3's template made prefix-preserving) or llama3 (Llama 3.1/3.2 JSON); auto reads the chat template (docs/tools.md#tool-call-formats).",
    )


@dataclass
class TrainConfig(Frozen):
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
    micro_batch_tokens: int = opt(
        0,
        "The update's passes filled up to this many real tokens (prompt and completion) instead of a number of completions (verl's dynamic batch size); the same gradient. 0: off, micro_batch_size decides.",
    )
    old_logprobs: Literal["auto", "recompute", "sampler"] = opt(
        "auto",
        "Where the old policy's log-probs (the ratio's anchor) come from: recompute (a no-grad pass), sampler (the fast loop's or vLLM's), or auto (the sampler's where they equal the pass's). docs/sampling.md#the-old-policys-log-probs-from-the-sampler.",
    )
    length_grouping: bool = opt(
        True,
        "Order a minibatch's completions by length before splitting it into micro-batches, so that each pass is cut shorter; the same gradient either way (docs/speed.md).",
    )
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    adam_betas: list[float] = opt([0.9, 0.999], "AdamW betas.")
    optimizer: Literal["adamw", "adamw_8bit"] = opt(
        "adamw",
        "adamw: torch's AdamW, its moments in fp32; adamw_8bit: bitsandbytes' 8-bit AdamW, its moments in a quarter of the memory and its update approximate (docs/memory.md#the-optimizer).",
    )
    optimizer_in_backward: bool = opt(
        False,
        "Step each weight inside the backward pass, as soon as its gradient is complete, and free that gradient: the full set of gradients is never held. Needs train.max_grad_norm: 0 and one pass per minibatch (docs/memory.md#the-step-in-the-backward).",
    )
    warmup_steps: int = opt(0, "Linear learning-rate warm-up, in optimizer steps.")
    schedule: Literal["constant", "linear", "cosine"] = opt("constant", "Learning-rate schedule after warm-up.")
    max_grad_norm: float = opt(1.0, "Clip the gradient norm to this (0 = no clipping).")
    checkpoint_every: int = opt(0, "Also save a resumable checkpoint every N steps (0 = by time only).")
    checkpoint_minutes: float = opt(
        10.0,
        "Save a resumable checkpoint when this many minutes have passed since the last (0 = by steps only); a run also saves at its end and when it stops (docs/resume.md).",
    )
    keep_checkpoints: int = opt(2, "How many of the newest checkpoints to keep.")
    max_unscored_steps: int = opt(
        5,
        "Stop the run (with a checkpoint) after this many steps in a row where no reward scored any completion (0 = never); each such step warns.",
    )
    log_every: int = opt(
        10,
        "When stderr is not a terminal, print one plain line every N steps instead of a progress bar (docs/monitoring.md).",
    )
    sample_every: int = opt(
        10,
        "Every N steps, write a sample of completions with their rewards to samples.jsonl and, as a table, to each dashboard of report_to (0 = never).",
    )
    push_to_hub: str | bool = opt(
        "",
        "A Hub repository id (user/name) to push the card and weights to when the run ends (TRL's hub_model_id); true: one named after output_dir, as in TRL; empty or false: no push (docs/training.md#the-model-card-and-the-hub).",
    )
    hub_private: bool = opt(False, "With push_to_hub: create the repository private (TRL's hub_private_repo).")
    hub_strategy: Literal["end", "every_save"] = opt(
        "end",
        "With push_to_hub: push at the end only, or also after every checkpoint (TRL's hub_strategy names).",
    )
    keep_best: str | None = opt(
        None,
        "With an eval section: keep the checkpoint with the best value of this metric (e.g. eval/pass@1) as output_dir/best/, kept across --resume (docs/evaluation.md).",
    )
    report_to: list[str] | str | None = opt(
        [],
        "Where the metrics go besides metrics.jsonl, from process 0 (TRL's report_to): tensorboard, wandb and/or trackio, a list or joined by commas; none or [] for none (docs/monitoring.md).",
    )
    tensorboard: bool = opt(False, "true: the same as adding tensorboard to report_to (the older spelling).")
    run_name: str = opt("", "The run's name in wandb and trackio (TRL's run_name); empty: output_dir's folder name.")
    project: str = opt(
        "",
        "The wandb and trackio project the run is filed under (TRL's project); empty: $WANDB_PROJECT for wandb if set, else 'grpo'.",
    )
    device: str = opt(
        "auto",
        "Where the models and batches live: auto (a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N; under torchrun each process takes the GPU of its LOCAL_RANK (docs/scale-out.md).",
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
        "Attention kernel of the policy, reference and critic (transformers' attn_implementation). auto: eager on a CPU up to 512 new tokens, else the model's default (docs/speed.md).",
    )
    gradient_checkpointing: bool = opt(
        True,
        "Activation checkpointing for the policy's update (TRL's default): much less activation memory for one more forward pass; false for faster steps where memory allows (docs/speed.md).",
    )
    chunked_head: bool = opt(
        True,
        "Run the LM head over a chunk of positions at a time, so that no (completions x tokens x vocabulary) logits are held; the same numbers as false (docs/speed.md).",
    )
    layout: Literal["auto", "packed", "shared", "padded"] = opt(
        "auto",
        "How a pass lays out its rows: packed (real tokens only, a group's prompt once), shared (a group's prompt in a pass of its own), padded (every row in full); auto: the first that gives the model's own log-probs (docs/speed.md#layouts).",
    )
    autocast: Literal["auto", "off", "bfloat16"] = opt(
        "auto",
        "Mixed precision: bfloat16 runs sampling and the forward passes in bf16, keeping weights, gradients and optimizer state in `dtype`; auto is bfloat16 on a GPU, off on a CPU (docs/speed.md).",
    )
    return_freed_memory: bool = opt(
        False,
        "On Linux (glibc), give each freed tensor's memory back to the system at once instead of keeping it in the allocator's heap, where it fragments and the resident memory grows step after step: a lower peak, a slower step (docs/memory.md#freed-memory).",
    )
    reference_dtype: Literal["auto", "bfloat16"] = opt(
        "auto",
        "The reference's frozen copy: auto computes as the policy does, the same numbers; bfloat16 stores its weights in bf16, half its memory, and computes in bf16 where the device has bf16 instructions (docs/memory.md#the-reference).",
    )


@dataclass
class LossConfig(Frozen):
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
        "outcome: one reward per completion, every token gets its advantage; process (DeepSeekMath §4.1.3): rewards per reasoning step (docs/reward-models.md).",
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
        "Leave the completions cut off at rollout.max_new_tokens out of the loss (DAPO's overlong filtering, TRL's mask_truncated_completions); they still count in their group's baseline (docs/training.md#variants-of-the-loss).",
    )
    drop_zero_std_groups: bool = opt(
        False,
        "Leave out of the update the groups whose rewards are all equal (their advantages are all 0; DAPO's dynamic sampling without the refill).",
    )
    engine_correction: Literal["none", "token_tis", "sequence_mask"] | None = opt(
        None,
        "How the loss corrects for a sampler that draws from another distribution than the trainer's old policy: token_tis, sequence_mask or none. Default: token_tis, none where the sampling truncates (docs/sampling.md#when-the-sampler-is-not-the-trainer).",
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
class RewardModelUpdateConfig(Frozen):
    verifier: str | None = opt(
        None,
        "Iterative RL (DeepSeekMath §4.1.4): a reward function that labels the policy's fresh samples, on whose comparisons the reward model trains between iterations; unset: it stays fixed (docs/reward-models.md).",
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
class ValueConfig(Frozen):
    model: str | None = opt(
        None, "PPO's value model: a causal LM whose backbone gets a scalar head. Default: the policy's `model`."
    )
    lr: float | None = opt(None, "Value model learning rate. Default: train.lr.")


@dataclass
class LoraConfig(Frozen):
    r: int = opt(
        0,
        "LoRA rank (0 = full fine-tuning). With LoRA the reference is the same weights with the adapter off: no second copy.",
    )
    alpha: float = opt(16.0, "LoRA alpha.")
    target_modules: list[str] | str = opt("all-linear", "Modules to adapt (peft's target_modules).")
    save: Literal["merged", "adapter", "both"] = opt(
        "merged",
        "What final/ and best/ hold: the adapter merged into the base (a plain model), the adapter alone (peft's files, which vLLM serves as a LoRA), or both (the adapter in adapter/).",
    )
    init_adapter: str = opt(
        "", "Start from this peft adapter folder (e.g. `grpo sft --lora`'s output) instead of a new adapter."
    )
    quantize: Literal["none", "nf4", "fp4"] = opt(
        "none",
        "QLoRA: load the base in 4 bits through bitsandbytes; only the adapter trains, and samplers get the adapter, never a merge into 4 bits (docs/memory.md).",
    )


@dataclass
class InLoopEvalConfig(Frozen):
    data: str = opt(
        "",
        "Held-out problems evaluated during training, as `grpo eval --data` takes them: a file, a saved dataset folder, a hub id, or 'TASK:N'. Empty: no evaluation in the loop.",
    )
    config: str | None = opt(None, "The held-out dataset's configuration (as data.config).")
    split: str = opt("test", "The held-out dataset's split.")
    prompt_column: str | None = opt(None, "The held-out data's prompt column. Default: data.prompt_column.")
    task: str | None = opt(
        None,
        "The task that checks answers (as `grpo eval --task`). Default: the task of a 'TASK:N' data, else the reward functions (verifier).",
    )
    verifier: str | None = opt(
        None,
        "A reward function that checks answers instead of a task, correct at score >= threshold. Default: the run's first function reward.",
    )
    threshold: float | None = opt(
        None, "A completion is correct when its score >= this. Default: the task's; else 0.5."
    )
    answer_pattern: str | None = opt(
        None, "Read the final answer (maj@k's votes) with this regular expression (as `grpo eval --answer-pattern`)."
    )
    prompts: int = opt(0, "Evaluate the first N held-out problems (0 = all of them).")
    every: int = opt(
        10, "Evaluate at step 0, every N steps and at the last step (0 = at step 0 and the last step only)."
    )
    n: int = opt(8, "Samples per problem.")
    k: list[int] = opt([], "The k of pass@k and maj@k, each <= n. Default: the powers of 2 up to n.")
    temperature: float = opt(0.7, "Sampling temperature of the evaluation (> 0).")
    top_p: float = opt(1.0, "Nucleus sampling of the evaluation (1 = off).")
    max_new_tokens: int = opt(0, "Longest completion in the evaluation (0 = rollout.max_new_tokens).")
    batch_size: int = opt(256, "Completions per generate call in the evaluation.")
    seed: int = opt(0, "Seeds the evaluation's sampling: every evaluation draws alike, so that they compare.")
    alarm_window: int = opt(
        3,
        "The reward-hacking alarm: how many evaluations back the training reward's trend and the held-out metric are compared (docs/evaluation.md).",
    )
    stop_when_diverging: bool = opt(
        False,
        "Stop the run (with a checkpoint) when the reward-hacking alarm rises: the training reward climbs while the held-out metric falls; train.keep_best's best/ stays.",
    )


@dataclass
class Config(Frozen):
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
    eval: InLoopEvalConfig = opt(InLoopEvalConfig(), "Held-out evaluation during training (docs/evaluation.md).")


# The three places where the algorithms differ.
PRESETS: dict[str, dict[str, str]] = {
    "grpo": {"baseline": "group", "kl_in": "loss", "kl_estimator": "k3"},
    "ppo": {"baseline": "critic", "kl_in": "reward", "kl_estimator": "k1"},
}
