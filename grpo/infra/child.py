"""Training runs in child processes, so that each run's peak memory is its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from grpo.errors import UserError


def train_in_child(config: dict, config_path: Path, *, progress: bool = True, threads: int | None = None) -> dict:
    """Write `config` to `config_path`, run `grpo train` on it in a new process, and return
    the run's summary.json with its per-step metrics under "metrics". `threads`: the child's
    torch threads (OMP_NUM_THREADS), for runs trained side by side; None: torch's default."""
    config_path = Path(config_path)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [sys.executable, "-m", "grpo.cli", "train", str(config_path)] + ([] if progress else ["--quiet"])
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    # The child's progress bar goes straight to our stderr; its errors are one line there.
    done = subprocess.run(
        command, stdout=subprocess.PIPE, stderr=None if progress else subprocess.PIPE, text=True, env=env
    )
    if done.returncode != 0:
        detail = (done.stderr or "").strip().splitlines()[-1:] or ["its error is printed above"]
        raise UserError(f"training {config_path.name} failed: {detail[0]}")
    out = Path(config["output_dir"])
    summary = json.loads((out / "summary.json").read_text())
    summary["metrics"] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary
