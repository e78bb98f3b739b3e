"""Loading from Hugging Face directories and hub ids: causal LMs (what the trainer, the
generator and evaluation load), dtypes by name, tokenizers, a model's context length from its
config, and quieting transformers where its output is expected noise."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.errors import UserError, first_line

if TYPE_CHECKING:
    import torch


@contextmanager
def quiet_loading():
    """Silence transformers' load report while building a model from another head's
    checkpoint (a backbone from a causal LM, a classifier from a causal LM): its table of
    "missing" and "unexpected" keys is then the expected outcome, not a problem."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


# The dtypes a model may be loaded in, by the names configs and options use (torch's own names).
DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name, key: str):
    """The torch dtype a config names ('float32', 'bfloat16', 'float16'; a torch.dtype passes)."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise UserError(f"{key}: dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def load_error(err: BaseException) -> str:
    """Why `from_pretrained` failed, in one line. transformers reads a pickled weights file
    (pytorch_model.bin) with torch.load(weights_only=True); one that holds anything but tensors
    is refused, and said so (torch's own text suggests loading it unrestricted)."""
    import pickle

    cause, seen = err, set()
    while cause is not None and not isinstance(cause, pickle.UnpicklingError) and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if not isinstance(cause, pickle.UnpicklingError):
        return first_line(err)
    from grpo.infra.checkpoint import refusal

    return f"its pickled weights file {refusal(cause, 'a weights file')}; nothing in it was run"


def load_causal_lm(
    path: str, dtype: str, key: str = "model", attention: str | None = None, device: torch.device | str = "cpu"
):
    """A causal LM from a Hugging Face directory or hub id, on `device`, in eval mode (dropout
    off: RL runs without it, and gradients flow in eval mode too). `key` names the config key
    or option in the one-line UserError of a failure."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype, key), attn_implementation=attention)
    except Exception as err:
        raise UserError(f"{key}: cannot load a causal language model from '{path}' ({load_error(err)})") from None
    return model.to(device).eval()


def _check_local(path: str, key: str) -> None:
    """A one-line UserError for a directory that is missing or holds no model (a peft adapter
    folder is one: transformers loads its base and puts the adapter on, peft installed)."""
    # Hub ids never start with '/', '.' or '~': such a path can only be a missing directory,
    # which the hub client would otherwise report as a malformed repository id.
    local = Path(path).expanduser()
    if path.startswith(("/", ".", "~")) and not local.exists():
        raise UserError(f"{key}: no such directory '{path}'")
    if local.is_dir() and not any((local / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise UserError(f"{key}: '{path}' holds no Hugging Face model (no config.json)")


def model_config(path: str, key: str = "model"):
    """The model's `PretrainedConfig` (config.json alone, no weights): a cheap check that `path`
    names a model, made before a run touches its output_dir. Failures as load_tokenizer's."""
    from transformers import AutoConfig

    _check_local(path, key)
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as err:  # OSError, ValueError, ... from the hub client or the file
        raise UserError(f"{key}: cannot read a model config from '{path}' ({first_line(err)})") from None


def load_tokenizer(path: str, key: str = "model"):
    """AutoTokenizer.from_pretrained(path), with a pad token (the EOS when it has none); every
    failure is a one-line UserError that starts with `key` (the config key or option)."""
    from transformers import AutoTokenizer

    _check_local(path, key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:  # OSError, ValueError, ... from the hub client or the files
        raise UserError(f"{key}: cannot load a tokenizer from '{path}' ({first_line(err)})") from None
    return with_pad_token(tokenizer, f"the tokenizer of '{path}'", key)


def with_pad_token(tokenizer, name: str, key: str = "model"):
    """`tokenizer` with a pad token: its EOS where it has none (batches are padded). `name`
    says which tokenizer in the one-line error of one with neither."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UserError(f"{key}: {name} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# Where configs keep their number of positions: most (Llama, Qwen, Mistral, ...) under the
# first name, GPT-2 under n_positions, other GPT-style configs under n_ctx, a few under the last.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")


def context_length(model_or_config) -> int | None:
    """The number of positions a model (or its `PretrainedConfig`) was built for: the longest
    prompt + completion it can read. None when its config names none (e.g. relative positions)."""
    config = getattr(model_or_config, "config", model_or_config)  # a model (peft-wrapped too), or a config
    text_config = getattr(config, "get_text_config", None)  # a multimodal config keeps it in its text part
    config = text_config() if text_config is not None else config
    for key in POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
