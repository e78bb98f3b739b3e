"""`grpo demo --full`'s iterative RL, measured: how much data each reward-model update needs.

The demo's base and reward model (made as the demo makes them, once, into --work), then
GRPO on the reward model's score, trained as the demo trains its runs, under each variant:
a name and DemoConfig fields (`rm_update_prompts=64 rm_update_lr=1e-3 ...`, or any other
DemoConfig field: `lr=5e-5`, `beta=0.1`) and its iteration counts. For each run: the true
accuracy of its training samples (`reward/arithmetic_correct`, weight 0, beside the reward
model's score) over the first and last tenth of its steps, the reward model's score over the
same, each reward-model update's numbers, and pass@1 / maj@16 on problems apart from the
demo's evaluation set. Runs are cached under --work by their config: a run already made is
read back, not redone. benchmarks/README.md ("grpo demo") records what was measured.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/demo_iterative.py --work runs/rm-update \\
        --variant '16x4: rm_update_prompts=16 rm_update_samples=4' --variant '64x8: rm_update_prompts=64'
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import typing
from pathlib import Path

from grpo.demo.default import DemoConfig, Job, _evaluate, _rm_config, train_all, _train_reward_model
from grpo.eval.runner import task_verifier
from grpo.tasks import arithmetic, load_task
from grpo.train.sft import SFTConfig, sft


def _value(name: str, text: str):
    hint = typing.get_type_hints(DemoConfig)[name]
    if hint in (int, float):
        return hint(text)
    if hint is bool:
        return text.lower() in ("1", "true", "yes")
    return json.loads(text)


def variant(text: str) -> tuple[str, dict]:
    """'NAME: field=value ...' -> (NAME, {field: value})."""
    name, _, fields = text.partition(":")
    settings = {}
    for item in fields.split():
        key, _, value = item.partition("=")
        if key not in {f.name for f in dataclasses.fields(DemoConfig)}:
            raise SystemExit(f"demo_iterative: {key!r} is not a DemoConfig field")
        settings[key] = _value(key, value)
    return name.strip(), settings


def _tail(values: list[float]) -> float:
    tail = values[-max(1, len(values) // 10) :]
    return sum(tail) / len(tail)


def _head(values: list[float]) -> float:
    head = values[: max(1, len(values) // 10)]
    return sum(head) / len(head)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("runs/rm-update"))
    parser.add_argument("--variant", type=variant, action="append", required=True, metavar="'NAME: FIELD=V ...'")
    parser.add_argument(
        "--common",
        type=variant,
        default=("", {}),
        metavar="': FIELD=V ...'",
        help="fields of every run, the reward model's too",
    )
    parser.add_argument("--iterations", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument("--eval-n", type=int, default=16)
    args = parser.parse_args()

    base_config = DemoConfig(**args.common[1])
    work = args.work
    (work / "data").mkdir(parents=True, exist_ok=True)
    task = load_task("arithmetic")
    verifier = task_verifier(task)
    train_data = work / "data" / "train.jsonl"
    if not train_data.exists():
        rows = arithmetic.make_rows(base_config.train_prompts, seed=base_config.seed + 2000, digits=base_config.digits)
        train_data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if not (work / "base" / "config.json").exists():
        sft(
            work / "base",
            SFTConfig(seed=base_config.seed, steps=base_config.sft_steps, digits=list(base_config.digits)),
        )
    if not (work / "reward_model" / "config.json").exists():
        print("reward model:", _train_reward_model(base_config, work, str(work / "base"), verifier, progress=False))
    # Problems apart from the demo's evaluation set (its seed + 1000) and its RL pool (+ 2000).
    held = arithmetic.make_rows(args.eval_prompts, seed=base_config.seed + 5000, digits=base_config.digits)

    jobs, named = {}, []
    for name, settings in args.variant:
        c = dataclasses.replace(base_config, **settings)
        for seed in args.seeds:
            for iterations in args.iterations:
                config = _rm_config(c, Path(), str(work / "base"), str(train_data), work, seed, iterations)
                key = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
                config["output_dir"] = str(work / "runs" / key)
                named.append((name, seed, iterations, key))
                if not (work / "runs" / key / "summary.json").exists():
                    jobs[key] = Job(f"runs/{key}", f"{name}, seed {seed}, {iterations} iteration(s)", config)
    train_all(list(jobs.values()), work, args.parallel, print)

    eval_config = dataclasses.replace(base_config, n=args.eval_n, ks=[1, args.eval_n])
    print(
        "| variant | seed | iterations | true accuracy, first -> last 10% | RM score, first -> last 10% "
        f"| pass@1 | maj@{args.eval_n} | updates (new pairs / replayed / RM accuracy on the new) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, seed, iterations, key in named:
        out = work / "runs" / key
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        cached = out / "eval.json"
        if not cached.exists():
            result = _evaluate(str(out / "final"), held, verifier, eval_config, progress=False)
            cached.write_text(json.dumps({"pass@1": result["pass@k"]["1"], "maj": result["maj@k"][str(args.eval_n)]}))
        scores = json.loads(cached.read_text())
        truth = [m["reward/arithmetic_correct"] for m in metrics]
        rm = [m[next(k for k in m if k.startswith("reward/model:"))] for m in metrics]
        updates_path = out / "reward_model_updates.jsonl"
        updates = [json.loads(line) for line in updates_path.read_text().splitlines()] if updates_path.exists() else []
        update_text = (
            "; ".join(f"{u['new_pairs']} / {u['replayed']} / {100 * (u['accuracy_on_new'] or 0):.0f}%" for u in updates)
            or "-"
        )
        print(
            f"| {name} | {seed} | {iterations} | {100 * _head(truth):.1f}% -> {100 * _tail(truth):.1f}% "
            f"| {_head(rm):+.2f} -> {_tail(rm):+.2f} | {100 * scores['pass@1']:.1f}% | {100 * scores['maj']:.1f}% "
            f"| {update_text} |"
        )


if __name__ == "__main__":
    main()
