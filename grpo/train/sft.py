"""Supervised fine-tuning (SFT) before RL: `grpo sft --model M --data FILE` fine-tunes a causal
LM on the user's rows (`FineTuneConfig`); `grpo sft --task arithmetic` trains the demo's tiny
Llama from scratch (`SFTConfig`).

RL moves a policy only once it solves some prompts some of the time (a group whose samples
all earn one reward teaches nothing), so `sft` trains briefly to get there, not to
convergence. Both modes share one loop (`_fit`: AdamW, warm-up then cosine, next-token loss
on the completion and its EOS only), encode a context exactly as the RL sampler encodes a
prompt (`encode_pieces`; the data's shaping is grpo.train.sft_data), and draw everything
from `seed`. The user's guide: docs/sft.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from grpo.config.fields import REQUIRED, opt
from grpo.errors import UserError
from grpo.infra.contain import run_workers
from grpo.train.sft_data import (
    IGNORE_INDEX,
    completion_batch,
    conversation_pieces,
    encode_pieces,
    encode_rows,
    fit_length,
    load_rows,
    padding_id,
    shuffled_batches,
)

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "FineTuneConfig",
    "SFTConfig",
    "completion_batch",
    "completion_loss",
    "conversation_pieces",
    "encode_pieces",
    "sft",
    "sft_sequence_length",
]


@dataclass(frozen=True)
class SFTConfig:
    """The from-scratch warm-up's settings; the defaults are the demo's. pass@k by number of
    updates, and its spread over seeds: benchmarks/README.md ("grpo sft --task arithmetic")."""

    task: str = opt("arithmetic", "The built-in task to learn; only arithmetic (addition with worked column steps).")
    digits: int | list[int] = opt(
        2,
        "Digits of each operand of the training problems; several (a list, or 2,3 on the command line) mix "
        "lengths, each problem's digits drawn uniformly from them.",
    )
    steps: int = opt(375, "Optimizer updates: the knob that sets how good the model gets (fewer = weaker).")
    batch_size: int = opt(64, "Problems per update (each one prompt + solution + EOS).")
    lr: float = opt(1e-3, "Peak AdamW learning rate (from-scratch models under ~1M parameters: ~1e-3).")
    warmup_steps: int = opt(30, "Updates of linear warm-up from lr/warmup_steps to lr; cosine decay to 0 after.")
    weight_decay: float = opt(0.0, "AdamW's decoupled weight decay.")
    hidden_size: int = opt(64, "Width of the model (the MLP is twice as wide).")
    layers: int = opt(2, "Transformer blocks.")
    heads: int = opt(4, "Attention heads; must divide the width (hidden_size).")
    seed: int = opt(0, "Seeds the weights' initialisation and the stream of training problems.")
    max_positions: int = opt(64, "The model's max_position_embeddings: the longest sequence it can ever handle.")


@dataclass(frozen=True)
class FineTuneConfig:
    """Fine-tuning an existing causal LM on the user's rows (docs/sft.md). The defaults are a
    light fine-tuning of a pretrained model: a warm-up teaches the task's format, it does not
    rewrite the model."""

    model: str = opt(REQUIRED, "The model to start from: a Hugging Face directory or hub id (as `grpo train`'s model).")
    data: str = opt(
        REQUIRED,
        "The rows: anything `grpo train`'s data.path takes (.jsonl, .json, .parquet, .csv, a datasets directory "
        "or name).",
    )
    prompt_column: str = opt(
        "prompt", "The prompt/completion shape: the column of the prompts (a string or chat messages)."
    )
    completion_column: str = opt("completion", "The prompt/completion shape: the column of the completions to learn.")
    messages_column: str | None = opt(
        None,
        "The conversational shape: the column of the conversations (lists of chat messages) whose assistant "
        "messages are learned. Default: the prompt/completion shape, or messages when the rows have no prompt column.",
    )
    epochs: int = opt(3, "Passes over the rows (unless `steps` says how many updates).")
    steps: int | None = opt(None, "Optimizer updates, instead of passes over the rows. Default: `epochs` passes.")
    batch_size: int = opt(8, "Rows per update.")
    lr: float = opt(1e-5, "Peak AdamW learning rate: a pretrained model needs a small one (TRL's SFT default is 2e-5).")
    warmup_steps: int | None = opt(
        None, "Updates of linear warm-up, cosine decay to 0 after. Default: a tenth of the updates."
    )
    weight_decay: float = opt(0.0, "AdamW's decoupled weight decay.")
    max_grad_norm: float = opt(
        1.0, "Clip the gradient norm to this (0 = no clipping), as `grpo train` does by default."
    )
    max_length: int | None = opt(
        None,
        "Longest sequence in tokens: longer rows keep their last tokens (the prompt loses its start), with a "
        "warning. Default: none; a row longer than the model's positions is an error.",
    )
    dtype: Literal["float32", "bfloat16"] = opt(
        "float32",
        "Dtype of the weights, gradients and optimizer state (train.dtype's values); on a GPU the forward runs in "
        "bf16 either way.",
    )
    layout: Literal["auto", "packed", "padded"] = opt(
        "auto",
        "How a batch's rows go through the model. auto: packed (no padding computed) where that gives the model's "
        "own outputs, else padded; packed: that or, with a warning, padded; padded: every row to the longest.",
    )
    lora_r: int = opt(0, "LoRA rank (0 = full fine-tuning; needs peft).")
    lora_alpha: float = opt(16.0, "LoRA alpha.")
    lora_target_modules: str | tuple[str, ...] = opt(
        "all-linear", "Modules to adapt (peft's target_modules; several comma-separated on the command line)."
    )
    lora_save: Literal["merged", "adapter", "both"] = opt(
        "merged",
        "With LoRA, what the output holds (as grpo train's lora.save): the adapter merged into the model, the "
        "adapter alone (peft's files, which grpo train's lora.init_adapter starts from), or both (the adapter in "
        "adapter/).",
    )
    seed: int = opt(0, "Seeds the order of the rows and a LoRA adapter's initialisation.")


def sft_sequence_length(digits: int) -> int:
    """Tokens in the longest training sequence for `digits`-digit operands: the prompt
    "A+B=" (2d + 2), d steps of 8 characters with d - 1 ';' between them, '>', an answer
    of up to d + 1 digits, and EOS. 28 for 2 digits."""
    return (2 * digits + 2) + (8 * digits + digits - 1) + 1 + (digits + 1) + 1


def digit_choices(digits: int | list[int]) -> list[int]:
    """SFTConfig.digits as the list of operand lengths the problems are drawn from."""
    return list(digits) if isinstance(digits, (list, tuple)) else [digits]


def _validate(config: SFTConfig) -> None:
    from grpo.tasks.arithmetic import MAX_DIGITS

    c = config
    if c.task != "arithmetic":
        raise UserError(f"sft: unknown task {c.task!r}; the built-in task is 'arithmetic'")
    lengths = digit_choices(c.digits)
    if not lengths or not all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= MAX_DIGITS for d in lengths):
        raise UserError(f"sft: digits must be between 1 and {MAX_DIGITS} (one number or a list), got {c.digits}")
    for name in ("steps", "batch_size", "hidden_size", "layers", "heads", "max_positions"):
        if getattr(c, name) < 1:
            raise UserError(f"sft: {name} must be a positive integer, got {getattr(c, name)}")
    if not c.lr > 0:
        raise UserError(f"sft: lr must be positive, got {c.lr}")
    if c.warmup_steps < 0 or c.weight_decay < 0:
        raise UserError(f"sft: warmup_steps and weight_decay must be >= 0, got {c.warmup_steps} and {c.weight_decay}")
    if c.hidden_size % c.heads:
        raise UserError(f"sft: heads ({c.heads}) must divide hidden_size ({c.hidden_size})")
    if sft_sequence_length(max(lengths)) > c.max_positions:
        raise UserError(
            f"sft: {max(lengths)}-digit problems need {sft_sequence_length(max(lengths))} positions, "
            f"more than max_positions={c.max_positions}"
        )


def _validate_fine_tune(c: FineTuneConfig) -> None:
    from grpo.infra.hf import torch_dtype

    for name in ("model", "data"):
        if not getattr(c, name).strip():
            raise UserError(f"sft: {name} is empty")
    for name in ("epochs", "batch_size", "lora_r", "steps", "warmup_steps", "max_length"):
        value, least = getattr(c, name), 0 if name in ("lora_r", "warmup_steps") else 1
        if value is not None and value < least:
            raise UserError(f"sft: {name} must be {'>= 0' if least == 0 else 'a positive integer'}, got {value}")
    if c.lora_save not in ("merged", "adapter", "both"):
        raise UserError(f"sft: lora_save must be merged, adapter or both, got {c.lora_save!r}")
    if c.lora_save != "merged" and not c.lora_r:
        raise UserError(f"sft: lora_save {c.lora_save} keeps an adapter: set lora_r > 0")
    for name in ("lr", "lora_alpha"):
        if not getattr(c, name) > 0:
            raise UserError(f"sft: {name} must be positive, got {getattr(c, name)}")
    if c.weight_decay < 0 or c.max_grad_norm < 0:
        raise UserError(f"sft: weight_decay and max_grad_norm must be >= 0, got {c.weight_decay} and {c.max_grad_norm}")
    if c.max_length is not None and c.max_length < 2:
        raise UserError(f"sft: max_length must be at least 2 (a token and the EOS), got {c.max_length}")
    if c.prompt_column == c.completion_column:
        raise UserError(f"sft: the prompt and completion columns are both {c.prompt_column!r}")
    torch_dtype(c.dtype, "sft: dtype")


# ---- the loss, on a padded or a packed batch ------------------------------------------------


def packed_batch(model, batch: dict[str, Tensor]) -> dict[str, Tensor] | None:
    """A right-padded batch (`pad`'s) in the packed layout (grpo.infra.packing.pack_sequences):
    the rows' real tokens end to end in a few bins, positions restarting at each sequence, a
    4-D mask keeping each token within its own, and the labels moved with their tokens; each
    sequence's first label dropped, as the shifted loss never reads it (the slot before it is
    another sequence's). `completion_loss` on it learns the same targets from the same
    contexts as on the padded batch. None where the rows are not whole right-padded runs."""
    import torch

    from grpo.infra import attention
    from grpo.infra.packing import mask_dtype, pack_sequences

    packed = pack_sequences(batch["input_ids"], batch["attention_mask"])
    if packed is None:
        return None
    labels = torch.full(packed.input_ids.shape, IGNORE_INDEX, dtype=torch.long, device=packed.input_ids.device)
    real = batch["attention_mask"].bool()
    labels.view(-1)[packed.index[real]] = batch["labels"][real]
    labels.view(-1)[packed.index[:, 0]] = IGNORE_INDEX
    return {
        "input_ids": packed.input_ids,
        "attention_mask": packed.attention_mask(mask_dtype(model)),
        "position_ids": packed.position_ids,
        "labels": labels,
        **attention.arguments(model, packed.units, packed.branches),
    }


def completion_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Next-token cross-entropy: position t predicts labels[t + 1]; IGNORE_INDEX labels are
    skipped and the mean is over the rest. logits (B, L, V), labels (B, L)."""
    import torch.nn.functional as F

    predicted = logits[:, :-1].float()  # (B, L-1, V): the prediction made at each position
    targets = labels[:, 1:]  # (B, L-1): the token that follows it
    return F.cross_entropy(predicted.reshape(-1, predicted.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)


# ---- the training loop both modes share --------------------------------------------------------


def _fit(
    model,
    batches: Iterator[dict],
    *,
    steps: int,
    lr: float,
    warmup_steps: int,
    weight_decay: float,
    device,
    max_grad_norm: float = 0.0,
    compute_dtype=None,
    progress: bool = True,
    log_every: int = 10,
    packed: bool = False,
) -> list[float]:
    """`steps` AdamW updates of `model`'s trainable parameters, one per batch of `batches`,
    on `completion_loss`; the learning rate warms up linearly over `warmup_steps`, then
    decays to 0 on a cosine. `compute_dtype`: the forward's autocast dtype (None: the
    weights' own). `packed`: each batch's forward in the packed layout (`packed_batch`: no
    padding computed; the same loss to float rounding). Progress: a bar on a terminal, else a
    line every `log_every` updates (`grpo.infra.progress`). Returns each update's loss."""
    import torch

    from grpo.infra.progress import Progress

    from grpo.train.models import autocast, trainable_parameters
    from grpo.train.schedule import lr_lambda

    parameters = trainable_parameters(model)
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda("cosine", warmup_steps, steps))
    losses: list[float] = []
    bar = Progress(steps, desc="sft", prefix="grpo sft", every=log_every, enabled=progress)
    try:
        for batch in itertools.islice(batches, steps):
            batch = {key: value.to(device) for key, value in batch.items()}
            with autocast(model, compute_dtype):  # the packed mask in the dtype the forward computes in
                batch = (packed and packed_batch(model, batch)) or batch
                labels = batch.pop("labels")
                logits = model(**batch, use_cache=False).logits
            loss = completion_loss(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            bar.update(1, loss=losses[-1])
    finally:
        bar.close()
        optimizer.zero_grad(set_to_none=True)
    return losses


def _check_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"output: '{out}' exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"output: '{out}' is not empty; pass --overwrite to write into it, or choose another")


def _save(out: Path, model, tokenizer, provenance: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _write_provenance(out, provenance)


def _write_provenance(out: Path, provenance: dict) -> None:
    (out / "sft_config.json").write_text(json.dumps(provenance, indent=2) + "\n")  # the settings it was made with


@run_workers()  # any worker it starts stops with it
def sft(
    output: str | Path,
    config: SFTConfig | FineTuneConfig = SFTConfig(),
    *,
    progress: bool = True,
    overwrite: bool = False,
    device: str = "auto",
    log_every: int = 10,
) -> dict:
    """Train and save a model to `output`, a Hugging Face directory (model, tokenizer and
    sft_config.json, the settings it was made with) that `grpo train` starts from.

    `SFTConfig`: a tiny Llama from scratch on the task's worked solutions, with its character
    tokenizer. `FineTuneConfig`: the config's model fine-tuned on its rows. Refuses a
    non-empty `output` unless `overwrite`. Trains on `device` (auto: a CUDA GPU when there is
    one). Progress: a bar on a terminal, else a line every `log_every` updates. Checks
    everything before training. Returns {"output", "steps", "loss/first",
    "loss/last" (the first and the last update's loss), "parameters", "time_s"} and, when
    fine-tuning, "model", "rows", "epochs", "truncated" and "trainable_parameters".
    """
    if isinstance(config, FineTuneConfig):
        return _fine_tune(output, config, progress=progress, overwrite=overwrite, device=device, log_every=log_every)

    from grpo.infra.devices import resolve_device
    from grpo.tasks import arithmetic
    from grpo.tasks.tiny import char_tokenizer, tiny_llama
    from grpo.train.models import count_parameters

    c = config
    _validate(c)
    out = Path(output)
    _check_output(out, overwrite)
    where = resolve_device(device, "--device")

    started = time.perf_counter()
    tokenizer = char_tokenizer(arithmetic.ALPHABET)
    model = tiny_llama(
        tokenizer, hidden_size=c.hidden_size, layers=c.layers, heads=c.heads, max_positions=c.max_positions, seed=c.seed
    ).to(where)
    model.eval()  # dropout off; gradients flow regardless of the mode

    def problems() -> Iterator[dict]:
        rng = random.Random(c.seed)  # private: the global random state is neither read nor moved
        lengths = digit_choices(c.digits)
        while True:  # one length: the same problems as before mixes existed (no draw of the length)
            drawn = [
                arithmetic.make_problem(rng, rng.choice(lengths) if len(lengths) > 1 else lengths[0])
                for _ in range(c.batch_size)
            ]
            yield completion_batch(tokenizer, [p.prompt for p in drawn], [p.solution for p in drawn])

    losses = _fit(
        model,
        problems(),
        steps=c.steps,
        lr=c.lr,
        warmup_steps=c.warmup_steps,
        weight_decay=c.weight_decay,
        device=where,
        progress=progress,
        log_every=log_every,
    )
    _save(out, model, tokenizer, dataclasses.asdict(c))
    return {
        "output": str(out),
        "steps": c.steps,
        "loss/first": losses[0],
        "loss/last": losses[-1],
        "parameters": count_parameters(model),
        "time_s": round(time.perf_counter() - started, 2),
    }


# ---- fine-tuning on the user's rows ------------------------------------------------------------


def _warn(message: str) -> None:
    print(f"grpo sft: warning: {message}", file=sys.stderr, flush=True)


def _fine_tune(
    output: str | Path, c: FineTuneConfig, *, progress: bool, overwrite: bool, device: str, log_every: int = 10
) -> dict:
    import torch

    from grpo.infra.devices import attention_for, autocast_dtype, resolve_device
    from grpo.infra.hf import context_length, load_causal_lm, load_tokenizer
    from grpo.train.models import adapter_folder, apply_lora, count_parameters, save_adapter, trainable_parameters

    _validate_fine_tune(c)
    out = Path(output)
    _check_output(out, overwrite)
    where = resolve_device(device, "--device")

    started = time.perf_counter()
    tokenizer = load_tokenizer(c.model, "--model")
    if tokenizer.eos_token_id is None:
        raise UserError(
            f"--model: the tokenizer of '{c.model}' has no EOS token, so the end of a completion cannot be learned"
        )
    shape, rows = load_rows(c)
    examples, last_only = encode_rows(rows, shape, c, tokenizer)
    longest = max(len(ids) for ids, _ in examples)
    model = load_causal_lm(
        c.model,
        c.dtype,
        key="--model",
        device=where,
        attention=attention_for("auto", min(longest, c.max_length or longest), where),
    )
    examples, cut = fit_length(examples, context_length(model), c.max_length, c.data)
    if last_only:
        _warn(
            f"in {last_only} of {len(rows)} rows the chat template does not render the conversation turn by turn "
            "(it rewrites earlier turns, or ends a turn with something other than EOS): only the last assistant message is learned"
        )
    if cut:
        _warn(
            f"{cut} of {len(rows)} rows are longer than --max-length {c.max_length} tokens: each keeps its last "
            f"{c.max_length} (the prompt loses its start)"
        )
    if c.lora_r:
        with torch.random.fork_rng(devices=[where] if where.type == "cuda" else []):
            torch.manual_seed(c.seed)  # the adapter's initialisation, without moving the global state
            model = apply_lora(
                model,
                c.lora_r,
                c.lora_alpha,
                list(c.lora_target_modules) if isinstance(c.lora_target_modules, tuple) else c.lora_target_modules,
            )

    packed = False
    if c.layout != "padded":  # decided once, as grpo train decides: by a probe against the padded forward
        from grpo.train.layouts import PACKED, decide_layouts

        packed = decide_layouts(model, False, "auto" if c.layout == "auto" else PACKED, key="--layout").plain == PACKED
    steps = c.steps or c.epochs * math.ceil(len(examples) / c.batch_size)
    warmup = steps // 10 if c.warmup_steps is None else c.warmup_steps
    trainable = sum(p.numel() for p in trainable_parameters(model))
    losses = _fit(
        model,
        shuffled_batches(examples, c.batch_size, c.seed, padding_id(tokenizer)),
        steps=steps,
        lr=c.lr,
        warmup_steps=warmup,
        weight_decay=c.weight_decay,
        device=where,
        max_grad_norm=c.max_grad_norm,
        compute_dtype=autocast_dtype("auto", where),
        progress=progress,
        log_every=log_every,
        packed=packed,
    )
    provenance = {**dataclasses.asdict(c), "shape": shape, "rows": len(rows), "steps_run": steps}
    adapter = adapter_folder(out, c.lora_save) if c.lora_r else None
    if adapter is not None:  # peft's files, which grpo train's lora.init_adapter takes
        save_adapter(model, adapter)
        tokenizer.save_pretrained(adapter)
    if adapter != out:
        if hasattr(model, "merge_and_unload"):  # LoRA: plain weights, which any loader reads
            model = model.merge_and_unload()
        _save(out, model, tokenizer, provenance)
    else:
        _write_provenance(out, provenance)
    return {
        "output": str(out),
        "model": c.model,
        "rows": len(rows),
        "steps": steps,
        "epochs": round(steps / math.ceil(len(rows) / c.batch_size), 2),
        "loss/first": losses[0],
        "loss/last": losses[-1],
        "truncated": cut,
        "parameters": count_parameters(model),
        "trainable_parameters": trainable,
        "time_s": round(time.perf_counter() - started, 2),
    }
