"""The evaluation runner: sample n completions per prompt, check each, report pass@k and maj@k.

DeepSeekMath (Fig. 7) finds that RL raises Maj@K but not Pass@K. `evaluate` measures both
curves for one model: n samples per prompt (temperature 0.7, the paper's), then for every k
the mean over prompts of the exact estimators of `grpo.eval.metrics`, with normal 95%
intervals over prompts (the n samples are one draw; each prompt's value is exact over the
C(n, k) choices of k). Two parts, so that the metrics are tested without a model:
`sample_completions` (through `grpo.rollout.Sampler`) and `measure` (pure). A verdict comes
from a `Verifier` (a reward function, a threshold and an answer extractor; a task brings
all three): the runner knows no task. A correct completion without an extractable answer
counts for pass@k but wins no vote. The user's guide: docs/evaluation.md.
"""

from __future__ import annotations

import numbers
import sys
import time
from pathlib import Path
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from torch import Tensor

from grpo.errors import UserError
from grpo.eval.metrics import maj_at_k, mean_ci, over_seeds, pass_at_k  # noqa: F401 (mean_ci, over_seeds: re-exported)
from grpo.infra import contain
from grpo.infra.distributed import SingleProcess, World
from grpo.infra.imports import describe, one_line
from grpo.infra.progress import Progress
from grpo.rewards.scoring import RESERVED_ARGUMENTS, as_messages, as_scores, resolve_reward
from grpo.rewards.types import RewardFn, WeightedReward
from grpo.rewards.rules import extract_answer, text_of

__all__ = [
    "Verifier",
    "evaluate",
    "measure",
    "reward_verifier",
    "sample_completions",
    "task_verifier",
]


@dataclass
class Verifier:
    """How to read and check a completion for one data row.

    `extract` gives the completion's final answer (None = no answer): the votes of maj@k.
    `check` says whether the completion is correct for the row: the c of pass@k.
    `check_group`, when given, checks all completions of a row in one call (a batched reward
    function); it must agree with `check`. `score_group`, when given (a reward function as
    verifier), gives the raw scores of a row's completions, (G,) float32 with NaN where the
    function cannot score (None).
    """

    extract: Callable[[str], Hashable | None]
    check: Callable[[str, dict], bool]
    check_group: Callable[[list[str], dict], list[bool]] | None = None
    score_group: Callable[[list[str], dict], Tensor] | None = None

    def check_all(self, completions: list[str], row: dict) -> list[bool]:
        if self.check_group is not None:
            return [bool(ok) for ok in self.check_group(completions, row)]
        return [bool(self.check(completion, row)) for completion in completions]


# ---- verifiers: a reward function (TRL's signature) and a threshold -------------------------


def _name_of(fn: Callable) -> str:
    """'module:qualname' of a function, for messages; its repr when it has none."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else one_line(repr(fn), 80)


def _votes(extract: Callable[[str], Hashable | None]) -> Callable[[str], Hashable | None]:
    """`extract`, checked: an exception or an answer that cannot be a vote is a UserError."""
    name = _name_of(extract)

    def checked(completion: str) -> Hashable | None:
        try:
            answer = extract(completion)
        except UserError:
            raise
        except Exception as exc:
            raise UserError(
                f"answer extractor {name!r} raised {describe(exc)} on completion {one_line(repr(completion), 40)}"
            ) from exc
        try:
            hash(answer)
        except TypeError:
            raise UserError(
                f"answer extractor {name!r} returned a {type(answer).__name__}, which cannot be a vote: "
                "return a hashable answer (str, number, tuple) or None"
            ) from None
        return answer

    return checked


def reward_verifier(
    fn: str | RewardFn,
    threshold: float = 0.5,
    *,
    prompt_column: str = "prompt",
    extract: Callable[[str], Hashable | None] | None = None,
    name: str | None = None,
    kind: str = "verifier",
) -> Verifier:
    """A reward function as a verifier: a completion is correct when its score >= threshold.

    `fn` is a reward function, called as in training (grpo.rewards.scoring), or anything `grpo.rewards.resolve_reward` takes
    (a built-in name or 'pkg.module:function'); it gets the row's prompt and its other
    columns, once per row for all its completions. What it returns is checked by
    `grpo.rewards.scoring.as_scores`, as in training; a None score is not correct.
    `extract` defaults to `grpo.rewards.rules.extract_answer` (an <answer> tag, a \\boxed{},
    or GSM8K's '####'). Errors start with `kind` and `name` (default: the spec, or the
    function's module:qualname): "verifier 'mypkg:fn' returned ...".
    """
    if isinstance(fn, str):
        name, fn = name or fn, resolve_reward(fn)
    name = name or _name_of(fn)
    reward = WeightedReward(name=name, fn=fn, weight=1.0)

    def score_group(completions: list[str], row: dict) -> Tensor:
        prompt = row.get(prompt_column)
        columns = {key: [value] * len(completions) for key, value in row.items() if key != prompt_column}
        prompts = [prompt] * len(completions)
        clash = sorted(set(columns) & set(RESERVED_ARGUMENTS))
        if clash:
            raise UserError(
                f"{kind} {name!r}: data column {clash[0]!r} has the name of a reward-function argument; rename the column"
            )
        try:  # called as in training: TRL's convention, contained (a UserError passes through)
            values = contain.call(reward, prompts, as_messages(prompts, list(completions)), columns)
        except contain.Failed as failure:
            raise UserError(f"{kind} {name!r} {failure.description}") from failure
        return as_scores(name, values, len(completions), kind=kind)

    def check_group(completions: list[str], row: dict) -> list[bool]:
        return (score_group(completions, row) >= threshold).tolist()  # NaN (None) >= t is False

    return Verifier(
        extract=_votes(extract or extract_answer),
        check=lambda completion, row: check_group([completion], row)[0],
        check_group=check_group,
        score_group=score_group,
    )


def task_verifier(
    task,
    *,
    prompt_column: str = "prompt",
    threshold: float | None = None,
    extract: Callable[[str], Hashable | None] | None = None,
) -> Verifier:
    """The verifier of a task (a `grpo.tasks.Task`, from `grpo.tasks.load_task`): its reward
    function, its threshold and its answer extractor; `threshold` and `extract` replace the
    task's own when given. Errors name the task: "task 'arithmetic' returned ..."."""
    return reward_verifier(
        task.verifier,
        task.threshold if threshold is None else threshold,
        prompt_column=prompt_column,
        extract=extract or task.extract_answer,
        name=task.name,
        kind="task",
    )


# ---- sampling ---------------------------------------------------------------------------


def _calls(prompts: int, n: int, batch_size: int) -> list[tuple[list[int], int]]:
    """The generate calls, as (prompt indices, completions per prompt), in order.

    As many whole prompts as fit in batch_size completions; a prompt whose n does not fit
    alone is split over several calls of at most batch_size completions.
    """
    if n <= batch_size:
        per_call = batch_size // n
        return [(list(range(i, min(i + per_call, prompts))), n) for i in range(0, prompts, per_call)]
    return [([i], min(batch_size, n - done)) for i in range(prompts) for done in range(0, n, batch_size)]


def call_seed(seed: int, call: int) -> int:
    """The seed of generate call `call` (0 = the first) of an evaluation seeded with `seed`:
    each call draws from a stream of its own, so that a call's samples do not depend on which
    process samples it (`share`); the first call's is `seed` itself."""
    return seed if call == 0 else ((seed * 1_000_117) + call) % 2**63


def _owners(calls: list[tuple[list[int], int]], world_size: int) -> list[int]:
    """The process that samples each call: whole prompts to one process, in turn (a prompt
    whose n spans several calls stays with one), so that each checks the prompts it sampled."""
    owners, units, first = [], -1, None
    for indices, _ in calls:
        if indices[0] != first:  # a call that starts another prompt starts another unit
            units, first = units + 1, indices[0]
        owners.append(units % world_size)
    return owners


def sample_completions(
    model,
    tokenizer,
    rows: list[dict],
    *,
    n: int,
    prompt_column: str = "prompt",
    temperature: float = 0.7,
    top_p: float = 1.0,
    max_new_tokens: int = 64,
    batch_size: int = 256,
    seed: int = 0,
    progress: bool = True,
    log_every: int = 10,
    draw: str = "auto",
    on_prompt: Callable[[int, list[str]], dict | None] | None = None,
    tools=None,
    lengths: dict | None = None,
    share: tuple[int, int] = (0, 1),
) -> list[list[str]]:
    """n sampled completions (decoded text) for each row, [prompt][sample]. With `tools` (a
    `grpo.rollout.tools.Toolbox`), multi-turn samples, each its list of messages (the model's
    turns and the tool messages), as a training rollout's.

    Runs under `torch.random.fork_rng`: the caller's RNG state is the same afterwards. Each
    generate call draws from its own generator (`call_seed`), so the same seed and batch_size
    give the same completions however the calls are shared out. `draw`: how the tokens are
    drawn (rollout.draw: auto, generate's bits with generate, fast).

    `share` = (rank, world_size): this process samples only its part of the calls (whole
    prompts, `_owners`); the other rows get no completions (evaluate gathers them).

    `on_prompt(i, completions)`, when given, is called as soon as all n completions of row i
    are sampled; the fields it returns (e.g. {"pass@1": ...}) are shown with the progress:
    a bar on a terminal, else a line every `log_every` prompts (grpo.infra.progress).

    `lengths`, when given, is filled in: "samples", "tokens" (the completions' tokens, a
    multi-turn sample's tool messages included) and "cut" (samples whose last token is not
    EOS: stopped by max_new_tokens, not by the model).
    """
    import torch

    from grpo.config import RolloutConfig
    from grpo.rollout import Sampler

    samplers: dict[int, Sampler] = {}  # one per group size (at most two: n and a remainder)
    completions: list[list[str]] = [[] for _ in rows]
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    calls = _calls(len(rows), n, batch_size)
    rank, world_size = share
    mine = [j for j, owner in enumerate(_owners(calls, world_size)) if owner == rank]
    prompts = len({i for j in mine for i in calls[j][0]})
    done, fields = 0, {}  # prompts with all n completions; on_prompt's latest fields
    # Counted in completions (a prompt's n may span calls); a line every log_every prompts.
    bar = Progress(
        sum(len(calls[j][0]) * calls[j][1] for j in mine),
        desc="eval",
        prefix="grpo eval",
        unit="completions",
        per_second=True,
        every=log_every * n,
        enabled=progress,
    )
    with bar, torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for j in mine:
            indices, group_size = calls[j]
            if group_size not in samplers:
                settings = RolloutConfig(
                    group_size=group_size,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    draw=draw,
                )
                samplers[group_size] = Sampler.from_config(
                    tokenizer, settings, prompt_column=prompt_column, tools=tools
                )
            device = next(model.parameters()).device
            generator = torch.Generator(device=device).manual_seed(call_seed(seed, j))
            rollout = samplers[group_size].sample(model, [rows[i] for i in indices], generator=generator)
            if lengths is not None:
                _count_lengths(lengths, rollout, tokenizer.eos_token_id)
            sampled = rollout.scored_completions
            for j, i in enumerate(indices):  # rows j*G .. j*G+G-1 belong to prompt i
                completions[i].extend(sampled[j * group_size : (j + 1) * group_size])
                if len(completions[i]) == n:
                    done += 1
                    if on_prompt is not None:
                        fields = on_prompt(i, completions[i]) or fields
            bar.update(len(rollout), prompts=f"{done}/{prompts}", **fields)
    return completions


def _count_lengths(lengths: dict, rollout, eos: int | None) -> None:
    """Add a rollout's samples, completion tokens and samples cut short (no EOS last, or empty;
    every one where the tokenizer has no EOS) to `lengths`."""
    tokens = rollout.completion_lengths.long()  # (N,)
    cut = rollout.ended_without_eos(eos) | (tokens == 0)
    lengths["samples"] = lengths.get("samples", 0) + len(tokens)
    lengths["tokens"] = lengths.get("tokens", 0) + int(tokens.sum())
    lengths["cut"] = lengths.get("cut", 0) + int(cut.sum())


# ---- metrics ----------------------------------------------------------------------------


def model_text(completion: str | list[dict]) -> str:
    """What the model wrote: the text, or a multi-turn sample's turns (tool messages left out)."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if m.get("role") == "assistant")


def valid_ks(ks: Sequence[int], n: int) -> list[int]:
    """The ks to report, sorted and unique; those beyond n are dropped with a warning."""
    if n < 1:
        raise UserError(f"n must be at least 1, got {n}")
    bad = [k for k in ks if not isinstance(k, numbers.Integral) or k < 1]
    if bad:
        raise UserError(f"k must be positive integers, got {bad[0]!r}")
    wanted = sorted(set(int(k) for k in ks))
    dropped = [k for k in wanted if k > n]
    if dropped:
        print(
            f"grpo eval: warning: dropping k = {', '.join(map(str, dropped))}: more than n = {n} samples",
            file=sys.stderr,
        )
    kept = [k for k in wanted if k <= n]
    if not kept:
        raise UserError(f"no k <= n = {n} to report (got k = {', '.join(map(str, wanted)) or 'none'})")
    return kept


@lru_cache(maxsize=65536)
def _maj_of_profile(profile: tuple[tuple[int, bool], ...], n_none: int, k: int) -> float:
    """maj@k of any prompt whose answers have these (count, correct) pairs and n_none blanks."""
    answers: list[int | None] = [None] * n_none
    flags = [False] * n_none
    for label, (count, correct) in enumerate(profile):
        answers += [label] * count
        flags += [correct] * count
    return maj_at_k(answers, flags, k)


def _maj_at_ks(answers: list[Hashable | None], flags: list[bool], ks: list[int]) -> dict[int, float]:
    """maj_at_k for every k, called only where needed: it depends on the answers only through
    their counts and which of them are correct (an answer is correct if any of its samples is,
    as in maj_at_k), so prompts with the same profile share one computation."""
    counts = Counter(a for a in answers if a is not None)
    right = {a for a, ok in zip(answers, flags) if ok and a is not None}
    if not right:
        return {k: 0.0 for k in ks}
    profile = tuple(sorted((count, answer in right) for answer, count in counts.items()))
    n_none = len(answers) - sum(counts.values())
    return {k: _maj_of_profile(profile, n_none, k) for k in ks}


def measure(
    completions: list[list[str]],
    rows: list[dict],
    *,
    ks: Sequence[int],
    verifier: Verifier,
    prompt_column: str = "prompt",
    verdicts: Sequence[list[bool] | None] | None = None,
) -> dict:
    """The report of `evaluate` for given completions ([prompt][sample], n per prompt).

    Per prompt: c = completions the verifier accepts, pass@k = pass_at_k(n, c, k), maj@k =
    maj_at_k(extracted answers, per-completion verdicts, k). Reported: their means over
    prompts with 95% normal intervals (see the module docstring). No model is involved.
    `verdicts[i]`, where given (not None), are the verifier's verdicts on prompt i's
    completions, already known (evaluate checks while it samples): not asked again.
    """
    if len(completions) != len(rows) or not rows:
        raise ValueError(f"need one list of completions per row, got {len(completions)} for {len(rows)} rows")
    n = len(completions[0])
    if any(len(group) != n for group in completions):
        raise ValueError("every prompt needs the same number of completions")
    ks = valid_ks(ks, n)
    pass_values: dict[int, list[float]] = {k: [] for k in ks}
    maj_values: dict[int, list[float]] = {k: [] for k in ks}
    per_prompt, no_answer, length = [], 0, 0
    known = list(verdicts) if verdicts is not None else [None] * len(rows)
    for group, row, flags in zip(completions, rows, known):
        flags = verifier.check_all(group, row) if flags is None else flags
        answers = [verifier.extract(text_of(completion)) for completion in group]  # a multi-turn sample's last turn
        c = sum(flags)
        mine: dict[str, dict[str, float]] = {"pass@k": {}, "maj@k": {}}
        for k, value in _maj_at_ks(answers, flags, ks).items():
            maj_values[k].append(value)
            pass_values[k].append(pass_at_k(n, c, k))
            mine["maj@k"][str(k)], mine["pass@k"][str(k)] = float(value), float(pass_values[k][-1])
        votes: Counter[str] = Counter(str(a) for a in answers if a is not None)
        no_answer += sum(a is None for a in answers)
        length += sum(len(model_text(completion)) for completion in group)
        per_prompt.append(
            {
                "prompt": row.get(prompt_column),
                "correct": c,
                "answers": dict(votes.most_common()),
                "no_answer": sum(a is None for a in answers),
                **mine,
            }
        )
    report: dict[str, Any] = {"n": n, "prompts": len(rows)}
    for name, values in (("pass@k", pass_values), ("maj@k", maj_values)):
        stats = {str(k): mean_ci(values[k]) for k in ks}
        report[name] = {k: mean for k, (mean, _) in stats.items()}
        report[f"{name}_ci"] = {k: ci for k, (_, ci) in stats.items()}
    report["accuracy"] = sum(p["correct"] for p in per_prompt) / (n * len(rows))
    report["no_answer"] = no_answer / (n * len(rows))
    report["mean_length"] = length / (n * len(rows))
    report["per_prompt"] = per_prompt
    return report


# ---- the whole evaluation ---------------------------------------------------------------


@contain.run_workers()  # its tool workers stop with it
def evaluate(
    model,
    tokenizer,
    rows: list[dict],
    *,
    n: int,
    ks: Sequence[int],
    verifier: Verifier,
    prompt_column: str = "prompt",
    temperature: float = 0.7,
    top_p: float = 1.0,
    max_new_tokens: int = 64,
    batch_size: int = 256,
    seed: int = 0,
    progress: bool = True,
    log_every: int = 10,
    tools=None,
    draw: str = "auto",
    world: World = SingleProcess(),
) -> dict:
    """Sample n completions per row, check them, and report pass@k and maj@k for every k.
    With `tools` (a `grpo.rollout.tools.Toolbox`), multi-turn samples: the verifier gets
    each as its messages, the votes are read from its last turn, and mean_length counts the
    model's turns.

    Returns a JSON-serialisable dict: n, prompts, temperature, top_p, max_new_tokens, seed, draw,
    "pass@k" and "maj@k" ({str(k): mean over prompts}), "pass@k_ci" and "maj@k_ci"
    ({str(k): [lo, hi]}, normal 95% intervals over prompts clipped to [0, 1]), accuracy
    (mean fraction correct = pass@1), no_answer (fraction of completions without an
    answer), mean_length (characters), mean_tokens (tokens), truncated (the fraction of
    samples cut at max_new_tokens: a budget that cuts many reads answers the model had not
    finished), per_prompt ([{prompt, correct, answers: {answer:
    count}, no_answer, pass@k, maj@k}], the last two this prompt's values by str(k)), time_s (all of it) and time_metrics_s (what follows the sampling:
    reading the answers and the metrics).
    ks beyond n are dropped with a warning on stderr.

    Each prompt's completions are checked as soon as they are sampled, so that the progress
    (`progress`: a bar on a terminal, else a line every `log_every` prompts) shows the
    running pass@1.

    `world` (a `grpo.infra.distributed` World; default one process): every process of it
    calls this with the same model and rows, samples and checks its share of the prompts
    (`sample_completions`' `share`), and gets the report of all of them, the one a single
    process gives (each call draws from its own seed: the samples do not depend on who drew
    them). A UserError in one process (a verifier that fails) is raised in every one.
    """
    ks = valid_ks(ks, n)  # fail (or warn) before sampling, not after
    if batch_size < 1:
        raise UserError(f"batch_size must be at least 1, got {batch_size}")
    if not rows:
        raise UserError("no rows to evaluate")
    start = time.perf_counter()
    verdicts: list[list[bool] | None] = [None] * len(rows)
    correct = checked = 0

    def check(i: int, group: list[str]) -> dict:
        nonlocal correct, checked
        verdicts[i] = verifier.check_all(group, rows[i])
        correct, checked = correct + sum(verdicts[i]), checked + len(group)
        return {"pass@1": f"{correct / checked:.3f}"}

    lengths: dict = {}
    sample = lambda: sample_completions(  # noqa: E731
        model,
        tokenizer,
        rows,
        n=n,
        prompt_column=prompt_column,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        seed=seed,
        progress=progress,
        log_every=log_every,
        on_prompt=check,
        tools=tools,
        draw=draw,
        lengths=lengths,
        share=(world.rank, world.world_size),
    )
    if world.world_size == 1:
        completions = sample()
    else:
        completions, verdicts, lengths = _gathered(world, sample, verdicts, lengths)
    sampled = time.perf_counter()
    report = measure(completions, rows, ks=ks, verifier=verifier, prompt_column=prompt_column, verdicts=verdicts)
    done = time.perf_counter()
    per_prompt = report.pop("per_prompt")
    return {
        "n": report.pop("n"),
        "prompts": report.pop("prompts"),
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "draw": draw,
        **report,
        # None where the sampler counted nothing (a stand-in for sample_completions)
        "mean_tokens": lengths["tokens"] / lengths["samples"] if lengths.get("samples") else None,
        "truncated": lengths["cut"] / lengths["samples"] if lengths.get("samples") else None,
        "time_s": done - start,
        "time_metrics_s": done - sampled,
        "per_prompt": per_prompt,
    }


def _gathered(world: World, sample: Callable[[], list[list]], verdicts: list, lengths: dict) -> tuple:
    """This process's share sampled (`sample`, which fills in `verdicts` and `lengths`), then
    every process's prompts (their completions and verdicts) and lengths, in every process:
    what one process sampling them all would hold. A UserError in any process is raised in
    all, so that none waits for another in the gathering."""
    try:
        completions, error = sample(), None
    except UserError as err:
        completions, error = [[] for _ in verdicts], str(err)
    mine = [(i, group, verdicts[i]) for i, group in enumerate(completions) if group]
    parts = world.gather_objects((mine, lengths, error))
    errors = [error for _, _, error in parts if error is not None]
    if errors:
        raise UserError(errors[0])
    completions, verdicts, total = [[] for _ in verdicts], [None] * len(verdicts), {}
    for part, counts, _ in parts:
        for i, group, flags in part:
            completions[i], verdicts[i] = group, flags
        for key, value in counts.items():
            total[key] = total.get(key, 0) + value
    return completions, verdicts, total


def evaluate_saved(model_dir: str | Path, rows: list[dict], **kwargs) -> dict:
    """`evaluate` on a model directory (a `final/` or a `grpo sft` output), loaded on the CPU."""
    from transformers import AutoModelForCausalLM

    from grpo.infra.hf import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return evaluate(model, load_tokenizer(str(model_dir), "model"), rows, **kwargs)
