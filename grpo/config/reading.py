"""Reading a config: a YAML file or a mapping plus dotted `--set` overrides -> a checked `Config`;
and back: the config as plain data (what config.yaml holds) and the reference of its keys.

An unknown or misspelt key (TRL's names included: `TRL_NAMES` says ours) or a value of the
wrong type raises `UserError` with one line that names the key; `checks.validate` then runs
before any model is loaded.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml

from grpo.config.checks import validate
from grpo.config.fields import as_tree, field_default, freeze, key_of
from grpo.config.schema import PRESETS, Config, RolloutConfig
from grpo.errors import UserError
from grpo.infra.imports import spec_of


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if tp is Callable:
        return "a function"
    if tp is type:
        return "a class"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the type hint `tp`; return it converted (int -> float, ...)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            try:
                return _convert(value, option, key)
            except UserError as err:
                errors.append((option, err))
        # A choice among names keeps its own message, with its did-you-mean hint.
        for option, err in errors:
            if typing.get_origin(option) is Literal and value is not None:
                raise UserError(f"{err} (or null)") from None
        raise UserError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in typing.get_args(tp)], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"{key}: expected one of {_type_name(tp)}, got {value!r}{hint}")
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(tp)
            return [_convert(v, item, f"{key}.{i}") for i, v in enumerate(value)]
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return _build(tp, value, key)
    elif origin is dict:  # free-form options (data.task_options): string keys, values as given
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML reads 1e-6 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise UserError(f"{key}: expected a finite number, got {value!r}")
            return number
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool or tp is str:
        if isinstance(value, tp):
            return value
    elif tp is Callable:  # a reward function given from Python
        if callable(value) and not isinstance(value, (str, type)):
            return value
    elif tp is type:  # a class given from Python (rollout.environment)
        if isinstance(value, type):
            return value
    raise UserError(f"{key}: expected {_type_name(tp)}, got {value!r}")


# TRL's GRPOConfig names -> ours (the key with the same meaning, never one spelt alike), or
# None with what to do instead. Looked up by the bare name, in whatever section it was put.
TRL_NAMES: dict[str, tuple[str | None, str]] = {
    "num_generations": ("rollout.group_size", "G, completions per prompt"),
    "per_device_train_batch_size": (
        "rollout.prompts_per_step",
        "prompts per step; TRL counts completions per device: per_device_train_batch_size x processes x steps_per_generation / num_generations",
    ),
    "generation_batch_size": (
        "rollout.prompts_per_step",
        "completions generated per step, over all processes: rollout.prompts_per_step x rollout.group_size "
        "(our rollout.generation_batch_size is another thing: completions per decoding call)",
    ),
    "max_completion_length": ("rollout.max_new_tokens", "longest completion"),
    "max_prompt_length": ("rollout.max_prompt_length", "longest prompt, cut from the left"),
    "max_tool_calling_iterations": ("rollout.max_tool_calls", "model turns whose tool calls run, per rollout"),
    "environment_factory": ("rollout.environment", "the environment class, one instance per rollout"),
    "temperature": ("rollout.temperature", "sampling temperature"),
    "top_p": ("rollout.top_p", "nucleus sampling"),
    "top_k": ("rollout.top_k", "top-k sampling"),
    "min_p": ("rollout.min_p", "min-p sampling"),
    "repetition_penalty": ("rollout.repetition_penalty", "the repetition penalty, which the loss scores too"),
    "learning_rate": ("train.lr", "the policy's learning rate"),
    "num_iterations": (
        "train.epochs",
        "mu, update epochs per batch; our train.iterations resets the reference instead",
    ),
    "max_steps": (
        "train.steps",
        "RL steps, one generated batch each; TRL's max_steps counts optimizer steps, "
        "max_steps x gradient_accumulation_steps / (steps_per_generation x num_iterations) batches",
    ),
    "save_steps": ("train.checkpoint_every", "steps between checkpoints"),
    "logging_steps": ("train.log_every", "steps between log lines (when stderr is not a terminal)"),
    "report_to": ("train.report_to", "tensorboard, wandb and/or trackio, besides metrics.jsonl"),
    "run_name": ("train.run_name", "the run's name in wandb and trackio"),
    "project": ("train.project", "the wandb and trackio project"),
    "warmup_steps": ("train.warmup_steps", "learning-rate warm-up"),
    "lr_scheduler_type": ("train.schedule", "constant, linear or cosine"),
    "weight_decay": ("train.weight_decay", "AdamW weight decay"),
    "optim": (
        "train.optimizer",
        "adamw_torch and adamw_torch_fused are adamw; adamw_8bit and adamw_bnb_8bit are adamw_8bit",
    ),
    "max_grad_norm": ("train.max_grad_norm", "gradient clipping"),
    "gradient_checkpointing": ("train.gradient_checkpointing", "activation checkpointing"),
    "gradient_accumulation_steps": (
        "train.micro_batch_size",
        "completions per forward/backward pass: a minibatch's completions / gradient_accumulation_steps",
    ),
    "bf16": ("train.autocast", "bfloat16 mixed precision: train.autocast: bfloat16"),
    "epsilon": ("loss.clip_low", "the clip range's lower epsilon (and loss.clip_high); loss.eps is the std's epsilon"),
    "epsilon_high": ("loss.clip_high", "DAPO's clip-higher"),
    "beta": ("loss.beta", "the KL coefficient"),
    "loss_type": (
        "loss.aggregation",
        "grpo/bnpo/dapo/dr_grpo are seq-mean-token-mean/token-mean/token-mean/seq-mean-token-sum-norm",
    ),
    "scale_rewards": ("loss.scale", "group, batch or none"),
    "mask_truncated_completions": ("loss.mask_truncated_completions", "leave cut-off completions out of the loss"),
    "model_name_or_path": ("model", "the policy"),
    "reward_funcs": ("rewards", "a list of {function: ..., weight: ...}"),
    "reward_weights": ("rewards", "each entry's weight"),
    "dataset_name": ("data.path", "a file, a saved datasets directory or a datasets name"),
    "dataset_config": ("data.config", "the dataset's configuration, load_dataset's second argument"),
    "dataset_train_split": ("data.split", "the split trained on"),
    "vllm_importance_sampling_correction": (
        "loss.engine_correction",
        "false is none; true is the mode vllm_importance_sampling_mode names",
    ),
    "vllm_importance_sampling_mode": (
        "loss.engine_correction",
        "token_truncate is token_tis; sequence_mask is ours, except that TRL also weighs a kept sequence by its ratio; token_mask and sequence_truncate have no counterpart",
    ),
    "vllm_importance_sampling_clip_max": ("loss.engine_correction_cap", "C, the cap on the ratio"),
    "vllm_importance_sampling_clip_min": (
        "loss.engine_correction_cap",
        "token_tis has no lower bound; sequence_mask's is 1 / loss.engine_correction_cap",
    ),
    "vllm_importance_sampling_cap": ("loss.engine_correction_cap", "C, the cap on the ratio (TRL's older name)"),
    "use_vllm": ("rollout.sampler", "rollout.sampler: vllm samples with a vLLM engine"),
    "vllm_mode": ("rollout.vllm.server", "'' for colocate (the default), HOST:PORT of a `grpo vllm-serve` for server"),
    "vllm_gpu_memory_utilization": ("rollout.vllm.gpu_memory_utilization", "the colocated engine's share of the GPU"),
    "vllm_enable_sleep_mode": ("rollout.vllm.sleep", "the engine frees its memory during the update"),
    "vllm_server_host": ("rollout.vllm.server", "HOST:PORT in one key"),
    "vllm_server_port": ("rollout.vllm.server", "HOST:PORT in one key"),
    "vllm_tensor_parallel_size": (None, "no tensor parallelism: the colocated engine runs whole, one per process"),
    "chat_template_kwargs": ("rollout.chat_template_kwargs", "the chat template's own variables"),
    "shuffle_dataset": ("data.shuffle", "shuffle the prompts, again at each pass over the data"),
    "importance_sampling_level": ("loss.ratio_level", "token, or sequence (GSPO)"),
    "delta": (
        "loss.dual_clip",
        "INTELLECT-2's cap on the ratio: the same bound on the loss of negative-advantage tokens",
    ),
    "steps_per_generation": (
        "train.minibatches",
        "optimizer steps per generated batch (per epoch): steps_per_generation / gradient_accumulation_steps",
    ),
    "log_completions": ("train.sample_every", "completions written to samples.jsonl every N steps (0: never)"),
    "vllm_server_base_url": ("rollout.vllm.server", "HOST:PORT of a `grpo vllm-serve`"),
    "disable_dropout": (None, "dropout is always off here: every model runs in eval mode"),
    "sync_ref_model": (
        None,
        "no periodic reference sync; train.iterations resets the reference to the policy at each iteration",
    ),
    "push_to_hub": (
        "train.push_to_hub",
        "a repository id (TRL's hub_model_id), or true for one named after output_dir, as TRL's default",
    ),
    "hub_model_id": ("train.push_to_hub", "the repository id (user/name); empty: no push"),
    "hub_private_repo": ("train.hub_private", "create the repository private"),
    "hub_strategy": (
        "train.hub_strategy",
        "end or every_save (each checkpoint's model, never its resumable state); TRL's checkpoint and all_checkpoints have no counterpart",
    ),
    "hub_token": (None, "no token in a config: huggingface_hub's own (HF_TOKEN, or `hf auth login`)"),
}


def _unknown_key(key: str, prefix: str, names: list[str]) -> str:
    full = f"{prefix}.{key}" if prefix else str(key)
    if str(key) in TRL_NAMES:
        ours, meaning = TRL_NAMES[str(key)]
        where = f"it is '{ours}' here ({meaning})" if ours else meaning
        return f"unknown config key '{full}': that is TRL's GRPOConfig name; {where}"
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
    return f"unknown config key '{full}'{hint}"


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {key_of(f): f.name for f in dataclasses.fields(cls)}  # config key -> Python name
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise UserError(_unknown_key(key, prefix, list(names)))
        kwargs[names[key]] = _convert(value, hints[names[key]], full)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node: Any = tree
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise UserError(f"--set {dotted}: '{'.'.join(parts[:i])}' has no item {part}")
            part = int(part)
        elif not isinstance(node, dict):
            raise UserError(f"--set {dotted}: '{'.'.join(parts[:i])}' is not a mapping")
        if last:
            node[part] = value
        else:
            if isinstance(node, dict) and not isinstance(node.get(part), (dict, list)):
                node[part] = {}
            node = node[part]


def parse_override(text: str) -> tuple[str, Any]:
    """'rollout.group_size=4' -> ('rollout.group_size', 4); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set expects key.sub=value, got {text!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise UserError(f"--set {key}: cannot read value {raw!r} ({str(err).splitlines()[0]})") from None
    return key.strip(), value


def config_from_dict(data: dict, overrides: list[str] = ()) -> Config:
    """Build and validate a Config from a mapping (as read from YAML) and `key=value` overrides."""
    if not isinstance(data, dict):
        raise UserError(f"the config must be a mapping of keys to values, got {type(data).__name__}")
    tree = copy.deepcopy(data)  # overrides must not write into the caller's mapping (functions are shared, not copied)
    if isinstance(tree.get("rewards"), list):  # rewards: [fn, ...] from Python, short for {function: fn}
        tree["rewards"] = [{"function": r} if callable(r) else r for r in tree["rewards"]]
    for text in overrides:
        _set_dotted(tree, *parse_override(text))
    config = _build(Config, tree)
    _resolve_presets(config)
    _resolve_engine_correction(config)
    validate(config)
    return freeze(config)  # read-only from here: nothing writes a decision back into it


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read a YAML config file, apply `key=value` overrides, validate."""
    return config_from_dict(read_config_file(path), overrides)


def read_config_file(path: str | Path) -> dict:
    """A YAML config file's mapping, not yet validated (one-line errors for a missing file,
    invalid YAML, or anything but a mapping)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{path}: invalid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: the config must be a mapping of keys to values, got a {type(data).__name__}")
    return data


def _resolve_presets(config: Config) -> None:
    for key, value in PRESETS[config.algorithm].items():
        if getattr(config.loss, key) is None:
            setattr(config.loss, key, value)


def truncates(rollout: RolloutConfig) -> bool:
    """Whether the sampler draws from a truncation of the distribution the loss scores (top_k,
    top_p, min_p, or min_new_tokens holding EOS back; docs/sampling.md)."""
    return rollout.top_k > 0 or rollout.top_p < 1 or rollout.min_p > 0 or rollout.min_new_tokens > 0


def _resolve_engine_correction(config: Config) -> None:
    """loss.engine_correction left unset: token_tis, unless the sampler truncates. A truncated
    distribution's log-probs exceed the loss's by the log of the mass kept at every token, so
    the ratio pi_old / pi_sampler is that mass (< 1) wherever the engine agrees: the weights
    would scale the gradient down by it, and a sequence's product would leave the bounds."""
    if config.loss.engine_correction is None:
        config.loss.engine_correction = "none" if truncates(config.rollout) else "token_tis"


def config_to_dict(config: Config) -> dict:
    """The config as plain data (what config.yaml and a checkpoint hold): a reward function
    given from Python is written as its 'module:qualname'."""
    data = as_tree(config)
    for reward in data["rewards"]:
        if callable(reward["function"]):
            reward["function"] = spec_of(reward["function"])
    rollout = data["rollout"]
    rollout["tools"] = [spec_of(t) if callable(t) else t for t in rollout["tools"]]
    if callable(rollout["environment"]):
        rollout["environment"] = spec_of(rollout["environment"])
    elif isinstance(rollout["environment"], dict):  # several, by name
        rollout["environment"] = {k: spec_of(v) if callable(v) else v for k, v in rollout["environment"].items()}
    if callable(rollout["environment_action"]):
        rollout["environment_action"] = spec_of(rollout["environment_action"])
    if callable(rollout["agent"]):
        rollout["agent"] = spec_of(rollout["agent"])
    return data


def describe_fields(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every leaf field: the reference printed by --help."""
    rows = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        key = f"{prefix}{key_of(f)}"
        if dataclasses.is_dataclass(hint):
            rows.extend(describe_fields(hint, key + "."))
            continue
        default = field_default(f)
        if (
            typing.get_origin(hint) is list
            and typing.get_args(hint)
            and dataclasses.is_dataclass(typing.get_args(hint)[0])
        ):
            rows.append((key, "[]", f.metadata.get("doc", "")))
            rows.extend(describe_fields(typing.get_args(hint)[0], key + "[]."))
            continue
        shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        rows.append((key, shown, f.metadata.get("doc", "")))
    return rows
