"""What a weight push to a `grpo vllm-serve` server costs (server mode, the file transport).

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/bench_vllm_server.py            # SmolLM2-135M's shape
    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/bench_vllm_server.py --tiny     # the tests' tiny Qwen2

Saves a randomly initialised model (bench_vllm_sync.py's) into a temporary folder, starts a
server on it in a subprocess, then `--pushes` times moves every weight a little and pushes
it (`RemoteEngine.load_weights`: the safetensors file written in /dev/shm, the server's
in-place load, the file deleted), then runs the check (`check`: one prompt pass on each
side). Prints one line per push: the whole push, its write and the server's load apart, and
the check. Needs vLLM (docs/vllm.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny Qwen2 instead of SmolLM2's shape")
    parser.add_argument("--pushes", type=int, default=4)
    parser.add_argument("--port", type=int, default=18777)
    args = parser.parse_args()

    import torch
    from bench_vllm_sync import model

    from grpo.vllm.client import RemoteEngine
    from grpo.vllm.engine import policy_weights

    policy = model(args.tiny)
    folder = tempfile.mkdtemp(prefix="bench-vllm-server-")
    policy.save_pretrained(folder)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "grpo", "vllm-serve", "--model", folder, "--port", str(args.port)]
    command += ["--max-model-len", "256", "--max-num-seqs", "16", "--device", "cpu"]
    start = time.perf_counter()
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit("the server stopped; run the command above to see why")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.5)
        print(f"server up in {time.perf_counter() - start:.1f} s")
        engine = RemoteEngine(f"127.0.0.1:{args.port}")
        for i in range(args.pushes):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 1e-4)
            written, loaded = engine.write_seconds, engine.load_seconds
            start = time.perf_counter()
            engine.load_weights(policy_weights(policy))
            pushed = time.perf_counter()
            gap = engine.check(policy, tolerance=1e-3)
            checked = time.perf_counter()
            print(
                f"push {i}: {pushed - start:.3f} s (write {engine.write_seconds - written:.3f} s, server's load "
                f"{engine.load_seconds - loaded:.3f} s), check {checked - pushed:.3f} s, mean |dlogp| {gap:.1e}"
            )
    finally:
        server.kill()


if __name__ == "__main__":
    main()
