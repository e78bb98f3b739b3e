"""GRPO step throughput and memory: `grpo train` against TRL's GRPOTrainer, same work.

    .venv/bin/python benchmarks/bench_grpo_step.py [--workload tiny|small|both] [--steps 6] [--skip-trl]
        [--precision fp32|bf16|both] [--sampler auto|fast|hf] [--threads N] [--gradient-checkpointing]
        [--keep] [--results DIR]

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
- ours: `python -m grpo.cli train` with G = 8, 4 prompts per step, 64 new tokens exactly
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
recompute each layer's activations in the backward pass.

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

REWARD_MODULE = '''"""The benchmark's rule reward: the fraction of '7's in the completion (learnable, cheap)."""


def sevens(prompts, completions, **columns):
    return [c.count("7") / max(len(c), 1) for c in completions]
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


# ---- the workload ------------------------------------------------------------------------------


def build_workload(root: Path, name: str) -> dict:
    """Model, prompts and reward module for one workload, written under `root`."""
    from transformers import AutoModelForCausalLM

    from grpo.tasks.tiny import save_tiny_model

    shape = WORKLOADS[name]
    model_dir = save_tiny_model(root / f"model-{name}", ALPHABET, **shape)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    vocab = model.config.vocab_size
    del model

    prompts = root / "prompts.jsonl"
    if not prompts.exists():
        rng = random.Random(0)
        with open(prompts, "w", encoding="utf-8") as f:
            for _ in range(NUM_PROMPTS):
                f.write(json.dumps({"prompt": "".join(rng.choice(ALPHABET) for _ in range(PROMPT_LENGTH))}) + "\n")
    reward_dir = root / "reward"
    reward_dir.mkdir(exist_ok=True)
    (reward_dir / "bench_reward.py").write_text(REWARD_MODULE)

    return {
        "name": name,
        "model_dir": str(model_dir),
        "prompts": str(prompts),
        "reward_dir": str(reward_dir),
        "reward": "bench_reward:sevens",
        **shape,
        "vocab_size": vocab,
        "parameters": total,
        "embedding_parameters": embedding,
        "head_parameters": head,
        "body_parameters": total - embedding - head,
    }


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
    return {"generation": generation, "reference": reference, "update": update, "total": generation + reference + update}


# ---- the two runs ------------------------------------------------------------------------------


def child_env(w: dict) -> dict:
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([w["reward_dir"], str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["HF_HUB_OFFLINE"] = "1"  # everything is local: never reach for the hub
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_ours(w: dict, root: Path, steps: int, precision: str = "fp32", sampler: str = "auto", checkpointing: bool = False) -> dict:
    s = SETTINGS
    out = root / f"ours-{w['name']}-{precision}"
    config = {
        "algorithm": "grpo",
        "model": w["model_dir"],
        "seed": s["seed"],
        "output_dir": str(out),
        "data": {"path": w["prompts"], "prompt_column": "prompt"},
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
    config_path = root / f"ours-{w['name']}-{precision}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [sys.executable, "-m", "grpo.cli", "train", str(config_path), "--quiet"]
    load = _load()
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=child_env(w), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"grpo train failed (exit {done.returncode}): {_tail(done.stderr)}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"tool": "grpo", "steps": metrics, "process_wall_s": wall, "load_average": [load, _load()]}


def trl_spec(w: dict, root: Path, steps: int, gradient_checkpointing: bool = False, precision: str = "fp32") -> dict:
    s = SETTINGS
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


def run_trl(w: dict, root: Path, steps: int, gradient_checkpointing: bool = False, precision: str = "fp32") -> dict:
    spec_path = root / f"trl-{w['name']}-{precision}.json"
    result_path = root / f"trl-{w['name']}-{precision}-result.json"
    spec_path.write_text(json.dumps(trl_spec(w, root, steps, gradient_checkpointing, precision), indent=1))
    command = [sys.executable, str(HERE / "_trl_child.py"), str(spec_path), str(result_path)]
    load = _load()
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=child_env(w), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"TRL run failed (exit {done.returncode}): {_tail(done.stderr)}")
    result = json.loads(result_path.read_text())
    return {"tool": "trl", **result, "process_wall_s": wall, "load_average": [load, _load()]}


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
        capture_output=True, text=True, cwd=ROOT,
    )
    if probe.returncode != 0:
        return "TRL does not import: " + _tail(probe.stderr, 1) + ' (install it with: pip install "trl>=1.0")'
    return None


# ---- the numbers -------------------------------------------------------------------------------


def summarize(run: dict, flops: dict) -> dict:
    """Median step time and tokens/s over steps 2..N, the peak RSS, achieved GFLOP/s."""
    steps = run["steps"]
    timed = steps[1:] if len(steps) > 1 else steps
    step_s = statistics.median(m["time/step"] for m in timed)
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
        summary["reward_first_last"] = [steps[0]["reward/mean"], steps[-1]["reward/mean"]]
    else:  # TRL: everything in the step that is not model.generate
        summary["median_rest_s"] = statistics.median(m["time/step"] - m["time/generate"] for m in timed)
        rewards = [l["reward"] for l in run.get("logs", []) if "reward" in l]
        summary["reward_first_last"] = [rewards[0], rewards[-1]] if rewards else None
    return summary


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(
    w: dict, ours: dict, trl: dict | None, trl_note: str | None, peak: float, trl_version: str | None,
    precision: str = "fp32", bf16_peak: float | None = None,
) -> str:
    trl_name = f"TRL {trl_version}" if trl_version else "TRL"
    lines = [
        f"## {w['name']}: Llama, hidden {w['hidden_size']}, {w['layers']} layers, {w['heads']} heads, "
        f"MLP {w['intermediate_size']}, vocab {w['vocab_size']}: {w['parameters']:,} parameters "
        f"({w['body_parameters'] + w['head_parameters']:,} without the embedding)",
        f"{SETTINGS['prompts_per_step']} prompts x G={SETTINGS['group_size']} x {SETTINGS['max_new_tokens']} tokens per step, "
        f"{'fp32' if precision == 'fp32' else 'bf16 autocast (fp32 weights)'}, {ours['steps']} steps (medians over steps 2..{ours['steps']})",
        "",
        f"| | ours (grpo) | {trl_name} | ours/TRL |",
        "|---|---|---|---|",
    ]

    def row(label, key, spec, ratio=True):
        a = ours.get(key)
        b = trl.get(key) if trl else None
        r = a / b if (ratio and a is not None and b) else None
        lines.append(f"| {label} | {_fmt(a, spec)} | {_fmt(b, spec)} | {_fmt(r, '.2f') if ratio else ''} |")

    row("median step time (s)", "median_step_s", ".3f")
    row("completion tokens/s", "completion_tokens_per_s", ",.0f")
    row("peak RSS (MB)", "peak_rss_mb", ",.0f")
    row("time in generate (s, median)", "median_generate_s", ".3f")
    row("achieved GFLOP/s (model FLOPs)", "achieved_gflops", ".2f")
    frac_a = ours["achieved_gflops"] / peak
    frac_b = trl["achieved_gflops"] / peak if trl else None
    lines.append(f"| fraction of fp32 matmul peak ({peak:.0f} GFLOP/s) | {frac_a:.2%} | {_fmt(frac_b, '.2%')} | |")
    if precision == "bf16" and bf16_peak:
        lines.append(
            f"| fraction of bf16 matmul peak ({bf16_peak:.0f} GFLOP/s) | {ours['achieved_gflops'] / bf16_peak:.2%} | "
            f"{_fmt(trl['achieved_gflops'] / bf16_peak if trl else None, '.2%')} | |"
        )
    lines.append("")
    lines.append(
        f"ours by phase (median s): generate {ours['median_generate_s']:.3f} "
        f"({ours['generate_gflops']:.2f} GFLOP/s), score {ours['median_score_s']:.4f}, "
        f"reference + update {ours['median_update_s']:.3f} ({ours['update_gflops']:.2f} GFLOP/s); "
        f"share of the step in generate: {ours['median_generate_s'] / ours['median_step_s']:.0%}"
    )
    if trl:
        lines.append(
            f"TRL by phase (median s): model.generate {trl['median_generate_s']:.3f}, "
            f"everything else {trl['median_rest_s']:.3f}; share in generate: "
            f"{trl['median_generate_s'] / trl['median_step_s']:.0%}"
        )
        step_ratio = ours["median_step_s"] / trl["median_step_s"]
        rss_ratio = ours["peak_rss_mb"] / trl["peak_rss_mb"]
        lines.append(
            f"verdict: step time at most half of TRL's: {'PASS' if step_ratio <= 0.5 else 'FAIL'} "
            f"(ours/TRL = {step_ratio:.2f}); peak RSS no higher than TRL's: "
            f"{'PASS' if rss_ratio <= 1.0 else 'FAIL'} (ours/TRL = {rss_ratio:.2f})"
        )
    else:
        lines.append(f"verdict: not measured against TRL ({trl_note})")
    return "\n".join(lines)


def run_pair(w: dict, root: Path, args, precision: str, flops: dict, trl_note: str | None, results: dict) -> dict:
    """Ours, then TRL, on one workload in one precision; their summaries, ratios and verdicts."""
    name = w["name"]
    ours_run = run_ours(w, root, args.steps, precision, args.sampler, args.gradient_checkpointing)
    entry: dict = {"precision": precision, "ours": summarize(ours_run, flops)}
    print(f"[{name} {precision}] ours: {entry['ours']['median_step_s']:.3f} s/step", flush=True)
    trl_summary, note = None, trl_note
    if not trl_note:
        try:
            trl_run = run_trl(w, root, args.steps, args.gradient_checkpointing, precision)
            trl_summary = summarize(trl_run, flops)
            entry["trl_version"] = trl_run["trl_version"]
            entry["trl_settings"] = trl_run["settings"]
            entry["trl_rss_before_train_mb"] = trl_run["rss_before_train_mb"]
            results["versions"]["trl"] = trl_run["trl_version"]
            print(f"[{name} {precision}] TRL: {trl_summary['median_step_s']:.3f} s/step", flush=True)
        except RuntimeError as error:
            note = str(error)
            print(f"[{name} {precision}] {note}", flush=True)
    entry["trl"] = trl_summary
    entry["trl_note"] = note
    if trl_summary:
        entry["ratios"] = {
            "step_time": entry["ours"]["median_step_s"] / trl_summary["median_step_s"],
            "peak_rss": entry["ours"]["peak_rss_mb"] / trl_summary["peak_rss_mb"],
        }
        entry["verdicts"] = {
            "step_time_at_most_half": entry["ratios"]["step_time"] <= 0.5,
            "rss_no_higher": entry["ratios"]["peak_rss"] <= 1.0,
        }
    return entry


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
            cells.append("-" if r is None else f"time {r['step_time']:.2f}{' (<= 0.5)' if r['step_time'] <= 0.5 else ''}, RSS {r['peak_rss']:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["tiny", "small", "both"], default="both")
    parser.add_argument("--steps", type=int, default=6, help="RL steps per run (the first is not timed); default 6")
    parser.add_argument("--skip-trl", action="store_true", help="measure only ours (TRL is an optional dependency)")
    parser.add_argument("--results", type=Path, default=HERE / "results", help="folder for the JSON results")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (models, runs)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="activation checkpointing in both tools (TRL's default; ours train.gradient_checkpointing)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both",
                        help="fp32, bf16 (mixed precision for both tools: ours train.autocast=bfloat16, TRL bf16=True, "
                             "accelerate's autocast; weights and optimizer stay fp32 in both), or both (default)")
    parser.add_argument("--sampler", choices=["auto", "fast", "hf"], default="auto",
                        help="our rollout.sampler (default auto: the fast KV-cache loop for these Llama models)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads for the peak and both runs (OMP_NUM_THREADS); default 0 = torch's default")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")

    if args.threads:
        # Before torch is imported here, and inherited by both children.
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    names = ["tiny", "small"] if args.workload == "both" else [args.workload]
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    trl_note = "skipped (--skip-trl)" if args.skip_trl else trl_unavailable()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    busy = busy_cpus()

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
          f"load average {', '.join(f'{x:.2f}' for x in load) if load else '-'}, "
          f"CPUs busy with other work now: {_fmt(busy, '.2f')}", flush=True)
    if busy is not None and busy > 0.25:
        print(f"warning: other processes keep {busy:.1f} of {os.cpu_count()} CPUs busy: timings are noisy, and with as "
              "many torch threads as cores a step's many small ops can stall for a scheduler slice whenever another "
              "process holds a core (steps 10-100x slower; try --threads 1 to see how much)", flush=True)
    peak_start = matmul_peak("float32")
    bf16 = matmul_peak("bfloat16", reps=3, budget_s=3.0)
    print(f"fp32 matmul peak (2048^3 torch.mm, best of several): {peak_start:.1f} GFLOP/s; bf16: {_fmt(bf16, '.1f')} GFLOP/s", flush=True)
    if trl_note:
        print(f"TRL: {trl_note}", flush=True)

    root = Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    results: dict = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "load_average_at_start": load,
                    "busy_cpus_at_start": busy,
                    "platform": platform.platform()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__},
        "settings": {**SETTINGS, "steps": args.steps, "prompt_tokens": PROMPT_LENGTH, "threads": args.threads or None,
                     "gradient_checkpointing": args.gradient_checkpointing,
                     "precision": args.precision, "sampler": args.sampler},
        "trl_note": trl_note,
        "workloads": {},
    }
    tables = []
    try:
        for name in names:
            w = build_workload(root, name)
            n = SETTINGS["prompts_per_step"] * SETTINGS["group_size"]
            flops = step_flops(w, PROMPT_LENGTH, SETTINGS["max_new_tokens"], n)
            print(f"\n[{name}] {w['parameters']:,} parameters; {flops['total'] / 1e9:.1f} GFLOP per step "
                  f"(generation {flops['generation'] / 1e9:.1f}, reference {flops['reference'] / 1e9:.1f}, "
                  f"update {flops['update'] / 1e9:.1f})", flush=True)
            results["workloads"][name] = {"workload": w, "flops_per_step": flops, "runs": {}}
            for precision in precisions:
                entry = run_pair(w, root, args, precision, flops, trl_note, results)
                results["workloads"][name]["runs"][precision] = entry
                tables.append((w, entry, precision))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}")

    peak_end = matmul_peak("float32")
    peak = max(peak_start, peak_end)
    results["peak_gflops"] = {"fp32_start": peak_start, "fp32_end": peak_end, "fp32": peak, "bf16": bf16}
    results["machine"]["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"\nfp32 matmul peak: {peak_start:.1f} GFLOP/s at the start, {peak_end:.1f} at the end; using {peak:.1f}\n")
    for w, entry, precision in tables:
        entry["ours"]["fraction_of_fp32_peak"] = entry["ours"]["achieved_gflops"] / peak
        if entry["trl"]:
            entry["trl"]["fraction_of_fp32_peak"] = entry["trl"]["achieved_gflops"] / peak
        print(table(w, entry["ours"], entry["trl"], entry["trl_note"], peak, entry.get("trl_version"), precision, bf16))
        print()
    if len(precisions) == 2:
        results["cross"] = cross_ratios(results["workloads"])
        print(cross_table(results["cross"]))
        print()

    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"{dt.datetime.now():%Y-%m-%d-%H%M%S}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
