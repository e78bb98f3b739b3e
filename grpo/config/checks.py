"""Checking a config before anything is loaded: every impossible value, and every combination
of its own that cannot run, raised as `UserError` with one line that starts with its key.
What needs an engine's facts (a decoder's, vLLM's, the launch's) is `grpo.train.preflight`'s:
the config imports no engine.

A range check is a `_require` here; a refused combination or value is a row of
`grpo.refusals`, raised by name from one `if` (`refuse`), so that lifting one is deleting
the row and its `if`."""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path

from grpo.config.schema import Config, TrainConfig
from grpo.errors import UserError
from grpo.refusals import refuse


REPORTERS = ("tensorboard", "wandb", "trackio")


def reporters(train: TrainConfig) -> list[str]:
    """train.report_to as a list of known names, in order and without repeats (one name, or
    several joined by commas as `--set train.report_to=wandb,trackio` gives them; "none", []
    and null for none), with tensorboard added by train.tensorboard: true."""
    given = train.report_to
    names = [] if given is None else given.split(",") if isinstance(given, str) else list(given)
    names = [name.strip() for name in names if name.strip() != "none"]
    for name in names:
        if name not in REPORTERS:
            close = difflib.get_close_matches(str(name), REPORTERS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UserError(
                f"train.report_to: unknown logger {name!r}{hint}; choose among {', '.join(REPORTERS)}, or none"
            )
    if train.tensorboard:
        names.append("tensorboard")
    return list(dict.fromkeys(names))


def split_address(address: str) -> tuple[str, int]:
    """rollout.vllm.server's 'HOST:PORT' -> (host, port); a one-line UserError for anything else."""
    host, _, port = address.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"rollout.vllm.server: expected HOST:PORT (e.g. 127.0.0.1:8000), got {address!r}")
    return host.strip("[]"), int(port)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def validate(c: Config) -> None:
    """Impossible values, each reported with its key, one section of the config after another
    (each check may rely on the ones before it). Runs before anything is loaded."""
    for check in SECTIONS:
        check(c)


def _check_inputs(c: Config) -> None:
    """The run's inputs: a model, prompts (or an environment that writes them), a reward, a seed."""
    _require(bool(c.model), "model: required (a Hugging Face model directory or hub id)")
    several = isinstance(c.rollout.environment, dict)
    _require(
        bool(c.data.path) or (c.rollout.environment is not None and not several),
        "data.path: required with several environments (each row's 'environment' field picks one)"
        if several
        else "data.path: required (a prompt file or a datasets name; or a rollout.environment whose reset writes the prompt)",
    )
    _require(
        len(c.rewards) > 0 or c.rollout.environment is not None or c.rollout.agent is not None,
        "rewards: at least one reward is required, e.g. [{function: exact_answer}]",
    )
    _require(c.seed >= 0, f"seed: must be >= 0, got {c.seed}")


def _check_rewards(c: Config) -> None:
    """rewards: each a function or a model, with a finite weight."""
    for i, r in enumerate(c.rewards):
        _require((r.function is None) != (r.model is None), f"rewards.{i}: give exactly one of 'function' or 'model'")
        if r.process and r.model is None:
            refuse("process+function", i=i)
        if r.process and c.loss.supervision != "process":
            refuse("process-model+outcome", i=i)
        _require(bool(r.step_separator), f"rewards.{i}.step_separator: must not be empty")
        _require(math.isfinite(r.weight), f"rewards.{i}.weight: must be a finite number")
        _require(
            r.timeout is None or r.timeout > 0, f"rewards.{i}.timeout: must be > 0 seconds or null, got {r.timeout}"
        )
        if r.model is not None and (r.timeout is not None or r.isolate):
            refuse("reward-model+timeout", i=i)


def _check_rollout(c: Config) -> None:
    """rollout: the group, the turns and the sampling options (what the chosen sampler can do
    with them: `grpo.train.preflight`)."""
    ro, lo = c.rollout, c.loss
    if lo.baseline == "group" and ro.group_size < 2:
        refuse("group+one-sample", group_size=ro.group_size)
    if lo.baseline == "group" and lo.kl_in != "loss":
        refuse("group+kl-in-reward")
    _require(ro.group_size >= 1, f"rollout.group_size: must be >= 1, got {ro.group_size}")
    if lo.drop_zero_std_groups and ro.group_size < 2:
        refuse("drop-zero-std+one-sample")
    _require(
        ro.max_tool_calls is None or ro.max_tool_calls >= 0,
        f"rollout.max_tool_calls: must be >= 0 or null, got {ro.max_tool_calls}",
    )
    _require(
        ro.tool_timeout is None or ro.tool_timeout > 0,
        f"rollout.tool_timeout: must be > 0 seconds or null, got {ro.tool_timeout}",
    )
    if (ro.tools or ro.environment is not None or ro.agent is not None) and lo.supervision != "outcome":
        refuse("multi-turn+process")
    if ro.agent is not None and (ro.tools or ro.environment is not None):
        refuse("agent+tools")
    _require(ro.prompts_per_step >= 1, f"rollout.prompts_per_step: must be >= 1, got {ro.prompts_per_step}")
    _require(ro.max_new_tokens >= 1, f"rollout.max_new_tokens: must be >= 1, got {ro.max_new_tokens}")
    _require(
        0 <= ro.min_new_tokens <= ro.max_new_tokens,
        "rollout.min_new_tokens: must be between 0 and rollout.max_new_tokens",
    )
    _require(ro.temperature > 0, f"rollout.temperature: must be > 0, got {ro.temperature}")
    _require(0 < ro.top_p <= 1, f"rollout.top_p: must be in (0, 1], got {ro.top_p}")
    _require(ro.top_k >= 0, f"rollout.top_k: must be >= 0, got {ro.top_k}")
    _require(0 <= ro.min_p < 1, f"rollout.min_p: must be in [0, 1) (0 = off), got {ro.min_p}")
    _require(
        ro.repetition_penalty > 0, f"rollout.repetition_penalty: must be > 0 (1 = off), got {ro.repetition_penalty}"
    )
    _require(
        ro.generation_batch_size >= 0, f"rollout.generation_batch_size: must be >= 0, got {ro.generation_batch_size}"
    )
    _require(ro.max_prompt_length >= 0, f"rollout.max_prompt_length: must be >= 0, got {ro.max_prompt_length}")


def _check_vllm(c: Config) -> None:
    """rollout.vllm: the engine's numbers, and a server's address and transport."""
    ro, v = c.rollout, c.rollout.vllm
    _require(
        0 < v.gpu_memory_utilization <= 1,
        f"rollout.vllm.gpu_memory_utilization: must be in (0, 1], got {v.gpu_memory_utilization}",
    )
    _require(v.kv_cache_gb >= 1, f"rollout.vllm.kv_cache_gb: must be >= 1, got {v.kv_cache_gb}")
    _require(v.max_num_seqs >= 1, f"rollout.vllm.max_num_seqs: must be >= 1, got {v.max_num_seqs}")
    _require(
        v.check_tolerance is None or v.check_tolerance > 0,
        f"rollout.vllm.check_tolerance: must be > 0 or null, got {v.check_tolerance}",
    )
    if v.server:
        split_address(v.server)  # HOST:PORT, or one line
    if v.server and ro.sampler != "vllm":
        refuse("server+not-vllm")
    if v.server and v.transport != "file":
        refuse("transport-nccl", transport=v.transport)
    _require(v.timeout > 0, f"rollout.vllm.timeout: must be > 0, got {v.timeout}")


def _check_train(c: Config) -> None:
    """train: the budget, the batches, the optimizer (in the backward or not), logging and
    checkpoints, the device."""
    ro, tr = c.rollout, c.train
    _require(tr.steps >= 1, f"train.steps: must be >= 1, got {tr.steps}")
    _require(
        1 <= tr.iterations <= tr.steps, f"train.iterations: must be between 1 and train.steps, got {tr.iterations}"
    )
    _require(tr.lr > 0, f"train.lr: must be > 0, got {tr.lr}")
    _require(tr.epochs >= 1, f"train.epochs: must be >= 1, got {tr.epochs}")
    batch = ro.prompts_per_step * ro.group_size
    _require(
        1 <= tr.minibatches <= batch,
        f"train.minibatches: must be between 1 and the {batch} completions of a step, got {tr.minibatches}",
    )
    _require(tr.micro_batch_size >= 0, f"train.micro_batch_size: must be >= 0, got {tr.micro_batch_size}")
    _require(tr.micro_batch_tokens >= 0, f"train.micro_batch_tokens: must be >= 0, got {tr.micro_batch_tokens}")
    if tr.old_logprobs == "sampler" and ro.sampler == "hf":
        refuse("sampler-logprobs+hf")
    _require(
        len(tr.adam_betas) == 2 and all(0 <= b < 1 for b in tr.adam_betas), "train.adam_betas: two numbers in [0, 1)"
    )
    _require(tr.max_grad_norm >= 0, "train.max_grad_norm: must be >= 0")
    if tr.optimizer_in_backward:
        if tr.max_grad_norm > 0:
            refuse("in-backward+clipping", max_norm=tr.max_grad_norm)
        rows = -(-batch // tr.minibatches)  # the largest minibatch
        if 0 < tr.micro_batch_size < rows:
            refuse("in-backward+accumulation", micro=tr.micro_batch_size, rows=rows)
        if tr.micro_batch_tokens:
            refuse("in-backward+token-budget", tokens=tr.micro_batch_tokens)
    _require(tr.log_every >= 1, f"train.log_every: must be >= 1, got {tr.log_every}")
    reporters(tr)  # an unknown name is one line, before anything is loaded
    for name in ("warmup_steps", "checkpoint_every", "sample_every"):
        _require(getattr(tr, name) >= 0, f"train.{name}: must be >= 0")
    _require(tr.keep_checkpoints >= 1, "train.keep_checkpoints: must be >= 1")
    _require(tr.checkpoint_minutes >= 0, f"train.checkpoint_minutes: must be >= 0, got {tr.checkpoint_minutes}")
    _require(tr.max_unscored_steps >= 0, f"train.max_unscored_steps: must be >= 0, got {tr.max_unscored_steps}")
    _require(
        re.fullmatch(r"auto|cpu|cuda(:\d+)?", tr.device) is not None,
        f"train.device: expected auto, cpu, cuda or cuda:N, got {tr.device!r}",
    )
    repo = hub_repo(c)
    _require(
        not repo or re.fullmatch(r"[\w.-]+(/[\w.-]+)?", repo) is not None,
        f"train.push_to_hub: expected a repository id such as user/name, got {repo!r}"
        + (f" (true names it after output_dir, {c.output_dir!r})" if tr.push_to_hub is True else ""),
    )


def _check_loss(c: Config) -> None:
    """loss: the clipping, the KL weight, the critic's GAE and value clip (and value.lr)."""
    lo = c.loss
    _require(lo.beta >= 0, f"loss.beta: must be >= 0, got {lo.beta}")
    _require(0 < lo.clip_low < 1, f"loss.clip_low: must be in (0, 1), got {lo.clip_low}")
    _require(lo.clip_high > 0, f"loss.clip_high: must be > 0, got {lo.clip_high}")
    _require(lo.dual_clip is None or lo.dual_clip > 1, f"loss.dual_clip: must be > 1, got {lo.dual_clip}")
    _require(lo.eps >= 0, "loss.eps: must be >= 0")
    _require(lo.engine_correction_cap > 1, f"loss.engine_correction_cap: must be > 1, got {lo.engine_correction_cap}")
    _require(0 <= lo.gamma <= 1, f"loss.gamma: must be in [0, 1], got {lo.gamma}")
    _require(0 <= lo.lam <= 1, f"loss.lam: must be in [0, 1], got {lo.lam}")
    _require(lo.value_clip is None or lo.value_clip > 0, "loss.value_clip: must be > 0 or null")
    _require(c.value.lr is None or c.value.lr > 0, "value.lr: must be > 0")
    if lo.supervision == "process" and lo.baseline != "group":
        refuse("process+critic")


def _check_reward_model_update(c: Config) -> None:
    """reward_model_update: iterative RL needs a reward model to retrain and two iterations."""
    u = c.reward_model_update
    models = [i for i, r in enumerate(c.rewards) if r.model is not None]
    if u.verifier is not None and not models:
        refuse("iterative+no-reward-model")
    if u.verifier is not None and u.reward != -1 and u.reward not in models:
        refuse("iterative+function-reward", index=u.reward)
    if u.verifier is not None and c.train.iterations < 2:
        refuse("iterative+one-iteration")
    _require(0 <= u.replay < 1, f"reward_model_update.replay: must be in [0, 1), got {u.replay}")
    for name in ("prompts", "epochs", "batch_size", "max_pairs_per_prompt"):
        _require(getattr(u, name) >= 1, f"reward_model_update.{name}: must be >= 1")
    _require(
        u.samples_per_prompt >= 2,
        "reward_model_update.samples_per_prompt: comparisons need at least 2 samples per prompt",
    )
    _require(u.lr > 0, "reward_model_update.lr: must be > 0")


def _check_lora(c: Config) -> None:
    """lora: its rank, and what needs an adapter (whether the sampler decodes one:
    `grpo.train.preflight`)."""
    lo = c.lora
    _require(lo.r >= 0, "lora.r: must be >= 0")
    for name, value in (("save", lo.save != "merged"), ("init_adapter", bool(lo.init_adapter))):
        _require(lo.r > 0 or not value, f"lora.{name}: needs an adapter (lora.r > 0)")
    if lo.save != "merged" and c.train.iterations > 1 and c.loss.beta > 0:
        refuse("adapter+iterations", save=lo.save)  # AdapterOff.reset_to merges the adapter
    _require(lo.r > 0 or lo.quantize == "none", "lora.quantize: a 4-bit base trains through an adapter: set lora.r > 0")
    if lo.quantize != "none" and c.train.iterations > 1 and c.loss.beta > 0:
        refuse("quantize+iterations")  # AdapterOff.reset_to merges the adapter


def hub_repo(c: Config) -> str:
    """train.push_to_hub's repository id: the one given, or with `true` (TRL's spelling) one
    named after output_dir's folder, in the token's own namespace, as TRL's hub_model_id
    defaults; "" for no push (empty or false)."""
    given = c.train.push_to_hub
    if given is True:
        return Path(c.output_dir).resolve().name
    return given or ""


def lookahead(c: Config) -> int:
    """The steps the asynchronous generator samples ahead of the trainer: as many as keep every
    batch within rollout.async.max_staleness optimizer steps of the weights it trains, when a
    step takes train.epochs x train.minibatches of them and the generator's weights lag by up
    to push_every - 1 more. 0: the synchronous step."""
    a = c.rollout.async_
    if a.max_staleness == 0:
        return 0
    return (a.max_staleness - a.push_every + 1) // (c.train.epochs * c.train.minibatches)


def _check_async(c: Config) -> None:
    """rollout.async: its numbers, and what the generator process cannot do yet."""
    a, ro, tr = c.rollout.async_, c.rollout, c.train
    _require(a.max_staleness >= 0, f"rollout.async.max_staleness: must be >= 0, got {a.max_staleness}")
    _require(a.push_every >= 1, f"rollout.async.push_every: must be >= 1, got {a.push_every}")
    _require(a.threads >= 1, f"rollout.async.threads: must be >= 1, got {a.threads}")
    _require(a.timeout > 0, f"rollout.async.timeout: must be > 0 seconds, got {a.timeout}")
    if a.max_staleness == 0:
        return
    updates = tr.epochs * tr.minibatches
    lag = f" and rollout.async.push_every adds {a.push_every - 1}" if a.push_every > 1 else ""
    _require(
        lookahead(c) >= 1,
        f"rollout.async.max_staleness: {a.max_staleness} leaves the generator no step ahead: a step takes "
        f"train.epochs x train.minibatches = {updates} optimizer steps{lag}; set it to at least {updates + a.push_every - 1}",
    )
    if ro.sampler == "hf":
        refuse("async+hf")
    if tr.old_logprobs == "recompute" and c.loss.engine_correction == "none":
        refuse("async+recompute-uncorrected")


# In order: train's batch checks come before rollout.async's, which divides by them.
def _check_eval(c: Config) -> None:
    """eval: the held-out evaluation's sampling and its cadence; train.keep_best names one of its metrics."""
    ev, keep = c.eval, c.train.keep_best
    if not ev.data:
        _require(keep is None, f"train.keep_best: needs an eval section with eval.data (got {keep!r})")
        _require(not ev.stop_when_diverging, "eval.stop_when_diverging: needs eval.data")
        return
    _require(ev.n >= 1, f"eval.n: must be >= 1, got {ev.n}")
    for k in ev.k:
        _require(1 <= k <= ev.n, f"eval.k: each k must be between 1 and eval.n ({ev.n}), got {k}")
    for name in ("every", "prompts", "max_new_tokens", "seed"):
        _require(getattr(ev, name) >= 0, f"eval.{name}: must be >= 0, got {getattr(ev, name)}")
    _require(ev.batch_size >= 1, f"eval.batch_size: must be >= 1, got {ev.batch_size}")
    _require(
        ev.temperature > 0, f"eval.temperature: must be > 0 (pass@k and maj@k need sampling), got {ev.temperature}"
    )
    _require(0 < ev.top_p <= 1, f"eval.top_p: must be in (0, 1], got {ev.top_p}")
    _require(ev.alarm_window >= 2, f"eval.alarm_window: must be >= 2 evaluations, got {ev.alarm_window}")
    _require(ev.task is None or ev.verifier is None, "eval.task and eval.verifier: give one, not both")
    if keep is not None:
        _require(
            re.fullmatch(r"eval/(pass|maj)@\d+", keep) is not None,
            f"train.keep_best: expected eval/pass@K or eval/maj@K (e.g. eval/pass@1), got {keep!r}",
        )


SECTIONS = (
    _check_inputs,
    _check_rewards,
    _check_rollout,
    _check_vllm,
    _check_train,
    _check_async,
    _check_loss,
    _check_reward_model_update,
    _check_lora,
    _check_eval,
)
