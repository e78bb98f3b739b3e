"""Where the tensors live: `train.device` (and the `--device` of `grpo eval`, `sft`, `rm`).

`auto` is CUDA when torch sees a GPU, else the CPU. Under torchrun each process takes the
GPU of its local rank (`cuda` then means `cuda:LOCAL_RANK`). A device that cannot be had is a
`UserError` raised before any model is loaded.

Some defaults depend on the device, because what is fast on one is slow on the other:
- `train.autocast: auto` is bfloat16 on a GPU (weights, gradients and optimizer state stay
  in `train.dtype`), off on a CPU (bf16 matmuls only pay on CPUs with AMX/AVX512-BF16, and
  only for models large enough: benchmarks/README.md);
- a bf16-stored reference computes in bf16 only where the device does natively (`native`);
- `train.attention: auto` is eager attention on a CPU for short sequences (its backward is
  the faster one there) and the model's default (SDPA, fused kernels) on a GPU.
"""

from __future__ import annotations

import os

import torch

from grpo.errors import UserError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(name: str, key: str = "train.device", *, local_rank: int | None = None) -> torch.device:
    """`name` as a torch.device; `local_rank` (torchrun's LOCAL_RANK by default) picks the GPU
    of this process when `name` is `auto` or `cuda` without an index."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"{key}: unknown device {name!r} ({DEVICE_CHOICES})") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"{key}: {name!r} is not supported ({DEVICE_CHOICES})")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(
                f"{key}: {name} asked for, but torch sees no CUDA device (this torch: {torch.__version__}); use cpu or auto"
            )
        index = local_rank if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise UserError(f"{key}: {name} asked for (GPU {index}), but torch sees {torch.cuda.device_count()} GPU(s)")
        device = torch.device("cuda", index)
    return device


def autocast_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """train.autocast -> the compute dtype of the forward passes (None = the weights' own)."""
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    return {"off": None, "bfloat16": torch.bfloat16}[choice]


def native(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `device` computes matmuls in `dtype` natively: a GPU (bf16 from Ampere on), a CPU
    with AVX-512 BF16 or AMX for bf16 (an AVX2-only CPU runs bf16 matmuls several times slower
    than float32 ones); float32 everywhere."""
    if dtype in (torch.float32, torch.float64):
        return True
    if device.type == "cuda":
        return dtype != torch.bfloat16 or torch.cuda.is_bf16_supported()
    if device.type == "cpu" and dtype == torch.bfloat16:
        cpu = torch.cpu
        return any(
            getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        )
    return False


def attention_for(choice: str, max_new_tokens: int, device: torch.device = torch.device("cpu")) -> str | None:
    """train.attention -> transformers' attn_implementation (None = the model's default).
    auto: on a CPU, eager attention for short sequences, where the fused SDPA kernel's CPU
    backward is the slower one (benchmarks/README.md); eager holds the (B, heads, T, T)
    scores, so beyond 512 new tokens it keeps the default. On a GPU, the default (SDPA)."""
    if choice == "auto":
        return "eager" if device.type == "cpu" and max_new_tokens <= 512 else None
    return choice
