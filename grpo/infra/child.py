"""Training runs in child processes, so that each run's peak memory is its own."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml

from grpo.errors import UserError
from grpo.infra import forkserver


def child_env(threads: int | None) -> dict[str, str] | None:
    """The environment of a child run on `threads` torch threads (None: this process's own,
    torch's default threads)."""
    if threads is None:
        return None
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


@contextlib.contextmanager
def run_starter(threads: int | None, models: list[str] = ()) -> Iterator[forkserver.ForkServer | None]:
    """For runs started one after another or side by side with the same thread setting: a
    ForkServer that has imported what they import, once (grpo/infra/forkserver.py), warmed
    for `models`; None where one cannot run (not Linux): each run then starts a new
    interpreter. Pass what it yields to `train_in_child`."""
    if not forkserver.available():
        yield None
        return
    with forkserver.ForkServer(env=child_env(threads), models=models) as server:
        yield server


def train_in_child(
    config: dict,
    config_path: Path,
    *,
    progress: bool = True,
    threads: int | None = None,
    starter: forkserver.ForkServer | None = None,
) -> dict:
    """Write `config` to `config_path`, run `grpo train` on it in a new process, and return
    the run's summary.json with its per-step metrics under "metrics". `threads`: the child's
    torch threads (OMP_NUM_THREADS), for runs trained side by side; None: torch's default.
    `starter` (from `run_starter`, made for the same `threads`): fork the run from it instead
    of starting a new interpreter; the same run, without the seconds of imports."""
    config_path = Path(config_path)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = ["train", str(config_path)] + ([] if progress else ["--quiet"])
    if starter is None:
        # The child's progress bar goes straight to our stderr; its errors are one line there.
        done = subprocess.run(
            [sys.executable, "-m", "grpo", *argv],
            stdout=subprocess.PIPE,
            stderr=None if progress else subprocess.PIPE,
            text=True,
            env=child_env(threads),
        )
        code, errors = done.returncode, done.stderr or ""
    else:
        with tempfile.TemporaryDirectory(prefix="grpo-run-") as scratch:
            log = None if progress else Path(scratch) / "stderr"
            try:
                code = starter.run(argv, stderr=log)
            except forkserver.ServerGone as err:
                raise UserError(f"training {config_path.name} failed: {err}") from err
            errors = log.read_text(errors="replace") if log is not None and log.exists() else ""
    if code != 0:
        detail = errors.strip().splitlines()[-1:] or ["its error is printed above"]
        raise UserError(f"training {config_path.name} failed: {detail[0]}")
    out = Path(config["output_dir"])
    summary = json.loads((out / "summary.json").read_text())
    summary["metrics"] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary
