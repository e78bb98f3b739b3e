"""What a checkpoint costs: the time to save one (policy, reference, AdamW state, manifest
with checksums) and its size, for the tests' tiny Llama and two larger shapes.

    .venv/bin/python benchmarks/bench_checkpoint.py

The numbers behind `train.checkpoint_minutes` (default 10): cheap enough to save often, and
a bound on what a SIGKILL or a power cut can take.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPES = [(64, 2), (128, 4), (512, 8)]  # hidden, layers; (64, 2) is also the demo's model


def main() -> None:
    from _tests_workload import tests_workload

    from grpo.config import config_from_dict
    from grpo.data import PromptStream, load_rows
    from grpo.rewards import load_rewards
    from grpo.train.checkpointing import Checkpointer
    from grpo.train.loop import NoUpdater, build_engine

    for hidden, layers in SHAPES:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            c = config_from_dict({**tests_workload(tmp, hidden=hidden, layers=layers), "output_dir": str(tmp / "run")})
            e = build_engine(c, load_rewards([(r.function, r.weight) for r in c.rewards]))
            for p in e.policy_params:  # one optimizer step, so that AdamW holds its state
                p.grad = torch.zeros_like(p)
            e.optimizer.step()
            stream = PromptStream(load_rows(c.data.path, prompt_column="prompt"), seed=0)
            checkpoints = Checkpointer(e, c, stream, NoUpdater())
            times = []
            for step in range(1, 6):
                start = time.perf_counter()
                checkpoints.save(step, 0)
                times.append(time.perf_counter() - start)
            newest = sorted((tmp / "run" / "checkpoints").glob("step-*"))[-1]
            size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) / 1e6
            parameters = sum(p.numel() for p in e.policy.parameters())
            print(
                f"| hidden {hidden}, {layers} layers | {parameters:,} | {statistics.median(times):.3f} | {size:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    print("| model | parameters | s per save (median of 5) | MB per checkpoint |\n|---|---|---|---|")
    main()
