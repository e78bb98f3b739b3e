"""What sharing a group's prompt pass buys in the update under activation checkpointing.

    .venv/bin/python benchmarks/bench_shared_prompt.py [--model smollm2|DIR] [--prompts 2] [--group 4]
        [--max-new-tokens 128] [--repeats 3] [--threads 1]

The update's forward and backward (the policy's log-probs of a sampled batch, through the
chunked head, under train.gradient_checkpointing) two ways, each in its own process so that
each peak RSS is its own: `rows`, one pass per row (every completion's prompt run G times:
what the update did under checkpointing before), and `shared`, each group's prompt run once,
unchecked, and the completions' layers checkpointed over its keys and values
(grpo.train.layouts). Both run on the same batch (sampled once here with the fast loop, at
temperature 1, from chat prompts of gsm_symbolic for the real model), so the work differs
only by the prompt passes; the gradients are checked to agree. Prints the median time of
--repeats forward+backward passes after one warm-up, the peak RSS, and shared/rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def child(model_dir: str, batch_path: str, mode: str, repeats: int, out_path: str) -> None:
    """One mode's passes; writes {"times": [...], "peak_rss_mb": ..., "grad_norm": ...}."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo.infra.memory import peak_rss_mb
    from grpo.train.models import activation_checkpointing, enable_checkpointing
    from grpo.train.layouts import completion_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert enable_checkpointing(model)
    batch = torch.load(batch_path, weights_only=False)
    times, norm = [], None
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with activation_checkpointing(model, True):
            logprobs, _ = completion_logprobs(model, batch, 1.0, share_prompts=mode == "shared")
        (logprobs * batch.loss_mask).sum().backward()
        times.append(time.perf_counter() - t0)
        norm = float(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm())
    Path(out_path).write_text(json.dumps({"times": times[1:], "peak_rss_mb": peak_rss_mb(), "grad_norm": norm}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (benchmarks/smollm2.py's, cached) or a model directory")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(a.threads)
    if a.child:
        child(a.child[0], a.child[1], a.child[2], a.repeats, a.child[3])
        return 0

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.infra.host import describe_host
    from grpo.rollout import Sampler

    torch.set_num_threads(a.threads)
    if a.model == "smollm2":
        import reasoning_gym

        from benchmarks import smollm2

        model_dir = str(smollm2.cached(log=lambda line: print(line, flush=True)))
        rows = [
            {
                "prompt": [
                    {"role": "system", "content": smollm2.SYSTEM_PROMPT},
                    {"role": "user", "content": r["question"]},
                ]
            }
            for r in reasoning_gym.create_dataset("gsm_symbolic", size=a.prompts, seed=0)
        ]
    else:
        model_dir = a.model
        rows = [{"prompt": f"Question {i}: what is {i} + {i}?"} for i in range(a.prompts)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sampler = Sampler(tokenizer, prompt_column="prompt", group_size=a.group, max_new_tokens=a.max_new_tokens)
    torch.manual_seed(0)
    batch = sampler.sample(model, rows)
    del model
    prompt_tokens = int(batch.attention_mask[:, : -batch.completion_mask.shape[1]].sum(1).float().mean())
    lengths = batch.completion_mask.sum(1).tolist()
    print(
        f"host: {describe_host()}; {a.threads} thread(s); {a.prompts} prompts x G={a.group}: prompts "
        f"{prompt_tokens} tokens on average, completions {min(lengths):.0f}-{max(lengths):.0f}",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        batch_path = str(Path(tmp) / "batch.pt")
        torch.save(batch, batch_path)
        for mode in ("rows", "shared"):
            out = str(Path(tmp) / f"{mode}.json")
            command = [sys.executable, __file__, "--repeats", str(a.repeats), "--threads", str(a.threads)]
            subprocess.run([*command, "--child", model_dir, batch_path, mode, out], check=True, cwd=ROOT)
            results[mode] = json.loads(Path(out).read_text())
            r = results[mode]
            print(
                f"{mode}: forward+backward {statistics.median(r['times']):.2f} s (median of {len(r['times'])}), "
                f"peak RSS {r['peak_rss_mb']:,.0f} MB, grad norm {r['grad_norm']:.6g}",
                flush=True,
            )
    rows_t, shared_t = (statistics.median(results[m]["times"]) for m in ("rows", "shared"))
    print(
        f"shared / rows: time {shared_t / rows_t:.2f}, peak RSS "
        f"{results['shared']['peak_rss_mb'] / results['rows']['peak_rss_mb']:.2f}; "
        f"grad norms agree to {abs(results['shared']['grad_norm'] / results['rows']['grad_norm'] - 1):.1e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
