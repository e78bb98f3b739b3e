#!/usr/bin/env bash
# The README's reasoning-gym walkthrough, measured on a tiny model: warm-up (grpo sft), GRPO
# (grpo train) and evaluation (grpo eval) on held-out rows of one task, chain_sum with 2-3
# one-digit terms. Not a timing. Prints pass@1, pass@8 and maj@8 of the random base, the
# warmed-up model and the GRPO model, on all held-out rows and on those whose question is not
# among the training rows'. From the repository root:
#     bash benchmarks/gym_walkthrough.sh [OUT]        # ~8 minutes on 2 cores; OUT: runs/gym
set -euo pipefail
OUT=${1:-runs/gym}
PY=.venv/bin/python
GRPO=.venv/bin/grpo
OPTIONS='max_terms=3&max_digits=1'
TRAIN="reasoning_gym:chain_sum?size=2000&seed=0&$OPTIONS"
HELD="reasoning_gym:chain_sum?size=200&seed=1000000&$OPTIONS"   # seeds >= size apart: other items
mkdir -p "$OUT"

# 0. A base model. With a hub model, skip this and pass its id to --model below. Here: a
#    2-layer, 128-wide Llama with a character tokenizer over the task's characters, untrained.
$PY - "$OUT/base" "$TRAIN" "$HELD" <<'PYTHON'
import sys
from grpo.data import load_rows
from grpo.tasks.tiny import save_tiny_model
rows = [row for spec in sys.argv[2:] for row in load_rows(spec)]
alphabet = "".join(sorted(set("".join(row["prompt"] + row["answer"] for row in rows))))
save_tiny_model(sys.argv[1], alphabet, hidden_size=128, layers=2, heads=4, max_positions=128, seed=0)
PYTHON

# 1. Warm-up on the task's answers (a random model needs a high lr and many epochs; a
#    pretrained one, the defaults).
$GRPO sft --model "$OUT/base" --data "$TRAIN" --output "$OUT/warm" --lr 1e-3 --epochs 12 --batch-size 32 --overwrite --quiet

# 2. GRPO with the task's own scorer as the reward.
cat > "$OUT/gym.yaml" <<YAML
algorithm: grpo
model: $OUT/warm
output_dir: $OUT/grpo
data:
  path: "reasoning_gym:chain_sum?size=2000&seed=0"
  task_options: {max_terms: 3, max_digits: 1}
rewards:
  - function: reasoning_gym
rollout: {group_size: 16, prompts_per_step: 16, max_new_tokens: 8, temperature: 1.0}
train: {steps: 300, lr: 5.0e-5, warmup_steps: 10, log_every: 50}
YAML
$GRPO train "$OUT/gym.yaml" --overwrite --quiet

# 3. Each model on the held-out rows: 8 samples per question at temperature 0.7.
for model in base warm grpo/final; do
  $GRPO eval --model "$OUT/$model" --data "$HELD" --n 8 --k 1,8 --max-new-tokens 8 --quiet \
    --out "$OUT/eval-${model//\//-}.json" > /dev/null
done

$PY - "$OUT" "$TRAIN" <<'PYTHON'
import json, sys
from pathlib import Path
from grpo.data import load_rows
from grpo.infra.logging import read_metrics
out = Path(sys.argv[1])
seen = {row["prompt"] for row in load_rows(sys.argv[2])}
rewards = [m["reward/mean"] for m in read_metrics(out / "grpo" / "metrics.jsonl")]
print(f"GRPO training reward (mean of steps): 1-50 {sum(rewards[:50]) / 50:.3f}, 251-300 {sum(rewards[-50:]) / 50:.3f}")
for name in ("base", "warm", "grpo-final"):
    result = json.loads((out / f"eval-{name}.json").read_text())
    unseen = [p for p in result["per_prompt"] if p["prompt"] not in seen]
    line = (f"{name:11s} pass@1 {result['pass@k']['1']:.3f} [{result['pass@k_ci']['1'][0]:.3f}, {result['pass@k_ci']['1'][1]:.3f}]"
            f"  pass@8 {result['pass@k']['8']:.3f}  maj@8 {result['maj@k']['8']:.3f}")
    if unseen:
        line += f"  | {len(unseen)} unseen questions: pass@1 {sum(p['correct'] for p in unseen) / (len(unseen) * result['n']):.3f}"
    print(line)
PYTHON
