"""Would speculative sampling speed up the fast draw on a CPU? The two drafts a sampler could
use without a second model, measured on SmolLM2-135M-Instruct (`make smollm2` first).

    .venv/bin/python benchmarks/bench_speculative.py [--prompts 6] [--group 4] [--draft-tokens 4] [--seed 0]

Speculative sampling keeps the policy's distribution exactly (the rule of Leviathan et al. and
Chen et al., 2023): a draft proposes k tokens, one pass of the policy over them gives its
distribution p at each, a drafted token x with the draft's probability q(x) is kept with
probability min(1, p(x) / q(x)), at the first rejection a token is drawn from the normalised
max(p - q, 0), and after k kept tokens one more comes from p. It pays where a pass over k + 1
tokens costs about what a pass over one does, and the draft is much cheaper than the policy
and agrees with it often. What this measures of each draft:

1. **Prompt lookup** (an n-gram draft from the row's own context, up to 3 tokens matched;
   q is a point mass, so a drafted token is kept with probability p(x)): the SmolLM2
   workload's chat prompts (reasoning-gym's gsm_symbolic with `bench_grpo_step.py`'s system
   prompt), each sampled `--group` times to 128 tokens at temperature 1 by that rule through
   transformers' forward and its KV cache: tokens gained per pass of the policy, and the mean
   p of a drafted token.
2. **The same model in bf16** as the draft: the agreement sum_v min(p_v, q_v) of its
   distributions with the fp32 policy's over the sequences of (1) (each drafted token's
   chance of being kept); the fast draw's few-row matmuls (oneDNN packed, as it runs them) in
   bf16 at 8 rows (a draft step) and in fp32 at 8 and 8 x (k + 1) rows (a plain step, a
   verification pass); the share of a plain decoding step that is not the matmuls (attention
   over the cache, norms, RoPE, the draw: timed on the fast draw itself, 8 rows x 128
   tokens). From those, the time a token would take at each k, against a plain step's, taking
   each draft step and each verification pass to cost that same non-matmul share (the
   draft's is no smaller: it runs the same attention and ops in another dtype).

Prints both and the best k's estimate. Run on an idle machine; bf16 matmuls are fast only on
a CPU with bf16 instructions (avx512_bf16 or amx), which the output names.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

NEW_TOKENS, ROWS = 128, 8


def lookup_draft(context: list[int], k: int, longest: int = 3) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the context's last n
    tokens (n = longest, then shorter); [] where none occurs."""
    for n in range(longest, 0, -1):
        if len(context) <= n:
            continue
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == tail:
                return context[start + n : start + n + k]
    return []


def sample_with_lookup(
    model, prompt: list[int], k: int, eos: int, generator, new_tokens: int = NEW_TOKENS
) -> tuple[list[int], int, list[float]]:
    """One completion of up to `new_tokens` by the exact rule with prompt-lookup drafts: (its
    tokens, the policy's passes, each drafted token's p)."""
    import torch
    from transformers.cache_utils import DynamicCache

    context, cache, passes, kept_p = list(prompt), DynamicCache(), 0, []
    with torch.inference_mode():
        model(torch.tensor([context[:-1]]), past_key_values=cache, use_cache=True)
        new = 0
        while new < new_tokens:
            draft = lookup_draft(context, min(k, new_tokens - new - 1))
            logits = model(torch.tensor([[context[-1], *draft]]), past_key_values=cache, use_cache=True).logits[0]
            passes += 1
            probs = torch.softmax(logits.float(), -1)
            taken: list[int] = []
            for i, token in enumerate(draft):
                kept_p.append(float(probs[i, token]))
                if float(torch.rand((), generator=generator)) < probs[i, token]:
                    taken.append(token)
                    if token == eos:
                        break
                    continue
                rest = probs[i].clone()
                rest[token] = 0
                taken.append(int(torch.multinomial(rest, 1, generator=generator)))
                break
            else:
                taken.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)))
            context += taken
            new += len(taken)
            extra = cache.get_seq_length() - (len(context) - 1)
            if extra > 0:
                cache.crop(-extra)
            if taken[-1] == eos:
                break
    return context[len(prompt) :], passes, kept_p


def agreement(model, sequences: list[list[int]], starts: list[int]) -> float:
    """The mean over completion positions of sum_v min(p_v, q_v), p the fp32 model's next-token
    distribution and q a bf16 copy's."""
    import copy

    import torch

    low = copy.deepcopy(model).to(torch.bfloat16)
    total, count = 0.0, 0
    with torch.inference_mode():
        for ids, start in zip(sequences, starts):
            x = torch.tensor([ids])
            p = torch.softmax(model(x).logits[0, start - 1 : -1].float(), -1)
            q = torch.softmax(low(x).logits[0, start - 1 : -1].float(), -1)
            total += float(torch.minimum(p, q).sum(-1).sum())
            count += p.shape[0]
    return total / count


def packed_matrices(model, dtype) -> list:
    """The fast draw's matrices of one decoding step (`fuse_weights`: every layer's stacked
    q/k/v, output, gate/up and down, and the head) in `dtype`, each oneDNN-packed as the fast
    draw packs them (`pack_weight`: for its few rows)."""

    from grpo.rollout.fast.forward import fuse_weights, pack_weight

    w = fuse_weights(model, dtype)
    mats = [m for layer in w.layers for m in (layer.qkv, layer.out, layer.gate_up, layer.down)] + [w.head]
    return [(pack_weight(m).weight, m.shape[1]) for m in mats]


def matmul_ms(packed: list, rows: int, dtype, repeats: int = 7) -> float:
    """Milliseconds for one pass of `rows` rows through the `packed_matrices`, in `dtype`."""
    import torch

    inputs = {width: torch.randn(rows, width).to(dtype) for _, width in packed}

    def run():
        for weight, width in packed:
            torch.ops.mkldnn._linear_pointwise(inputs[width], weight, None, "none", [], "")

    with torch.inference_mode():
        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def step_split(model, tokenizer) -> tuple[float, float]:
    """(ms a decoding step, ms of it in the matmuls) of the fast draw: 2 prompts of 150
    random tokens x 4 rows, 128 tokens, every matrix packed; the prefill's share left out."""
    import torch

    from grpo.rollout import fast
    from grpo.rollout.fast import forward
    from grpo.rollout.params import SamplingParams

    p = SamplingParams.of(tokenizer, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=1.0)
    w = fast.fuse_weights(model, torch.float32, pack=True)
    fast.pack_single_matrices(w, 1 << 40)
    ids = torch.randint(100, 1000, (2, 150), generator=torch.Generator().manual_seed(0))
    spent = {"linear": 0.0}
    plain = forward._linear

    def timed(x, *args):
        start = time.perf_counter()
        out = plain(x, *args)
        if x.numel() // x.shape[-1] == ROWS:  # a decoding step's, not the prefill's
            spent["linear"] += time.perf_counter() - start
        return out

    def decode(params=p):
        start = time.perf_counter()
        fast.decode(
            model,
            ids,
            torch.ones_like(ids),
            torch.tensor([4, 4]),
            params,
            weights=w,
            generators=[torch.Generator().manual_seed(1)],
        )
        return time.perf_counter() - start

    decode()  # warm-up
    one = SamplingParams.of(tokenizer, max_new_tokens=1, min_new_tokens=1, temperature=1.0)
    prefill = statistics.median(decode(one) for _ in range(3))  # the prompts' pass and the first draw
    forward._linear = timed
    try:
        totals, linears = [], []
        for _ in range(3):
            spent["linear"] = 0.0
            totals.append(decode())
            linears.append(spent["linear"])
    finally:
        forward._linear = plain
    steps = NEW_TOKENS - 1
    return 1e3 * (statistics.median(totals) - prefill) / steps, 1e3 * statistics.median(linears) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--group", type=int, default=4, help="completions a prompt")
    parser.add_argument("--draft-tokens", type=int, default=4, help="prompt lookup's k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path, default=Path(__file__).parent / ".cache")
    args = parser.parse_args()

    import reasoning_gym
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks import bench_grpo_step, smollm2
    from grpo.rollout.prompts import prompt_text

    from grpo.infra.host import cpu_model

    cpu = cpu_model()
    print(
        f"machine: {cpu.get('cpu_model')} ({', '.join(cpu.get('cpu_flags', []))}), torch threads {torch.get_num_threads()}"
    )
    directory = smollm2.cached(args.cache_dir, log=lambda line: print(line, flush=True))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)

    # 1. Prompt lookup.
    rows = reasoning_gym.create_dataset(bench_grpo_step.SMOLLM2_TASK, size=args.prompts, seed=args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    tokens = passes = 0
    kept_p: list[float] = []
    sequences, starts = [], []
    for row in rows:
        messages = [{"role": "system", "content": smollm2.SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}]
        prompt = tokenizer(prompt_text(messages, tokenizer), add_special_tokens=False)["input_ids"]
        for _ in range(args.group):
            completion, n, ps = sample_with_lookup(model, prompt, args.draft_tokens, tokenizer.eos_token_id, generator)
            tokens, passes, kept_p = tokens + len(completion), passes + n, kept_p + ps
            sequences.append(prompt + completion)
            starts.append(len(prompt))
    print(
        f"prompt lookup (k = {args.draft_tokens}): {tokens} tokens in {passes} passes of the policy, "
        f"{tokens / passes:.2f} tokens a pass; {len(kept_p)} drafted tokens, mean p {statistics.fmean(kept_p):.3f}",
        flush=True,
    )

    # 2. A bf16 copy as the draft.
    alpha = agreement(model, sequences, starts)
    step, linear = step_split(model, tokenizer)
    rest = step - linear
    draft = matmul_ms(packed_matrices(model, torch.bfloat16), ROWS, torch.bfloat16) + rest
    fp32 = packed_matrices(model, torch.float32)
    print(
        f"bf16 draft: agreement with the fp32 policy {alpha:.3f} a token; a plain decoding step {step:.1f} ms "
        f"({linear:.1f} in the matmuls, {rest:.1f} not); a draft step {draft:.1f} ms "
        f"(bf16 matmuls {draft - rest:.1f} ms at {ROWS} rows)",
        flush=True,
    )
    best = None
    for k in range(1, 7):
        verify = matmul_ms(fp32, ROWS * (k + 1), torch.float32) + rest
        gained = (1 - alpha ** (k + 1)) / (1 - alpha)  # tokens a round, expected
        per_token = (k * draft + verify) / gained
        print(
            f"  k = {k}: verification pass {verify:.1f} ms ({ROWS * (k + 1)} rows), {gained:.2f} tokens a round, "
            f"{per_token:.1f} ms a token against {step:.1f} ({step / per_token:.2f}x)",
            flush=True,
        )
        best = max(best or (0, 0), (step / per_token, k))
    print(f"best: k = {best[1]}, {best[0]:.2f}x the plain step's rate (before the draft's own cache and bookkeeping)")


if __name__ == "__main__":
    main()
