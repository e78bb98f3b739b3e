"""train.optimizer's choices side by side: the optimizer state each holds and the time of its step.

    .venv/bin/python benchmarks/bench_optimizer.py [--shape smollm2|tiny] [--steps 5] [--threads N]

A Llama of SmolLM2-135M-Instruct's shape (hidden 576, 30 layers, vocabulary 49,152, tied
embedding; random weights, no download) or the tests' tiny model; every optimizer gets the
same seeded gradients for --steps steps (no forward or backward: the step alone is timed, the
first one apart, as it allocates the state). Printed per optimizer: the bytes of its state
per parameter, the median step time after the first, and how far its weights' total update
is from AdamW's (relative L2 over all weights). torchao's AdamW8bit is measured too where
torchao is installed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def model_of(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {
        "smollm2": dict(
            hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536
        ),
        "tiny": dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128
        ),
    }[shape]
    vocab = 49152 if shape == "smollm2" else 18
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, tie_word_embeddings=shape == "smollm2", **sizes))


def optimizers() -> dict:
    from grpo.train.optimizers import OPTIMIZERS

    made = {
        name: (lambda params, make=make: make([{"params": params, "lr": 1e-3}], 1e-3, (0.9, 0.999), 0.0))
        for name, make in OPTIMIZERS.items()
    }
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        return made
    made["torchao AdamW8bit"] = lambda params: AdamW8bit(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    return made


def state_bytes(optimizer) -> int:
    def size(value) -> int:
        if isinstance(value, dict):
            return sum(size(v) for v in value.values())
        if isinstance(value, torch.Tensor):
            inner = getattr(value, "__tensor_flatten__", None)  # a tensor subclass (torchao): its parts
            if inner is not None:
                return sum(size(getattr(value, name)) for name in inner()[0])
            return value.numel() * value.element_size()
        return 0

    return sum(size(s) for s in optimizer.state.values())


def run(shape: str, steps: int) -> None:
    start = model_of(shape)
    n = sum(p.numel() for p in start.parameters())
    print(f"{shape}: {n:,} parameters, {steps} steps, {torch.get_num_threads()} threads")
    print(f"{'optimizer':20s} {'state B/param':>13s} {'first step s':>12s} {'step s':>8s} {'update vs adamw':>16s}")
    initial = [p.detach().clone() for p in start.parameters()]
    updates = {}
    for name, make in optimizers().items():
        model = model_of(shape)
        params = list(model.parameters())
        optimizer = make(params)
        g = torch.Generator().manual_seed(1)
        times = []
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) * 1e-2
            began = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - began)
        with torch.no_grad():
            updates[name] = torch.cat([(p - p0).flatten() for p, p0 in zip(params, initial)])
        exact = updates.get("adamw")
        error = float((updates[name] - exact).norm() / exact.norm()) if exact is not None else float("nan")
        later = statistics.median(times[1:]) if len(times) > 1 else float("nan")
        print(f"{name:20s} {state_bytes(optimizer) / n:13.2f} {times[0]:12.3f} {later:8.3f} {error:16.4f}")
        del model, params, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args.shape, args.steps)


if __name__ == "__main__":
    main()
