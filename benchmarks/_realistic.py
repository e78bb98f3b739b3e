"""The realistic workload of `bench_grpo_step.py`: a Qwen2-shaped model with Qwen2.5's vocabulary
size, warmed up so that its completions end with EOS at lengths that vary several-fold.

What the fixed-length workloads do not show: with a 151,936-token vocabulary the LM head and
the (N, T, V) logits dominate, and with completions of varying length padding and finished
rows cost what they cost in a real run. Built once and cached on disk (`cached`), because the
warm-up takes minutes:

1. a byte-level BPE tokenizer of exactly `vocab_size` tokens (`byte_level_tokenizer`): the 256
   byte symbols (one token per byte of UTF-8, no merges: every character of the ASCII text
   here is one token), filler tokens up to the size, and `<|endoftext|>` as EOS and pad, as in
   Qwen2. Why byte-level: transformers (5.x) loads any tokenizer saved beside a Qwen2 config as
   `Qwen2Tokenizer`, whatever `tokenizer_config.json` names (qwen2 is on its list of models
   whose hub tokenizer class is ignored), and rebuilds it as a byte-level BPE from the saved
   vocabulary; a character-level WordLevel tokenizer then silently loses its spaces. A
   byte-level vocabulary is what that rebuild expects, so text round-trips (`check_round_trip`
   verifies it through `AutoTokenizer.from_pretrained`, as both tools load it);
2. a `Qwen2ForCausalLM` from a `Qwen2Config` (`SHAPES`; tied embeddings), random weights;
3. warm-up rows (`write_rows`): a 12-character prompt, and a completion of random characters
   whose length is drawn from a log-normal distribution cut at `LENGTH_CAP` (mean ~47
   characters, so ~48 tokens with the EOS; median ~39, p90 ~98, at most 151), then
   `grpo sft` (`grpo.train.sft.sft` with a `FineTuneConfig`) on them: the model learns the
   alphabet and where EOS falls, so its sampled completions end with EOS at varying lengths,
   with a tail that a `max_new_tokens` of 256 (over 4x the mean) rarely cuts;
4. a check of that (`sample_lengths`): completions sampled with transformers' `generate`, their
   length distribution recorded in the cache's `workload.json`.

The cache directory's name carries a hash of everything that goes into the build (`spec`), so
a change to any of it builds afresh; `rebuild=True` builds again regardless. A build goes to
a temporary directory and is renamed into place when complete, so an interrupted one is never
reused.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import statistics
import time
from pathlib import Path

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-=*"  # prompts and completions are made of these
PROMPT_LENGTH = 12
EOS = "<|endoftext|>"
BUILD_VERSION = 1  # bump when the construction changes in a way `spec` does not capture

# The model: Qwen2 architecture, Qwen2.5's vocabulary size, a CPU-sized body. "tiny" is the same
# construction at a size the tests build in seconds.
SHAPES = {
    "full": dict(
        vocab_size=151936,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
        max_position_embeddings=2048,
    ),
    "tiny": dict(  # head_dim 64: a size vLLM's CPU attention takes, so every decoder runs on it
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        max_position_embeddings=512,
    ),
}
# Completion lengths of the warm-up rows, in characters (= tokens) before the EOS: round(lognormal
# with median LENGTH_MEDIAN and sigma LENGTH_SIGMA), drawn again while outside 1..LENGTH_CAP.
LENGTH_MEDIAN, LENGTH_SIGMA, LENGTH_CAP = 41, 0.85, 150
# The warm-up (`grpo sft` on the rows): a random model needs a from-scratch learning rate.
WARMUP = {
    "full": dict(rows=4096, steps=80, batch_size=8, lr=5e-3),
    "tiny": dict(rows=64, steps=2, batch_size=8, lr=1e-3),
}
CHECK_SAMPLES = {"full": 32, "tiny": 8}  # completions sampled to record the warmed-up lengths


def spec(shape: str) -> dict:
    """Everything the build depends on; its hash names the cache directory."""
    import tokenizers
    import transformers

    return {
        "version": BUILD_VERSION,
        "shape": shape,
        "config": SHAPES[shape],
        "warmup": WARMUP[shape],
        "alphabet": ALPHABET,
        "prompt_length": PROMPT_LENGTH,
        "lengths": {"median": LENGTH_MEDIAN, "sigma": LENGTH_SIGMA, "cap": LENGTH_CAP},
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


# ---- the tokenizer ----------------------------------------------------------------------------


def byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE `PreTrainedTokenizerFast` with exactly `vocab_size` tokens: the 256 byte
    symbols (ids 0-255, GPT-2's byte-to-unicode order), filler tokens (strings of three printable
    byte symbols, never produced by encoding: there are no merges), and `<|endoftext|>` last, the
    EOS and pad token. No BOS, as Qwen2."""
    import itertools

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_symbols = bytes_to_unicode()  # byte -> a printable unicode character
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 bytes and EOS), got {vocab_size}")
    vocab = {byte_symbols[b]: b for b in range(256)}
    printable = [byte_symbols[b] for b in range(33, 127)]
    fillers = ("".join(t) for t in itertools.product(printable, repeat=3))  # 830,584: enough
    while len(vocab) < vocab_size - 1:
        vocab[next(fillers)] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=EOS)


ROUND_TRIP_TEXTS = ("ab c 12 = x", "  two  spaces, a\ttab\nand a newline", "7+7=14 * zz -q")


def check_round_trip(directory: Path) -> None:
    """Raise ValueError unless text round-trips through the tokenizer that
    `AutoTokenizer.from_pretrained(directory)` loads (what both tools load), one token per
    byte, with EOS and pad where the model's config has them."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = AutoConfig.from_pretrained(directory)
    for text in ROUND_TRIP_TEXTS:
        ids = tokenizer(text)["input_ids"]
        back = tokenizer.decode(ids)
        if back != text or len(ids) != len(text.encode()):
            raise ValueError(
                f"{type(tokenizer).__name__} from {directory} does not round-trip {text!r}: "
                f"{len(ids)} tokens, decoded {back!r}"
            )
    if len(tokenizer) != config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, the model {config.vocab_size}")
    if tokenizer.eos_token_id != config.eos_token_id or tokenizer.pad_token_id != config.pad_token_id:
        raise ValueError(
            f"EOS/pad: tokenizer {tokenizer.eos_token_id}/{tokenizer.pad_token_id}, "
            f"model {config.eos_token_id}/{config.pad_token_id}"
        )


# ---- the rows ---------------------------------------------------------------------------------


def completion_length(rng: random.Random) -> int:
    """Characters before the EOS (see LENGTH_MEDIAN)."""
    while True:
        n = round(rng.lognormvariate(math.log(LENGTH_MEDIAN), LENGTH_SIGMA))
        if 1 <= n <= LENGTH_CAP:
            return n


def write_prompts(path: Path, count: int, seed: int) -> Path:
    """`count` prompts of PROMPT_LENGTH random characters, one JSON object a line."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            f.write(json.dumps({"prompt": "".join(rng.choice(ALPHABET) for _ in range(PROMPT_LENGTH))}) + "\n")
    return path


def write_rows(path: Path, count: int, seed: int) -> dict:
    """`count` prompt/completion rows for the warm-up; returns their completion lengths' statistics
    in tokens, EOS included."""
    rng = random.Random(seed)
    lengths = []
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            prompt = "".join(rng.choice(ALPHABET) for _ in range(PROMPT_LENGTH))
            n = completion_length(rng)
            lengths.append(n + 1)
            f.write(
                json.dumps({"prompt": prompt, "completion": "".join(rng.choice(ALPHABET) for _ in range(n))}) + "\n"
            )
    return length_stats(lengths, [True] * len(lengths))


def length_stats(lengths: list[int], ended: list[bool]) -> dict:
    """Mean, median, p90 and max of completion lengths in tokens (nearest rank), and the fraction
    that did not end with EOS (cut off at max_new_tokens)."""
    ordered = sorted(lengths)

    def rank(q: float) -> int:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return {
        "n": len(ordered),
        "mean": statistics.mean(ordered),
        "p50": rank(0.5),
        "p90": rank(0.9),
        "max": ordered[-1],
        "frac_truncated": (len(ended) - sum(ended)) / len(ended),
    }


# ---- the build --------------------------------------------------------------------------------


def build(directory: Path, shape: str = "full", *, max_new_tokens: int = 256, progress: bool = True, log=print) -> dict:
    """Build the workload into `directory` (which must not exist): the warmed-up model
    (directory/model), its prompts (directory/prompts.jsonl) and workload.json (what was built,
    the warm-up's losses, the sampled lengths). Returns workload.json's content. `progress`: the
    warm-up's lines on stderr (grpo sft's)."""
    import torch
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    transformers.utils.logging.disable_progress_bar()  # saving and loading shards: noise here
    from grpo.train.sft import FineTuneConfig, sft

    started = time.perf_counter()
    directory.mkdir(parents=True)
    config_kwargs = SHAPES[shape]
    tokenizer = byte_level_tokenizer(config_kwargs["vocab_size"])
    base = directory / "base"
    config = Qwen2Config(
        **config_kwargs,
        tie_word_embeddings=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    check_round_trip(base)

    warmup = WARMUP[shape]
    rows_stats = write_rows(directory / "warmup.jsonl", warmup["rows"], seed=1)
    log(
        f"[realistic] warming up {shape} ({warmup['steps']} updates of {warmup['batch_size']} rows, "
        f"lr {warmup['lr']:g}) on rows with completion lengths mean {rows_stats['mean']:.1f}, "
        f"p90 {rows_stats['p90']}, max {rows_stats['max']} tokens"
    )
    fit = sft(
        directory / "model",
        FineTuneConfig(
            model=str(base),
            data=str(directory / "warmup.jsonl"),
            steps=warmup["steps"],
            batch_size=warmup["batch_size"],
            lr=warmup["lr"],
            seed=0,
        ),
        progress=progress,
        device="cpu",
        log_every=max(1, warmup["steps"] // 10),
    )
    shutil.rmtree(base)
    check_round_trip(directory / "model")
    write_prompts(directory / "prompts.jsonl", 256, seed=2)  # others than the warm-up's

    sampled = sample_lengths(directory / "model", directory / "prompts.jsonl", CHECK_SAMPLES[shape], max_new_tokens)
    manifest = {
        "spec": spec(shape),
        "model_dir": str(directory / "model"),
        "prompts": str(directory / "prompts.jsonl"),
        "parameters": fit["parameters"],
        "warmup_rows": rows_stats,
        "warmup_loss_first_last": [fit["loss/first"], fit["loss/last"]],
        "sampled_lengths": {**sampled, "max_new_tokens": max_new_tokens},
        "build_s": round(time.perf_counter() - started, 1),
    }
    (directory / "workload.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(
        f"[realistic] built in {manifest['build_s']:.0f} s: warm-up loss {fit['loss/first']:.2f} -> "
        f"{fit['loss/last']:.2f}; {sampled['n']} sampled completions: mean {sampled['mean']:.1f}, "
        f"p50 {sampled['p50']}, p90 {sampled['p90']}, max {sampled['max']} tokens, "
        f"{sampled['frac_truncated']:.0%} cut at {max_new_tokens}"
    )
    return manifest


def sample_lengths(model_dir: Path, prompts: Path, n: int, max_new_tokens: int, seed: int = 0) -> dict:
    """Length statistics of `n` completions sampled (temperature 1) with transformers' generate
    from the first prompts of `prompts`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    texts = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()[:n]]
    inputs = tokenizer(texts, return_tensors="pt")  # one length: no padding
    with torch.random.fork_rng(), torch.inference_mode():
        torch.manual_seed(seed)
        out = model.generate(
            **inputs,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    completions = out[:, inputs["input_ids"].shape[1] :].tolist()
    eos = tokenizer.eos_token_id
    lengths = [row.index(eos) + 1 if eos in row else len(row) for row in completions]
    return length_stats(lengths, [eos in row for row in completions])


def _build_child(directory: str, shape: str, progress: bool, quiet: bool) -> None:
    build(Path(directory), shape, progress=progress, log=(lambda line: None) if quiet else print)


def build_in_child(directory: Path, shape: str = "full", *, progress: bool = True, quiet: bool = False) -> None:
    """`build` in a fresh (spawned) process. Why: on Linux a child started later inherits its
    parent's peak RSS as its own starting ru_maxrss (vfork/exec carries the high-water mark
    over), so a warm-up of ~4 GB in the benchmark's process would read as the peak of every
    run it starts afterwards (measured: ours 4,229 MB where the same run alone peaks at 2,127)."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(
        target=_build_child, args=(str(directory), shape, progress, quiet)
    )
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"building the realistic workload failed (exit code {child.exitcode}); its error is above")


def cached(cache_dir: Path, shape: str = "full", *, rebuild: bool = False, progress: bool = True, log=print) -> dict:
    """The workload's workload.json under `cache_dir`, building it first when it is missing (or
    when `rebuild`)."""
    key = hashlib.sha256(json.dumps(spec(shape), sort_keys=True).encode()).hexdigest()[:12]
    final = cache_dir / f"realistic-{shape}-{key}"
    if rebuild and final.exists():
        shutil.rmtree(final)
    if not (final / "workload.json").exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = cache_dir / f".partial-{final.name}"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        build_in_child(partial, shape, progress=progress, quiet=log is not print)
        partial.rename(final)
    else:
        log(f"[realistic] using the cached build {final} (--rebuild to build it again)")
    manifest = json.loads((final / "workload.json").read_text())
    # Paths as they are now (the build wrote them under its temporary name).
    manifest["model_dir"], manifest["prompts"] = str(final / "model"), str(final / "prompts.jsonl")
    manifest["directory"] = str(final)
    return manifest
