"""benchmarks/bench_segments.py runs (on the demo's shape, the small one): each mode in its own
process, the segments taken only where asked below the threshold, and a bad shape refused in
one line."""

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_segments.py"


def run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, env=env, timeout=300)


def test_the_demo_shape_goes_by_segments_only_when_every_bin_is_asked():
    forced = run("--shapes", "demo", "--reps", "2", "--threads", "1", "--every-bin")
    assert forced.returncode == 0, forced.stderr
    line = forced.stdout.strip().splitlines()[-1]
    assert line.startswith("demo: bins ") and "by segments" in line and "not taken" not in line
    default = run("--shapes", "demo", "--reps", "2", "--threads", "1")
    assert default.returncode == 0, default.stderr
    assert "the segments were not taken" in default.stdout  # the demo's bins are under the threshold


def test_an_unknown_shape_is_refused_in_one_line():
    done = run("--shapes", "gpt5")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "bench_segments: error: --shapes: unknown shape 'gpt5' (choose from demo, realistic, smollm2)"
    ]
