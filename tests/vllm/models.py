"""Tiny models vLLM's CPU attention runs (head_dim 64), saved with a character tokenizer."""

from pathlib import Path

import torch

from grpo.tasks.tiny import char_tokenizer
from tests.helpers import scale_of

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz "


def build(kind: str, tokenizer, *, std: float = 0.1, seed: int = 0):
    """'qwen2': tied embeddings, QKV bias on (Qwen2's); 'llama': an untied head, no bias.
    Hidden 128, 2 heads of 64 (1 KV head for Qwen2), 2 layers; weights N(0, std) so that the
    distributions are far from uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if kind == "qwen2":
        cls, config = Qwen2ForCausalLM, Qwen2Config(**shape, num_key_value_heads=1, tie_word_embeddings=True)
    else:
        cls, config = LlamaForCausalLM, LlamaConfig(**shape, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(config)
        for name, p in model.named_parameters():
            if "norm" not in name:
                torch.nn.init.normal_(p, std=std)
    return model.eval()


def save(kind: str, directory: Path, **kw) -> Path:
    tokenizer = char_tokenizer(ALPHABET)
    build(kind, tokenizer, **kw).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# The engine's log-probs of the tokens it drew against the trainer's, in fp32. On this project's
# hosts the gap is ~1e-5 a token at worst; a CI host once showed one token of 192 at 2.6e-4
# (vLLM's CPU kernels are picked per instruction set). A wrong weight sync, temperature or
# penalty moves every token by 1e-2 or more (a LoRA scale off by 10%: 0.3), so the bound is
# tight on the average and allows one kernel's rounding at the worst token.
WORST_GAP, MEAN_GAP = 1e-3, 2e-5


def assert_same_logprobs(engine: torch.Tensor, trainer: torch.Tensor) -> None:
    """`engine` and `trainer` (the valid tokens' log-probs) agree: each within WORST_GAP, their
    mean gap within MEAN_GAP, both times the log-probs' scale where it is above 1 (rounding
    grows with the logits)."""
    scale = max(1.0, scale_of(engine, trainer))
    torch.testing.assert_close(engine, trainer, atol=WORST_GAP * scale, rtol=0)
    gap = float((engine - trainer).abs().mean())
    assert gap < MEAN_GAP * scale, f"mean gap {gap:.2e} over {engine.numel()} tokens (scale {scale:.2g})"
