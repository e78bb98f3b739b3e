"""Tiny Llama-style models and character-level tokenizers, built from a config.

Tests and the demo must run with no hub download. These build a real Hugging Face model
and tokenizer and save them with `save_pretrained`, so everything downstream loads them
through the same `from_pretrained` path as a user's hub model.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


def char_tokenizer(alphabet: str, *, newlines: bool = False):
    """A character-level `PreTrainedTokenizerFast`: one token per character of `alphabet`,
    plus <pad> (0), <s> (1), </s> (2, EOS) and <unk> (3). Built with `tokenizers`. With
    `newlines`, a newline is a character too (put it in `alphabet`); without, as before."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))  # unique, in order
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    pattern = Regex(".|\n") if newlines else Regex(".")
    core.pre_tokenizer = pre_tokenizers.Split(pattern, behavior="isolated")  # every character
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


# A chat template of our own in the Qwen2.5 / Hermes tool-call format (what `grpo.rollout.tools`
# parses): the tools' schemas in the system turn, a call as a <tool_call> block of JSON in the
# assistant's turn, tool messages as <tool_response> blocks of a user turn.
TOOL_CHAT_TEMPLATE = (  # transformers renders with trim_blocks: a newline after a tag is written {{ nl }}
    "{% set nl = '\\n' %}"
    "{% if tools %}<|im_start|>system{{ nl }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{{ nl }}{{ nl }}{% endif %}"
    "Tools, one JSON schema a line:{{ nl }}<tools>{{ nl }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ nl }}{% endfor %}</tools>{{ nl }}"
    'Call one as <tool_call>{{ nl }}{"name": name, "arguments": {...}}{{ nl }}</tool_call><|im_end|>{{ nl }}'
    "{% elif messages[0].role == 'system' %}<|im_start|>system{{ nl }}{{ messages[0].content }}<|im_end|>{{ nl }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ nl }}<tool_response>{{ nl }}{{ m.content }}{{ nl }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ nl }}{% endif %}"
    "{% elif m.role != 'system' %}<|im_start|>{{ m.role }}{{ nl }}{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}"
    "{% if m.content or not loop.first %}{{ nl }}{% endif %}"
    '<tool_call>{{ nl }}{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "{{ nl }}</tool_call>"
    "{% endfor %}<|im_end|>{{ nl }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ nl }}{% endif %}"
)
TOOL_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n{}[]\":,._-<>/|=+*()?!'#"


def tool_chat_tokenizer(alphabet: str = TOOL_ALPHABET):
    """A character tokenizer that speaks the tool-call format: ChatML turns (<|im_start|>,
    <|im_end|> the EOS), <tool_call> and <tool_response> tags as tokens of their own, and
    `TOOL_CHAT_TEMPLATE`."""
    tok = char_tokenizer(alphabet, newlines=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


def save_tiny_tool_model(directory: str | Path, **model_kwargs) -> Path:
    """A tiny Llama with `tool_chat_tokenizer`, saved to `directory` (a HF model dir)."""
    directory = Path(directory)
    tokenizer = tool_chat_tokenizer()
    tiny_llama(tokenizer, **model_kwargs).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
