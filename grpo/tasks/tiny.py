"""Tiny Llama-style models and character-level tokenizers, built from a config.

Tests and the demo must run with no hub download. These build a real Hugging Face model
and tokenizer and save them with `save_pretrained`, so everything downstream loads them
through the same `from_pretrained` path as a user's hub model.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


def char_tokenizer(alphabet: str):
    """A character-level `PreTrainedTokenizerFast`: one token per character of `alphabet`,
    plus <pad> (0), <s> (1), </s> (2, EOS) and <unk> (3). Built with `tokenizers`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))  # unique, in order
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character
    core.decoder = decoders.Fuse()  # join the characters back without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_llama(
    tokenizer,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    intermediate_size: int | None = None,
    max_positions: int = 256,
    seed: int = 0,
):
    """A randomly initialised `LlamaForCausalLM` sized for a CPU, matching `tokenizer`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def save_tiny_model(directory: str | Path, alphabet: str, **model_kwargs) -> Path:
    """Build a tiny model and its tokenizer and save both to `directory` (a HF model dir)."""
    directory = Path(directory)
    tokenizer = char_tokenizer(alphabet)
    tiny_llama(tokenizer, **model_kwargs).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
