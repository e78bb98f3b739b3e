"""`grpo plan CONFIG`: before anything loads, the peak memory of a run's step, phase by phase
(which savers bring it under a budget, and the report: grpo.train.advice).

Only the model's config.json is read (`grpo.infra.hf.model_config`); the model is built on
torch's meta device, which allocates nothing, for its tensors' shapes. The accounting is
docs/memory.md's: the states a step holds (the policy's weights, its gradients, the
optimizer's moments, the reference, PPO's critic, reward models), what sampling adds (its
KV cache and logits, the fast loop's fused and packed copies), what the update adds (the
activations a pass saves, with or without checkpointing, the head's chunks) and, where vLLM
is colocated, the engine's share. The peak is the largest phase, each phase what is held at
once. Completions are planned at rollout.max_new_tokens (the worst case) unless told their
length; prompts at rollout.max_prompt_length unless told theirs. On a CPU the runtime (the
libraries, the model's code, the tokenizer) is measured in this process; on a GPU the
figures are predictions until measured. `benchmarks/bench_memory.py` prints them beside the
measured peaks. The user's guide: docs/memory.md#planning-memory-grpo-plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from pathlib import Path

from grpo.algo.logprobs import _CHUNK_ELEMENTS as HEAD_SCRATCH  # a head chunk's float32 values, at most
from grpo.algo.logprobs import VOCAB_TILE
from grpo.config import Config
from grpo.errors import UserError

MiB = 1 << 20
GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}
DEFAULT_PROMPT_TOKENS = 256  # the prompts' length planned for when neither the config nor --prompt-tokens says
# bitsandbytes' 4-bit weight, double-quantized as lora.quantize loads it: half a byte a value,
# a one-byte scale a block of 64 values and an fp32 one a block of 256 scales; and a layer's
# own 16-value code, 256-value code of the scales and offset, in fp32 (`four_bit_bytes`).
FOUR_BIT_BLOCK, SCALE_BLOCK, FOUR_BIT_LAYER = 64, 256, 4 * (16 + 256 + 1)
# bitsandbytes' 8-bit AdamW: one byte a moment value and an fp32 scale a block of 256; tensors
# under 4,096 values keep fp32 moments (docs/memory.md#the-optimizer).
EIGHT_BIT_BLOCK, EIGHT_BIT_FROM = 256, 4096
# The Rust tokenizer's resident memory a vocabulary entry: an estimate from the runtime that
# benchmarks/_memory_child.py reads with and without a 151,936-token tokenizer.
TOKENIZER_BYTES_PER_ENTRY = 330
# The (rows, V) float32 tensors a step of transformers' `generate` holds at once (its logits,
# their float32 copy, the probabilities, the draw's own): measured here on a 151,936-token
# vocabulary, about eight, whatever the completions' length.
GENERATE_VOCAB_ROWS = 8
# What a CUDA process holds on the GPU besides its tensors (the context, the kernels): an
# estimate, not measured here.
CUDA_CONTEXT = 512 * MiB


def parse_size(text: str) -> int:
    """A size as --memory takes it -> bytes: a number and a unit K, M, G or T (powers of 1024;
    an optional B or iB after it), or bytes without a unit. A bad value is one line."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtKMGT]?)(i?[bB])?\s*", str(text))
    if not found or (found.group(3) and not found.group(2) and found.group(3).lower() != "b"):
        raise UserError(f"--memory: {text!r} is not a size (e.g. 24G, 512M, 1.5T)")
    value = float(found.group(1)) * _UNITS[found.group(2).lower()]
    if value <= 0:
        raise UserError(f"--memory: {text!r} must be more than 0")
    return int(value)


def size_type(text: str) -> int:
    """parse_size as an argparse type: a bad value is argparse's one line."""
    import argparse

    try:
        return parse_size(text)
    except UserError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--memory: ")) from None


def megabytes(n: float) -> str:
    return f"{n / MiB:,.0f} MiB" if n < 10 * GiB else f"{n / GiB:,.1f} GiB"


# ---- the model's shape, from its config alone ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the planner reads of a model: its tensors' sizes (a tied head once), its linear
    layers (not the head), the head's (V, H) and the decoder's dimensions."""

    tensors: tuple[int, ...]
    linears: tuple[tuple[str, int, int], ...]  # (name, in_features, out_features)
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    model: object = dataclasses.field(compare=False, repr=False)  # the meta model: shapes, no memory

    @property
    def parameters(self) -> int:
        return sum(self.tensors)

    @property
    def head(self) -> int:
        return self.vocab * self.hidden


@functools.lru_cache(maxsize=16)
def model_shape(path: str, key: str = "model") -> Shape:
    """The shape of the causal LM at `path` from its config.json: the model is built on the
    meta device (no memory, no weights read)."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo.infra.hf import model_config

    config = model_config(path, key)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as err:  # an architecture transformers cannot build as a causal LM
        raise UserError(f"{key}: cannot build a causal LM from '{path}''s config ({err})") from None
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    linears = tuple(
        (name, m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    )
    text = getattr(config, "get_text_config", lambda: config)()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return Shape(
        tensors=tuple(p.numel() for p in model.parameters()),
        linears=linears,
        vocab=head.weight.shape[0],
        hidden=head.weight.shape[1],
        intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        layers=text.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        tied=head.weight is embed.weight,
        model=model,
    )


def _fused(model, dtype):
    """The fast loop's weights of `model` (a meta one: shapes only) in `dtype`, or None where
    the fast loop cannot run it (not a Llama-family layout)."""
    try:
        from grpo.rollout.fast.forward import fuse_weights

        return fuse_weights(model, dtype)
    except Exception:  # any layout fuse_weights does not know
        return None


def _lora_tensors(shape: Shape, r: int, targets) -> list[int]:
    """The adapters' tensors (A: r x in, B: out x r) of each targeted linear layer; peft's
    all-linear: every linear layer but the head."""
    names = None if targets == "all-linear" else {targets} if isinstance(targets, str) else set(targets)
    out = []
    for name, n_in, n_out in shape.linears:
        if names is None or name.rsplit(".", 1)[-1] in names:
            out += [r * n_in, n_out * r]
    return out


def _quantized(shape: Shape) -> int:
    """Values of the weights a 4-bit load quantizes: every linear layer's but the head's."""
    return sum(n_in * n_out for _, n_in, n_out in shape.linears)


def four_bit_bytes(n: int) -> int:
    """The bytes bitsandbytes holds for a weight of `n` values loaded in 4 bits (lora.quantize,
    double quantization): the packed values, a uint8 scale a block, an fp32 scale a block of
    scales, and the layer's codes and offset."""
    blocks = -(-n // FOUR_BIT_BLOCK)
    return -(-n // 2) + blocks + 4 * -(-blocks // SCALE_BLOCK) + FOUR_BIT_LAYER


def _largest_linear(shape: Shape, targets=None) -> int:
    """Values of the largest linear layer (not the head), among `targets` (lora.target_modules) if given."""
    names = None if targets in (None, "all-linear") else {targets} if isinstance(targets, str) else set(targets)
    return max(
        (n_in * n_out for name, n_in, n_out in shape.linears if names is None or name.rsplit(".", 1)[-1] in names),
        default=0,
    )


# ---- the accounting --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    """The facts of a config the accounting reads, resolved for the device."""

    device: str  # cpu | cuda
    dtype_bytes: int
    compute_bytes: int
    autocast: bool
    lora_r: int
    quantize: str
    beta: float
    critic: bool
    optimizer: str
    in_backward: bool
    reference_dtype: str
    sampler: str  # fast | hf | vllm | server
    rows: int  # completions a step
    prompts: int
    group: int
    generation_rows: int
    minibatch: int
    micro_rows: int
    micro_tokens: int
    prompt_tokens: int
    completion_tokens: int
    new_tokens: int  # rollout.max_new_tokens: the sampler's caches are sized for it
    checkpointing: bool
    chunked_head: bool
    layout: str
    eager: bool
    shared_draw: bool
    async_: bool


def settings(c: Config, device: str, prompt_tokens: int | None, completion_tokens: int | None) -> Settings:
    r, t = c.rollout, c.train
    dtype_bytes = 4 if t.dtype == "float32" else 2
    autocast = t.autocast == "bfloat16" or (t.autocast == "auto" and device == "cuda")
    rows = r.prompts_per_step * r.group_size
    minibatch = max(1, rows // max(1, t.minibatches))
    prompt = prompt_tokens or r.max_prompt_length or DEFAULT_PROMPT_TOKENS
    completion = min(completion_tokens or r.max_new_tokens, r.max_new_tokens)
    sampler = r.sampler
    if sampler == "auto" and c.lora.r > 0:  # the fast loop does not decode LoRA: generate does
        sampler = "hf"
    if sampler == "vllm":
        sampler = "server" if r.vllm.server else "vllm"
    import torch

    from grpo.infra.devices import attention_for

    attention = attention_for(t.attention, r.max_new_tokens, torch.device(device))
    return Settings(
        device=device,
        dtype_bytes=dtype_bytes,
        compute_bytes=2 if autocast else dtype_bytes,
        autocast=autocast,
        lora_r=c.lora.r,
        quantize=c.lora.quantize if c.lora.r > 0 else "none",
        beta=c.loss.beta,
        critic=c.loss.baseline == "critic",
        optimizer=t.optimizer,
        in_backward=t.optimizer_in_backward,
        reference_dtype=t.reference_dtype,
        sampler=sampler,
        rows=rows,
        prompts=r.prompts_per_step,
        group=r.group_size,
        generation_rows=min(rows, r.generation_batch_size or rows),
        minibatch=minibatch,
        micro_rows=min(minibatch, t.micro_batch_size or minibatch),
        micro_tokens=t.micro_batch_tokens,
        prompt_tokens=prompt,
        completion_tokens=completion,
        new_tokens=r.max_new_tokens,
        checkpointing=t.gradient_checkpointing,
        chunked_head=t.chunked_head,
        layout="packed" if t.layout == "auto" else t.layout,
        eager=attention == "eager",
        shared_draw=r.draw != "generate",
        async_=r.async_.max_staleness > 0,
    )


def _moment_bytes(tensors: list[int], s: Settings) -> int:
    if s.optimizer == "adamw_8bit":  # and the two 256-value fp32 quantization maps the tensors share
        maps = 2 * 256 * 4 if any(n >= EIGHT_BIT_FROM for n in tensors) else 0
        return maps + int(sum(2 * n + 8 * n / EIGHT_BIT_BLOCK if n >= EIGHT_BIT_FROM else 8 * n for n in tensors))
    return 2 * s.dtype_bytes * sum(tensors)  # AdamW's two moments in the parameters' dtype


def states(shape: Shape, s: Settings, c: Config) -> dict[str, int]:
    """The bytes each state of the run holds through a step."""
    p, b = shape.parameters, s.dtype_bytes
    if s.lora_r > 0:
        trained = _lora_tensors(shape, s.lora_r, c.lora.target_modules)
        base = p * b
        if s.quantize != "none":  # the linear layers in 4 bits, the rest (embeddings, norms, head) as loaded
            q = _quantized(shape)
            base = (p - q) * b + sum(four_bit_bytes(n_in * n_out) for _, n_in, n_out in shape.linears)
        weights = base + sum(trained) * b
    else:
        trained, weights = list(shape.tensors), p * b
    out = {
        "policy weights": weights,
        "gradients": (max(trained) if s.in_backward else sum(trained)) * b,
        "optimizer moments": _moment_bytes(trained, s),
    }
    if s.beta > 0 and s.lora_r == 0:  # LoRA's reference is the adapter off: no copy
        linear = _quantized(shape)
        if s.reference_dtype == "bfloat16":
            out["reference"] = 2 * p
        elif s.autocast:  # its linear layers stored in bf16, the rest as the policy's
            out["reference"] = 2 * linear + b * (p - linear)
        else:
            out["reference"] = b * p
    if s.critic:  # PPO's value model: the backbone (no LM head unless tied) and a scalar head, trained
        v = model_shape(c.value.model, "value.model") if c.value.model else shape
        backbone = v.parameters - (0 if v.tied else v.head) + v.hidden
        out["critic"] = backbone * (2 * b) + 2 * 4 * backbone
    reward_models = [r.model for r in c.rewards if r.model]
    if reward_models:
        total = 0
        for i, path in enumerate(reward_models):
            rm = model_shape(path, f"rewards.{i}.model")
            total += (rm.parameters - (0 if rm.tied else rm.head) + rm.hidden) * 4
        out["reward models"] = total
    return out


def _pass_tokens(s: Settings, rows: int) -> int:
    """Real tokens of a pass over `rows` completions in the layout (packed: a group's prompt
    once; shared: the prompts in a pass of their own; padded: every row in full)."""
    if s.layout == "padded":
        tokens = rows * (s.prompt_tokens + s.completion_tokens)
    else:
        tokens = rows * s.completion_tokens + math.ceil(rows / s.group) * s.prompt_tokens
    return min(tokens, s.micro_tokens) if s.micro_tokens else tokens


def _layer_values(shape: Shape, s: Settings) -> int:
    """Values a decoder layer's forward saves for its backward, a token (HF's Llama, as
    torch's saved-tensor hooks count them): each norm's input, normalised input and output,
    the rotated queries and the keys and values (repeated for grouped queries), the
    attention's output, the MLP's four (I)-wide tensors."""
    q = shape.heads * shape.head_dim
    return 6 * shape.hidden + 4 * q + 4 * shape.intermediate


def _scores_bytes(shape: Shape, s: Settings) -> int:
    """Eager attention's float32 probabilities, a token: a row of each head over its sequence."""
    return 4 * shape.heads * (s.prompt_tokens + s.completion_tokens) if s.eager else 0


def activations(shape: Shape, s: Settings) -> dict[str, int]:
    """The update's activations for its largest pass, with and without checkpointing, and the
    head's logits (its chunks, or all of them)."""
    tokens = _pass_tokens(s, s.micro_rows)
    c = s.compute_bytes
    layer = tokens * (_layer_values(shape, s) * c + _scores_bytes(shape, s))
    backward = layer  # the gradients in flight through a layer's backward: about what it saved
    checkpointed = tokens * shape.layers * shape.hidden * c + layer + backward
    full = shape.layers * layer + backward
    if s.chunked_head:  # a buffer of logits and one of their gradient, each a chunk of rows by a tile
        tile = min(shape.vocab, VOCAB_TILE)
        head = 2 * 4 * min(tokens, HEAD_SCRATCH // tile) * tile
    else:  # the logits, their float32 log-softmax and its gradient, whole
        head = tokens * shape.vocab * (c + 4 + 4)
    return {
        "tokens": tokens,
        "with checkpointing": checkpointed,
        "without checkpointing": full,
        "held": checkpointed if s.checkpointing else full,
        "head": head,
    }


def _generate_bytes(shape: Shape, s: Settings) -> int:
    """What a `generate` call (rollout.sampler hf, and auto with LoRA) holds of its own: its
    KV cache, every row's prompt and completion (one layer's twice for a moment, as the cache
    grows by concatenation), GENERATE_VOCAB_ROWS (rows, V) float32 tensors, and the
    prefill's widest activations (the MLP's gate and up, and the attention's)."""
    rows, total = s.generation_rows, s.prompt_tokens + s.new_tokens
    cache = (shape.layers + 1) * rows * total * 2 * shape.kv_heads * shape.head_dim * s.compute_bytes
    logits = GENERATE_VOCAB_ROWS * rows * shape.vocab * 4
    prefill = rows * s.prompt_tokens * (2 * shape.intermediate + 4 * shape.heads * shape.head_dim) * s.compute_bytes
    return cache + logits + prefill


def sampling(shape: Shape, s: Settings, gradients: int) -> dict[str, int]:
    """What sampling holds beside the states: its KV cache, logits and prefill as the fast
    loop sizes them (`grpo.rollout.fast.sampling_bytes`; generate's: `_generate_bytes`), the
    fast loop's stacked q/k/v and gate/up copies, and on a CPU the single matrices it packs
    in the room the gradients leave (`grpo.rollout.fast.pack_single_matrices`)."""
    from grpo.rollout.fast.decoding import SHARE_FROM, sampling_bytes
    from grpo.rollout.fast.forward import PACK_FROM, cache_bytes

    import torch

    if s.sampler == "hf":
        return {"kv cache and logits": _generate_bytes(shape, s), "fused copies": 0, "packed copies": 0}
    # On a GPU the cache is in the compute dtype, on a CPU in float32 (fast.cache_dtype).
    w = _fused(shape.model, torch.bfloat16 if s.device == "cuda" and s.compute_bytes == 2 else torch.float32)
    if s.sampler in ("vllm", "server") or w is None:
        return {"kv cache and logits": 0, "fused copies": 0, "packed copies": 0}
    rows, prompts = s.generation_rows, max(1, math.ceil(s.generation_rows / s.group))
    fast = s.sampler in ("fast", "auto")
    copies = rows - prompts  # fast.shares_prompts: one copy of a prompt's cache where the others would be large
    shared = fast and s.shared_draw and copies > 0 and cache_bytes(w, copies * s.prompt_tokens) >= SHARE_FROM
    own = sampling_bytes(w, prompts, s.prompt_tokens, rows, s.new_tokens, shared)
    packed = 0
    if fast and s.device == "cpu" and not s.in_backward and s.dtype_bytes == 4 and not s.autocast:
        room = gradients - own  # grpo.train.assembly.sampling_room, less the sampling's own
        for matrices in ([w.head], [x.down for x in w.layers], [x.out for x in w.layers]):
            size = sum(m.numel() * 4 for m in matrices)
            if all(m.numel() >= PACK_FROM for m in matrices) and size <= room:
                packed, room = packed + size, room - size
    stacked = sum(x.qkv.numel() + x.gate_up.numel() for x in w.layers)
    return {
        "kv cache and logits": own,
        "fused copies": stacked * s.compute_bytes if fast else 0,
        "packed copies": packed,
    }


def transients(shape: Shape, s: Settings, c: Config) -> dict[str, int]:
    """What LoRA and QLoRA hold for a moment beside the states: a 4-bit layer's weight
    dequantized for its matmul (the largest, in the compute dtype: bitsandbytes makes one a
    matmul, forward or backward); the adapters' outputs that `generate`, sampling with the
    adapter unmerged, adds to each adapted layer's in the prefill (A's r-wide one and B's,
    scaled); and the final save's copies: QLoRA's merge is written a tensor at a time (a weight
    dequantized, its adapter's delta and their sum: `grpo.train.models.save_dequantized`),
    LoRA's merges each layer's delta into its weight in place."""
    out = {"dequantized weight": 0, "adapter's activations": 0, "save's copies": 0}
    if s.lora_r == 0:
        return out
    largest = _largest_linear(shape, c.lora.target_modules)
    if s.quantize != "none":
        out["dequantized weight"] = _largest_linear(shape) * (2 if s.device == "cuda" else 4)
        out["save's copies"] = 3 * _largest_linear(shape) * s.dtype_bytes
    else:
        out["save's copies"] = largest * s.dtype_bytes
    if s.sampler == "hf" and largest:
        widest = max(n_out for _, _, n_out in shape.linears)
        out["adapter's activations"] = s.generation_rows * s.prompt_tokens * (s.lora_r + 2 * widest) * s.compute_bytes
    return out


def _vllm_share(shape: Shape, s: Settings, c: Config, memory: int | None) -> int | None:
    """The colocated engine's share: on a GPU, gpu_memory_utilization of the GPU (None where
    the GPU's size is not known); on a CPU its weights and kv_cache_gb."""
    if s.sampler != "vllm":
        return 0
    if s.device == "cuda":
        total = memory or _gpu_memory()
        return None if total is None else int(c.rollout.vllm.gpu_memory_utilization * total)
    weights = shape.parameters * (2 if c.rollout.vllm.dtype in ("bfloat16", "float16") else s.compute_bytes)
    return weights + c.rollout.vllm.kv_cache_gb * GiB


def _gpu_memory() -> int | None:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def runtime_bytes(shape: Shape) -> int:
    """What a run on a CPU holds besides its states: this process's resident memory (torch,
    transformers, grpo and the model's code, imported to build its shape) and its tokenizer."""
    return _resident() + TOKENIZER_BYTES_PER_ENTRY * shape.vocab


# The libraries a run imports as it builds its engine, in the order they are measured
# (peft imports bitsandbytes where installed: measured first, it is counted once).
LIBRARIES = ("bitsandbytes", "peft")
_LIBRARY_BYTES: dict[str, int] = {}


def library_bytes() -> dict[str, int]:
    """The resident bytes importing each of LIBRARIES adds in this process (after the model's
    code): what a run that uses it holds besides `runtime_bytes`. Measured once, as each is
    imported here; 0 for one imported before (unknown), or not installed."""
    import importlib
    import sys

    for name in LIBRARIES:
        if name not in _LIBRARY_BYTES:
            before, imported = _resident(), name in sys.modules
            try:
                importlib.import_module(name)
            except Exception:  # not installed, or failing to load: the run refuses it, not the plan
                imported = True
            _LIBRARY_BYTES[name] = 0 if imported else max(0, _resident() - before)
    return dict(_LIBRARY_BYTES)


def _libraries_used(s: Settings) -> tuple[str, ...]:
    """What of LIBRARIES the run imports: peft (and through it bitsandbytes) for LoRA,
    bitsandbytes for 8-bit moments or a 4-bit base."""
    if s.lora_r > 0:
        return LIBRARIES
    return ("bitsandbytes",) if s.optimizer == "adamw_8bit" else ()


def _resident() -> int:
    """This process's resident bytes now (Linux's VmRSS; elsewhere its peak)."""
    from grpo.infra.memory import peak_rss_mb

    try:
        found = re.search(r"^VmRSS:\s+(\d+)\s+kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        found = None
    return int(found.group(1)) * 1024 if found else int(peak_rss_mb() * MiB)


def predict(
    config: Config,
    *,
    device: str = "cpu",
    memory: int | None = None,
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
    runtime: int | None = None,
    libraries: dict[str, int] | None = None,
) -> dict:
    """The predicted bytes of each state and phase of a step of `config` on `device`, and the
    peak: {"components", "phases", "peak", "peak_phase", "activations", "assumed"}. `runtime`:
    the runtime's bytes (default: measured here on a CPU; the CUDA context's estimate on a GPU);
    `libraries`: what importing each of LIBRARIES adds (default: measured here with the runtime
    on a CPU, none given a runtime), counted for those the run imports; the result's
    "libraries" is that table."""
    shape = model_shape(config.model)
    s = settings(config, device, prompt_tokens, completion_tokens)
    held = states(shape, s, config)
    if runtime is None:
        runtime = CUDA_CONTEXT if device == "cuda" else runtime_bytes(shape)
        if libraries is None and device == "cpu":
            libraries = library_bytes()
    libraries = libraries or {}
    imported = sum(libraries.get(name, 0) for name in _libraries_used(s))
    acts = activations(shape, s)
    draw = sampling(shape, s, held["gradients"])
    share = _vllm_share(shape, s, config, memory)
    fixed = runtime + imported + sum(v for k, v in held.items() if k != "gradients") + (share or 0)
    no_grad = (
        _pass_tokens(s, s.micro_rows)
        * (
            (2 * shape.hidden + 3 * shape.intermediate + 4 * shape.heads * shape.head_dim) * s.compute_bytes
            + _scores_bytes(shape, s)
        )
        + acts["head"]
    )
    extra = transients(shape, s, config)
    phases = {
        "sample": fixed + sum(draw.values()) + extra["dequantized weight"] + extra["adapter's activations"],
        "passes": fixed + no_grad + extra["dequantized weight"],
        "update": fixed + held["gradients"] + acts["held"] + acts["head"] + extra["dequantized weight"],
        "save": fixed + extra["save's copies"],
    }
    if s.sampler == "vllm" and s.device == "cuda" and config.rollout.vllm.sleep:
        phases["update"] -= share or 0  # the engine sleeps through the update
    if s.async_ and s.device == "cpu":  # the generator process: its own copy of the weights and its sampling
        phases["sample"] += held["policy weights"]
    peak_phase = max(phases, key=phases.get)
    return {
        "device": device,
        "model": config.model,
        "parameters": shape.parameters,
        "components": {"runtime": runtime}
        | ({"libraries": imported} if imported else {})
        | {**held, **draw, "activations": acts["held"], "head": acts["head"]}
        | {k: v for k, v in extra.items() if v}
        | ({"vllm engine": share} if s.sampler == "vllm" else {}),
        "activations": acts,
        "phases": phases,
        "peak": phases[peak_phase],
        "peak_phase": peak_phase,
        "libraries": libraries,
        "vllm_share_known": share is not None,
        "assumed": {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens,
            "layout": s.layout,
            "attention": "eager" if s.eager else "sdpa",
            "sampler": s.sampler,
        },
    }
