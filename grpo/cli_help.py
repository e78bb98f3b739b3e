"""What each `grpo` command's --help says: the prose of the commands' descriptions, apart from
the code that parses and dispatches (grpo/cli.py); flag help is written beside each flag, or
taken from the config field it sets."""

DESCRIPTION = """\
Reinforcement-learning fine-tuning of language models with GRPO (Group Relative Policy
Optimization, DeepSeekMath) and PPO, on one engine.

GRPO is PPO with three changes: the value model goes, the baseline becomes the mean (and
std) of a group of G sampled outputs for the same prompt, and the KL penalty moves from the
per-token reward into the loss. The reward model stays.
"""

EPILOG = """\
The math (advantages, KL estimators, clipped losses, pass@k, maj@k) is also a Python
library: grpo.algo and grpo.eval. `grpo train --help` lists every config key.
"""

TRAIN_HELP = """\
Train a causal language model with GRPO or PPO, as CONFIG (YAML) says.

Writes into output_dir: config.yaml (resolved), metrics.jsonl (one object per step),
samples.jsonl (completions with their rewards), checkpoints/ and final/ (a Hugging Face
model directory). Ready configs: configs/grpo.yaml and configs/ppo.yaml.
"""

PROBE_HELP = """\
Before a run: sample its first step's batch with the base policy and report what GRPO
would learn from it, with a verdict that names the change to make first.

CONFIG is the run's config (as `grpo train` reads it, --set included); the probe builds the
run as training does, so with the same seed every number is that of the first step's line in
metrics.jsonl. It samples G = rollout.group_size completions for each of --prompts N prompts
(default: rollout.prompts_per_step, exactly the first step's batch), scores them with the
config's rewards and prints:
  groups that teach        the share of groups whose rewards differ (the others have no
                           advantage: 1 - frac_zero_std_groups)
  groups by pass rate      each group's share of samples with reward >= --threshold
                           (default: eval.threshold, else 0.5), as a histogram
  reward                   the mean and std, and each reward function's mean (unweighted)
  cut at max_new_tokens    the share of samples that never ended (frac_truncated)
  tokens per sample        completion_length/mean
  time per step            measured: the probe runs that step, update included, on models
                           it builds for the purpose and then throws away (the first
                           step's time, one-time costs included)
and a verdict: warm up (almost no group's rewards differ: `grpo sft` first), raise the
budget (samples cut at rollout.max_new_tokens), raise G (few groups teach, most fail),
make it harder (most groups pass every sample), fix the rewards (nothing scored), or go.
Nothing is written into output_dir; --json FILE writes every number and the verdict.
docs/evaluation.md has the rules of the verdict.
"""

PLAN_HELP = """\
Before a run, before anything loads: the peak memory of its step, phase by phase, and which
savers bring it under --memory SIZE.

CONFIG is the run's config (as `grpo train` reads it, --set included). Only the model's
config.json is read (the model is built on torch's meta device, which holds nothing), and
the reward and value models' alike. It prints what each state holds (the policy's weights,
the reference, PPO's critic, reward models, AdamW's moments, the gradients), what sampling
adds (the KV cache of G x (prompt + completion), logits, the fast loop's copies), what the
update adds (the activations its largest pass saves, with and without checkpointing, and
the LM head's chunks), a colocated vLLM engine's share, each phase's total (sample, the
no-grad passes, update) and the peak: the largest phase. Completions count at
rollout.max_new_tokens unless --completion-tokens says their length; prompts at
--prompt-tokens, else rollout.max_prompt_length, else 256 tokens. On a CPU the runtime (the
libraries, the model's code, the tokenizer) is measured in this process; on a GPU every
figure is a prediction until measured.

The savers, each alone, cheapest first, with the peak each gives and what it costs: the
chunked head, checkpointing, fewer rows a pass (train.micro_batch_size), fewer completions a
sampling call, the step in the backward, a bf16 reference, 8-bit moments, LoRA, QLoRA (nf4)
and no reference (loss.beta 0). With --memory, a verdict: fits; fits with the cheapest
saver (or savers, added cheapest first) and the --set that applies it; or does not fit.
--json FILE writes every number. docs/memory.md#planning-memory-grpo-plan explains them.
"""

RM_HELP = """\
Reward models: a network that gives each (prompt, completion) one scalar score, trained on
comparisons (which of two completions of a prompt is better) with the Bradley-Terry loss.

GRPO drops PPO's value model (the critic), not the reward model: the reward model is what
scores the G sampled completions whose mean becomes the baseline. Use one where no rule can
check an answer. A trained reward model is a Hugging Face directory
(AutoModelForSequenceClassification, one output) that a run's rewards can use.
"""

RM_TRAIN_HELP = """\
Train a reward model from pairwise comparisons.

PAIRS is a .jsonl, .json, .parquet or .csv file (or a `datasets` directory or name) whose
rows hold `prompt` (text, or chat messages), `chosen` (the better completion) and `rejected`
(the worse). The model is BASE (any causal LM directory or hub id) with a new one-output head
on its last token; all of it is trained to score chosen above rejected (Bradley-Terry loss).
A seeded --eval-fraction of the pairs is held out; the accuracy on them (how often chosen
scores above rejected) is reported before and after training. The last line printed is a
JSON summary: accuracy and pairs (held out), train_pairs, output, ...
"""

RM_EVAL_HELP = """\
Measure a trained reward model on comparisons: the fraction of pairs whose chosen completion
scores above the rejected one (accuracy; ties count 1/2) and the mean score difference
(margin). The last line printed is a JSON object with accuracy, margin and pairs.
"""

SFT_HELP = """\
Supervised warm-up before RL, in two modes:

  grpo sft --model M --data FILE --output DIR   fine-tune your model on your rows
  grpo sft --task arithmetic --output DIR       a tiny model from scratch (the demo's base;
                                                --task arithmetic is the default)

Why: RL only moves a policy that already solves some prompts. GRPO's advantage is a
completion's reward minus the mean reward of its group; a group whose rewards are all equal
(all wrong, or all right) has zero advantage and teaches nothing. A random model solves
nothing, a perfect one leaves nothing to learn. Warm up until the model solves some of your
prompts some of the time, then run `grpo train` with `model: DIR`.

Your rows (--data: any file or dataset `grpo train` reads) come in one of two shapes:
  {"prompt": "What is 2+3?", "completion": "5"}                  (--prompt-column, --completion-column)
  {"prompt": [{"role": "user", "content": "What is 2+3?"}], "completion": "5"}
  {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
The loss is on the completion (or each assistant message) and an EOS only. A prompt is
encoded exactly as `grpo train` samples from it: chat messages through the tokenizer's chat
template with the generation prompt. The model loads as `grpo train` loads one and trains on
--device. With --lora-r the adapter is merged into the saved weights: DIR is a plain model
directory (--lora-save adapter keeps peft's adapter files instead, both keeps them in
DIR/adapter/: what grpo train's lora.init_adapter starts from). A row longer than the
model's positions stops the command, unless --max-length cuts long rows to their last
tokens. The defaults (below) are for a pretrained model: a light
fine-tuning, warm-up over a tenth of the updates, then cosine to 0.

From scratch (--task arithmetic): a small Llama-style model (built from a config, no
download) learns addition written out digit by digit, from freshly drawn problems each step
("47+85=" -> "7+5+0=12;4+8+1=13>132" + EOS). The defaults stop training early, on purpose:
the model solves some held-out 2-digit problems some of the time, and nearly every one at
least once in 16 samples (benchmarks/README.md has pass@1 and pass@16 by --steps). Fewer
--steps: a weaker model; the defaults are tuned for 2 digits, and longer problems need more
--steps.

The same --seed gives the same weights. DIR holds the model, its tokenizer and
sft_config.json (the settings it was made with). The last line printed is a JSON summary:
output, steps, loss/first, loss/last, parameters, time_s (and when fine-tuning: model, rows,
epochs, truncated, trainable_parameters).
"""

EVAL_HELP = """\
Measure pass@k and maj@k of a model (DeepSeekMath Fig. 7: RL raises Maj@K, not Pass@K).

For every prompt of --data, --n completions are sampled (temperature 0.7 by default) and each is
checked: by a task (--task: a built-in name or 'pkg.module:name', its verifier, threshold and
answer extractor) or by a reward function (--verifier, TRL's signature; correct when its
score >= --threshold, with --answer reading the final answers). Then for every k:
  pass@k  the chance that at least one of k samples is correct (unbiased: 1 - C(n-c,k)/C(n,k))
  maj@k   the accuracy of a majority vote over the final answers of k samples
both exact expectations over the k-subsets of the n samples, averaged over prompts, with
95% normal confidence intervals over prompts (mean +- 1.96 s/sqrt(P), clipped to [0, 1]).

Prints a table, then, as the last line, a JSON summary (everything but the per-prompt
details). --out writes the full JSON (per_prompt included); --plot draws both curves.
The same --seed and --batch-size give the same samples.

Before the model loads, the verifier is tried on an empty completion for every row: a row
it raises on fails the command; if it can score none of the rows (None for every one), the
data is not this verifier's (a missing answer column) and the command fails too.
"""

DEMO_HELP = """\
The built-in demo, on a laptop CPU, with no download (what `make demo` runs).

It warms up a tiny Llama on two- and three-digit addition until it solves some problems
sometimes (and some never, in 64 tries), measures pass@k and maj@k (k up to 64), trains it
with GRPO and, from the same base, with PPO at the same prompts as GRPO (G times fewer
generated tokens). PPO runs with its own tuned settings (learning rates of policy and
critic, GAE lambda, epochs; the critic starts from the base). Every RL arm runs over --seeds
seeds, two runs at a time on one thread each; the report gives means, the spread over seeds
(and whether GRPO's maj@16 gain is larger than it) and intervals over problems. It shows
DeepSeekMath's findings as measured: whether RL raises Maj@K more than Pass@K; GRPO holds
three models to PPO's four but samples G answers per question. Writes report.md,
summary.json and plots into --output. --equal-tokens adds PPO at the same number of
generated tokens as GRPO (G times the prompts), the costliest arm.

--neural-rm adds a GRPO run driven by a reward model trained on the base's own right and
wrong answers, its true accuracy logged beside the score it optimised (reward hacking
shows). --full adds PPO at equal generated tokens and DeepSeekMath's Fig. 5 and Fig. 6 at
toy scale, each arm over --full-seeds seeds (at most --seeds; the GRPO arm's steps and
samples): outcome supervision
(the GRPO arm's own runs of those seeds, not retrained) against process supervision (the
task's per-step verifier as the reward), and GRPO on the neural reward model with 1, 2 and
3 iterations of iterative RL (between iterations the reward model retrains on the policy's
fresh samples labelled by the task's verifier, with 10% of its history replayed, its own
first comparisons included; the reference is reset to the policy). The report gives each
arm's pass@1, maj@16 and pass@64 (means, each seed's, the spread), the reward model's
score against the true accuracy per step (the hacking curve), and says from the numbers
whether each finding was reproduced: process at least level with outcome; the second
iteration above the first in every seed.

--tools runs the multi-turn demo instead (its own budget; --seed, --seeds, --steps, --quick
and --output apply): a tiny model is warmed up with grpo sft on conversations that call a
multiply(a, b) tool only some of the time, on 2-digit multiplication it cannot do in its
head; GRPO then trains it with the tool, the task's verifier the only reward, over --seeds
seeds (default 3). The report gives pass@k and maj@k with and without the tool, base against
GRPO, and the share of samples that called the tool with the right operands.
"""

COMPARE_HELP = """\
Train two configs on the same data and budget and put them side by side: models and
parameters held, peak memory, generated tokens, time per step, final reward and (with
--task) accuracy (pass@1) and maj@n over --n samples per problem, measured as `grpo eval`
measures them. The second config takes the first one's data, seed, steps, prompts per step
and completion length. Writes compare.md and compare.json into --output.

--task is a built-in task (arithmetic) or any task as 'pkg.module:name': a grpo.tasks.Task,
or a function of no arguments that returns one. Its verifier checks the answers; its rows
function gives the problems unless --eval-data does. Its answer extractor reads the final
answers that maj@n votes with, unless --answer or --answer-pattern says how; when most
samples have no answer, a warning line says so (and compare.md repeats it).
"""

VLLM_SERVE_HELP = """\
Serve a vLLM engine for training runs elsewhere (server mode): generation on its own
process, GPUs or machine, the trainer's weights pushed to it after every update.

Start it with the run's model, then point the run at it:
  grpo vllm-serve --model DIR --port 8000
  grpo train CONFIG --set rollout.sampler=vllm --set rollout.vllm.server=127.0.0.1:8000

The engine is built once from DIR (its weights loaded and checked by log-probs); it then
answers a JSON API over HTTP: GET /health (the model's architecture and fingerprint, dtype,
longest sequence, grpo and vLLM versions), POST /generate (prompts as token ids, the run's
sampling options, per-prompt n and seed -> completion ids and sampled-token log-probs), POST
/weights (load pushed weights in place) and POST /prompt_logprobs (the trainer's check that
the pushed weights are its own). Before its first step a run refuses, in one line, a server
that does not answer or holds another model; a server that dies mid-run stops the run in one
line with its last step saved (continue with --resume once it is up again).

Weights travel as one safetensors file the trainer writes (in /dev/shm where it exists) and
the server reads: trainer and server on one machine (rollout.vllm.transport: file). NCCL
between GPUs (vLLM's weight transfer engine) is not available in this version. One trainer
per server; the API has no authentication: listen on 127.0.0.1 (the default) or a trusted
network. The engine options a colocated run sets under rollout.vllm are this command's flags.
Stop it with Ctrl-C.
"""
