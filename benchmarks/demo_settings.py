"""How `grpo demo`'s RL settings were chosen: one arm over seeds, from a cached base, on
held-out problems apart from the demo's own evaluation set.

    python benchmarks/demo_settings.py --steps 150 --prompts 32 --group 8 --schedule cosine --seeds 5

builds the demo's base (SFT, cached under --work), evaluates it, trains the arm once per seed
(two runs at a time, one thread each, as the demo does), evaluates each run, and prints pass@1,
maj@16 and pass@64 per seed, the mean gain over the base and the spread of the seeds (highest
minus lowest), whose ratio is what the demo needs to be large. benchmarks/README.md ("grpo
demo") records what was measured. The evaluation problems come from --eval-seed (7000), not
the demo's (seed + 1000), so that the settings are not chosen on the problems they are
judged on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", default="grpo", choices=["grpo", "ppo", "ppo_equal_tokens"])
    p.add_argument("--digits", default="2,3", help="operand lengths, comma-separated")
    p.add_argument("--sft-steps", type=int, default=460)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="GRPO's G")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--schedule", default="cosine", choices=["constant", "linear", "cosine"])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--eval-seed", type=int, default=7000)
    p.add_argument("--set", default="{}", help="DemoConfig fields as JSON, e.g. '{\"ppo_lr\": 3e-5}'")
    p.add_argument("--loss", default="{}", help="extra loss.* keys of the runs as JSON, e.g. '{\"beta\": 0.01}'")
    p.add_argument("--work", default="runs/demo-settings")
    a = p.parse_args()

    import torch

    torch.set_num_threads(1)  # evaluations beside nothing else: one thread, as each training run
    from grpo.demo.default import DemoConfig, _evaluate, Job, train_all, _train_config
    from grpo.eval.runner import task_verifier
    from grpo.tasks import arithmetic, load_task
    from grpo.train.sft import SFTConfig, sft

    digits = [int(d) for d in a.digits.split(",")]
    c = DemoConfig(
        digits=digits,
        sft_steps=a.sft_steps,
        steps=a.steps,
        prompts_per_step=a.prompts,
        group_size=a.group,
        lr=a.lr,
        minibatches=a.minibatches,
        schedule=a.schedule,
        eval_prompts=a.eval_prompts,
        **json.loads(a.set),
    )
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    tag = "".join(map(str, digits))
    base = work / f"base-d{tag}-s{a.sft_steps}"
    if not (base / "config.json").exists():
        sft(base, SFTConfig(seed=0, steps=a.sft_steps, digits=digits), progress=False)
    verifier = task_verifier(load_task("arithmetic"))
    eval_rows = arithmetic.make_rows(a.eval_prompts, seed=a.eval_seed, digits=digits)
    data = work / f"train-d{tag}.jsonl"
    data.write_text(
        "".join(json.dumps(r) + "\n" for r in arithmetic.make_rows(c.train_prompts, seed=2000, digits=digits))
    )

    def numbers(model_dir: Path) -> list[float]:
        r = _evaluate(str(model_dir), eval_rows, verifier, c, False)
        return [r["pass@k"]["1"], r["maj@k"]["16"], r["pass@k"][str(c.n)]]

    b = numbers(base)
    print(f"base: pass@1 {b[0]:.3f} maj@16 {b[1]:.3f} pass@{c.n} {b[2]:.3f}", flush=True)
    name = f"{a.arm}-st{a.steps}-p{a.prompts}-G{a.group}-lr{a.lr}-mb{a.minibatches}-{a.schedule}-{int(time.time())}"
    rule = [{"function": "arithmetic_correct", "weight": 1.0}]

    def config(seed: int) -> dict:
        x = _train_config(c, work / name / f"seed-{seed}", str(base), str(data), a.arm, rule, seed)
        x["loss"].update(json.loads(a.loss))
        return x

    seeds = range(a.first_seed, a.first_seed + a.seeds)
    jobs = [Job(f"{name}/seed-{s}", f"seed {s}", config(s)) for s in seeds]
    runs, _ = train_all(jobs, work, 2, print)
    per_seed = [numbers(work / name / f"seed-{s}" / "final") for s in seeds]
    for s, r in zip(seeds, per_seed):
        print(f"seed {s}: pass@1 {r[0]:.3f} maj@16 {r[1]:.3f} pass@{c.n} {r[2]:.3f}", flush=True)
    mean = [sum(r[i] for r in per_seed) / len(per_seed) for i in range(3)]
    spread = max(r[1] for r in per_seed) - min(r[1] for r in per_seed)
    gain = mean[1] - b[1]
    print(
        f"{name}: mean pass@1 {mean[0]:.3f} maj@16 {mean[1]:.3f} pass@{c.n} {mean[2]:.3f}; maj@16 gain {gain:+.3f}, "
        f"spread of the seeds {spread:.3f}" + (f" ({gain / spread:.1f}x)" if spread else ""),
        flush=True,
    )
    (work / name / "result.json").write_text(json.dumps({"base": b, "per_seed": per_seed, "args": vars(a)}))


if __name__ == "__main__":
    main()
