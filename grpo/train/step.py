"""One RL step on a sampled batch, the same for GRPO and PPO: score, baseline, update.

The batch comes from the run's Generator (grpo.rollout.generator; the loop takes it). The
step is two halves: `collect` (score, the truncation and group filters) and `learn` (the
passes before the update, the baseline, the update); `train_step` is the two in sequence.

The algorithms differ in exactly three places, the seams of `grpo.train.seams`, chosen once
when the engine is built: the baseline (group, or critic + GAE), the KL placement (in the
loss, or in the per-token reward) and the critic (none, or a value model trained beside the
policy). Nothing below asks which algorithm it runs.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from grpo.algo import aggregate, clipped_fraction, kl_estimate, policy_loss
from grpo.config import LossConfig, RolloutConfig, TrainConfig
from grpo.errors import UserError
from grpo.infra.distributed import SingleProcess, World
from grpo.infra.memory import peak_memory_mb, release_free_memory
from grpo.rewards import WeightedReward
from grpo.rewards.logged import RewardLog, merge_metrics
from grpo.rollout import Rollout
from grpo.train.models import activation_checkpointing, autocast, trainable_parameters
from grpo.train.layouts import Layout, layout_named, micro_batches, no_grad_pass, policy_logprobs, update_layout
from grpo.train.networks import Reference
from grpo.train.engine_correction import METRICS as MISMATCH_METRICS
from grpo.train.engine_correction import Mismatch
from grpo.train.scorers import Scorer
from grpo.train.optimizers import Optimizer
from grpo.train.seams import Baseline, Critic, KLPlacement, NoCritic, Passes, Scored, Targets


@dataclass(frozen=True)
class Decisions:
    """What building the engine decided, once, from the config and the model: read from here,
    never from the config (which keeps what was asked). `checkpointing`: activation
    checkpointing, where train.gradient_checkpointing asks for it, the model supports it and
    its log-probs stay the model's own; `layout`: the layout of the policy's passes in that
    mode (grpo.train.layouts.decide_layouts), and `no_grad_layout` that of its passes without
    a gradient (eval mode: the old policy's, the reference's); `chunked_head`: the LM head run
    chunk by chunk, where train.chunked_head asks for it and the model's logits are its plain
    head's. Never set on the model: the passes are handed the layouts built from these
    (`no_grad_passes`, `Engine.update_layout`)."""

    checkpointing: bool
    layout: str
    chunked_head: bool
    no_grad_layout: str

    @property
    def no_grad_passes(self) -> Layout:
        """The layout of the policy's passes without a gradient (and of its reference's), with
        the head's verdict (grpo.train.layouts.Verdicts)."""
        return layout_named(self.no_grad_layout, chunked_head=self.chunked_head)


@dataclass
class Engine:
    """What a step needs: the models, the optimizer, the three seams, the rewards, and the
    config sections they were built from (the one home of every setting)."""

    policy: nn.Module
    tokenizer: object  # the caller's, unchanged; saved with the trained model
    rewards: list[WeightedReward]
    score: Scorer  # OutcomeScorer, or ProcessScorer (process supervision)
    reference: Reference
    baseline: Baseline
    kl: KLPlacement
    critic: Critic | NoCritic
    optimizer: Optimizer  # clips, steps and schedules the learning rate (grpo.train.optimizers)
    rollout: RolloutConfig
    train: TrainConfig
    loss: LossConfig
    prompt_column: str
    decisions: Decisions  # what was decided from the config and the model (read here, not in `train`)
    device: torch.device = torch.device("cpu")  # train.device, resolved: every model and batch lives there
    # train.autocast, resolved: the forward passes' dtype (None = the weights')
    compute_dtype: torch.dtype | None = None
    world: World = field(default_factory=SingleProcess)  # the processes of a data-parallel run (grpo.infra.distributed)

    @property
    def policy_params(self) -> list:
        return trainable_parameters(self.policy)

    @property
    def version(self) -> int:
        """The policy's version: the optimizer steps its weights have taken (the scheduler
        counts them, and a checkpoint keeps the count)."""
        return self.optimizer.version

    def needs_old_logprobs(self, batch: Rollout) -> bool:
        """Whether the update needs a pass of its own for the old policy's log-probs. Not for
        a batch the current weights sampled, with one epoch and one minibatch: the old policy
        is then the current one (ratio 1), so its log-probs are the update's own, detached.
        Otherwise the policy moves between updates, or the batch was sampled by earlier
        weights (its policy_version behind this one); and PPO's KL-in-reward reads them
        before any update."""
        needed = self.policy_moves or batch.policy_version != self.version or self.kl.needs_old_logprobs
        return needed and not self.old_logprobs_from_sampler(batch)

    @functools.cached_property
    def update_layout(self) -> Layout:
        """The layout of the update's forward, chosen once (grpo.train.layouts.update_layout):
        the policy's, its prompt shared in a pass of its own only where every forward may be
        more than one pass (one process, every gradient held until the optimizer steps)."""
        one_pass = self.world.world_size > 1 or not self.optimizer.holds_all_gradients
        return update_layout(self.decisions.layout, one_pass=one_pass, chunked_head=self.decisions.chunked_head)

    @property
    def policy_moves(self) -> bool:
        """Whether the policy takes an optimizer step before the step's last update."""
        return self.train.epochs > 1 or self.train.minibatches > 1

    def old_logprobs_from_sampler(self, batch: Rollout) -> bool:
        """Whether the sampler's log-probs stand for the old policy's (train.old_logprobs):
        always with sampler; with auto, for a batch that earlier weights drew (asynchronous
        rollouts: those weights are gone, and the sampler's log-probs are the sampling
        policy's, the ratio's anchor off-policy; docs/async.md), and where a pass would
        otherwise run over a batch that the current weights drew, with log-probs that are the
        trainer's own up to float rounding (`logprobs_exact`): the pass would recompute the
        same numbers. (Where no pass is needed, the update's own log-probs, detached, are the
        old ones, and the sampler's are measured against them.) A one-line error where the
        sampler's were needed and the decoder gave none."""
        mode = self.train.old_logprobs
        stale = batch.policy_version != self.version
        if (mode == "sampler" or (mode == "auto" and stale)) and batch.sampled_logprobs is None:
            raise UserError(
                f"train.old_logprobs: {mode}, but this batch's decoder (transformers' generate) returned no "
                "log-probs, which a batch sampled by other weights than the current ones needs"
                if stale
                else "train.old_logprobs: sampler, but this batch's decoder (transformers' generate) returned no log-probs; use auto or recompute"
            )
        if mode != "auto":
            return mode == "sampler"
        if stale:
            return True
        needed = self.policy_moves or self.kl.needs_old_logprobs
        return needed and batch.logprobs_exact


@dataclass
class StepResult:
    metrics: dict
    rollout: Rollout  # everything sampled, including groups left out of the update
    scores: Tensor  # (N,) their rewards
    columns: dict[str, list] = field(default_factory=dict)  # log_extra's: column -> one value per row of `rollout`
    per_function: dict[str, Tensor] = field(default_factory=dict)  # name -> (N,) unweighted scores, NaN where None
    truncated: Tensor | None = None  # (N,) bool: cut off at max_new_tokens (no EOS)
    advantages: Tensor | None = None  # (N,) what the update gave each row (`Collected.advantages`)


@dataclass
class Collected:
    """One step's experience, scored and filtered: what `learn` trains on and what the step's
    metrics report, self-contained (it may wait for its update while another is collected)."""

    batch: Rollout  # what the update trains on: the groups kept, the truncated ones' tokens out of the loss
    scored: Scored  # (len(batch),) its rewards
    sampled: Rollout  # everything sampled, kept or not
    sampled_scored: Scored  # (N,) everything sampled's rewards
    truncated: Tensor  # (N,) bool: cut off at max_new_tokens (no EOS)
    spread: Tensor  # (N/G,) bool: the group's scored rewards are not all equal
    seconds: dict  # time spent: "generate", "score", "collect" (the whole of it)
    kept: Tensor | None = None  # the rows of `sampled` that `batch` holds (None: every one)
    # (N,) each sampled row's advantage as `learn` computed it (its mean over its loss tokens
    # where advantages are per token); NaN for a row the update left out. Set by `learn`.
    advantages: Tensor | None = None


def _groups_with_spread(scores: Tensor, group_size: int) -> Tensor:
    """(N/G,) bool: groups whose scored rewards are not all equal (their advantages move the policy)."""
    groups = scores.view(-1, group_size)
    lo = torch.where(torch.isnan(groups), torch.inf, groups).min(1).values
    hi = torch.where(torch.isnan(groups), -torch.inf, groups).max(1).values
    return hi > lo


def _placeholder(sampled: Rollout, steps: list | None) -> tuple[Rollout, Scored]:
    """A group that weighs nothing: the first sampled group with an empty loss mask and no
    score. A process whose every group was dropped still runs the collectives of a step on
    it, while the other processes train on theirs."""
    group = sampled.select(torch.arange(sampled.group_size))
    group.loss_mask = torch.zeros_like(group.loss_mask)
    scores = torch.full((len(group),), math.nan, device=group.loss_mask.device)
    return group, Scored(scores, None if steps is None else [[] for _ in range(len(group))])


def train_step(e: Engine, sampled: Rollout, step: int = 0, generate_seconds: float = 0.0) -> StepResult:
    """One step on `sampled` (this process's share of the step's prompts, G completions
    each, drawn by a Generator, grpo.rollout.generator): collect (score, filter), then learn
    (passes, baseline, update). Every statistic over the batch (counts, reward scaling,
    whitening, the metrics) is one over all processes' rows. `step`: the steps done before
    this one (what reward functions see as trainer_state.global_step); `generate_seconds`:
    what sampling it took (time/generate)."""
    collected = collect(e, sampled, step, generate_seconds)
    metrics = learn(e, collected)
    scored = collected.sampled_scored
    return StepResult(
        metrics,
        collected.sampled,
        scored.scores.cpu(),
        {} if scored.log is None else scored.log.columns,
        {name: s.cpu() for name, s in scored.per_function.items()},
        collected.truncated.cpu(),
        collected.advantages,
    )


def collect(e: Engine, sampled: Rollout, step: int = 0, generate_seconds: float = 0.0) -> Collected:
    """Score the G completions of each prompt in `sampled` (stamped with the version of the
    weights that drew it), and filter what the update sees: the truncation mask
    (loss.mask_truncated_completions) and the group filter (loss.drop_zero_std_groups)."""
    start = time.perf_counter()
    group_size, world = e.rollout.group_size, e.world
    batch = sampled = sampled.to(e.device)
    lengths = batch.completion_lengths  # (N,) of everything generated, kept or not

    # 1. Score them; NaN = no reward function could score it. With process supervision a
    #    completion's score is its mean step reward (for the metrics and the group spread).
    prompts = [row[e.prompt_column] for row in batch.rows]
    # A reward that fails in one process fails the step in all (each raises the same
    # UserError), so none waits for it in a collective and all can save together.
    completion_ids = [
        ids[:n] for ids, n in zip(batch.completion_ids.tolist(), lengths.long().tolist())
    ]  # up to and including EOS
    trainer_state = SimpleNamespace(global_step=step, max_steps=e.train.steps)  # what TRL's reward functions read
    columns, completions = batch.reward_columns(exclude=e.prompt_column), batch.scored_completions
    scored = sampled_scored = world.checked(
        lambda: e.score(
            e.rewards,
            prompts,
            completions,
            columns,
            completion_ids=completion_ids,
            trainer_state=trainer_state,
            log=RewardLog(len(completions)),  # TRL's log_metric and log_extra write here
        )
    ).to(batch.completion_mask.device)
    scored_at = time.perf_counter()

    # Completions cut off at max_new_tokens (no EOS at their last token); with
    # loss.mask_truncated_completions (DAPO's overlong filtering) their tokens leave the
    # loss, after they were scored. They stay there (attended to, counted in the lengths).
    truncated = batch.ended_without_eos(e.tokenizer.eos_token_id)  # (N,)
    if e.loss.mask_truncated_completions:
        batch = batch.select(torch.arange(len(batch)))  # a copy: `sampled` keeps its mask
        batch.loss_mask = batch.loss_mask * (~truncated).unsqueeze(1).to(batch.loss_mask.dtype)

    # DAPO-style: groups whose rewards are all equal have zero advantage; optionally drop them.
    spread = _groups_with_spread(scored.scores, group_size)  # (N/G,)
    keep = None
    if e.loss.drop_zero_std_groups:
        keep = spread.repeat_interleave(group_size).nonzero().squeeze(1)
        batch, scored = batch.select(keep), scored.select(keep)
    seconds = {
        "generate": generate_seconds,
        "score": scored_at - start,
        "collect": generate_seconds + time.perf_counter() - start,
    }
    return Collected(batch, scored, sampled, sampled_scored, truncated, spread, seconds, keep)


def learn(e: Engine, collected: Collected) -> dict:
    """Train on what `collect` gave: the passes before the update, the advantages, mu epochs
    of updates. Returns the step's metrics."""
    start = time.perf_counter()
    batch, scored = collected.batch, collected.scored
    trained_rows = int(e.world.sum(torch.tensor(len(batch))))  # over all processes

    # Nothing to train on: no statistic of the update.
    stats = dict.fromkeys(("loss", "kl", "entropy", "clip_fraction", "grad_norm", *MISMATCH_METRICS))
    collected.advantages = torch.full((len(collected.sampled),), math.nan)
    if trained_rows:
        live = torch.ones(len(batch), dtype=torch.bool)  # (N,) rows that count (not a placeholder's)
        if not len(batch):
            batch, scored = _placeholder(collected.sampled, collected.sampled_scored.steps)
            live = torch.zeros(len(batch), dtype=torch.bool)
        # 2. The passes before the update: the reference's, the old policy's, the critic's.
        passes = _passes(e, batch)

        # 3. Advantages: from the group (GRPO) or from the critic (PPO).
        targets = e.baseline(batch, scored, passes)
        if live.all():
            rows = slice(None) if collected.kept is None else collected.kept.cpu()
            collected.advantages[rows] = _row_advantages(targets.advantages, batch.loss_mask)

        # 4. Update: mu epochs over minibatches, accumulating micro-batches.
        stats = _update(e, batch, targets, passes, live, trained_rows)
        release_free_memory()  # the update's transients, free now, not kept under the next sampling
    if e.device.type == "cuda":
        torch.cuda.synchronize(e.device)  # GPU work is asynchronous: time the step's, not its launch
    return _metrics(e, collected, batch, stats, time.perf_counter() - start)


def _row_advantages(advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """(N,) on the CPU: each row's advantage; where they are per token (N, T), the mean over
    the row's tokens in the loss (NaN for a row with none)."""
    if advantages.dim() == 2:
        mask = loss_mask.to(advantages.dtype)
        advantages = (advantages.detach() * mask).sum(1) / mask.sum(1)
    return advantages.detach().float().cpu()


def _passes(e: Engine, batch: Rollout) -> Passes:
    """The no-grad passes before the update: the reference's log-probs, the old policy's (when
    the policy moves before the last update, or moved since it sampled the batch; or the
    sampler's, per train.old_logprobs) and the critic's values. In micro-batches,
    like the update, so that no pass holds the whole batch's activations. Every log-prob is
    of the distribution sampled from, up to truncation: at the rollout's temperature and
    repetition penalty (docs/sampling.md). Each micro-batch is cut to its longest
    completion (and ordered by length first, with train.length_grouping); the passes' (N, T)
    results are 0 past every mask."""
    size, temperature, penalty = e.train.micro_batch_size, e.rollout.temperature, e.rollout.repetition_penalty
    by_length = e.train.length_grouping
    from_sampler = e.old_logprobs_from_sampler(batch)
    old_pass = e.needs_old_logprobs(batch)
    # The policy gathered whole only when a pass runs it: the old policy's, or the reference's
    # when that is the policy with its adapters off (LoRA). Gathered, a pass runs no collective,
    # so a process may run fewer than another (a placeholder's rows).
    policy_pass = [e.policy] if old_pass or e.reference.runs_policy else []
    with autocast(e.policy, e.compute_dtype), e.world.gathered(*policy_pass, *e.critic.networks):
        if from_sampler:  # (N, T), 0 past each completion as sampled
            old = batch.sampled_logprobs
        elif old_pass:
            layout = e.decisions.no_grad_passes
            old = no_grad_pass(
                lambda b: policy_logprobs(e.policy, b, temperature, penalty, e.decisions.chunked_head, layout=layout),
                batch,
                size,
                by_length=by_length,
            )
        else:
            old = None
        return Passes(
            ref_logprobs=no_grad_pass(
                lambda b: e.reference.logprobs(b, temperature, penalty), batch, size, by_length=by_length
            ),  # (N, T) or None
            old_logprobs=old,
            old_values=e.critic.values(batch, size, by_length),  # (N, T) or None
            old_from_sampler=from_sampler,
        )


def _metrics(e: Engine, collected: Collected, batch: Rollout, stats: dict, update_seconds: float) -> dict:
    """The step's line of metrics.jsonl, over every process's rows: the rewards and lengths of
    everything sampled, the update's `stats`, the step's times and peak memory. `batch`:
    what the update trained on (its tokens in the loss are "tokens/trained"; a placeholder's
    rows have none)."""
    c, world, group_size = collected, e.world, e.rollout.group_size
    scored, sampled = c.sampled_scored, c.sampled
    # Every process's rows, in one collective: (N * processes, 4 + functions).
    per_row = [
        scored.scores,
        sampled.completion_lengths,
        c.truncated,
        c.spread.repeat_interleave(group_size),
        *scored.per_function.values(),
    ]
    everyone, _ = world.gather(torch.stack([v.float().cpu() for v in per_row], 1))
    total, all_lengths, all_truncated, all_spread = everyone[:, :4].unbind(1)
    finite = total[~torch.isnan(total)]
    logged = float(scored.log is not None and bool(scored.log.metrics))  # any log_metric call here
    counts = world.sum(
        torch.tensor([float(batch.loss_mask.sum()), sampled.truncated_prompts, logged], dtype=torch.float64)
    )
    metrics = {
        "reward/mean": float(finite.mean()) if len(finite) else math.nan,
        "reward/std": float(finite.std()) if len(finite) > 1 else 0.0,
        **{f"reward/{name}": float(torch.nanmean(everyone[:, 4 + i])) for i, name in enumerate(scored.per_function)},
        **stats,
        "tokens/completion": int(all_lengths.sum()),
        "tokens/trained": int(counts[0]),
        "completion_length/mean": float(all_lengths.mean()),
        "frac_zero_std_groups": float(1.0 - all_spread.mean()),  # a group's G rows share its spread
        "frac_unscored": float(torch.isnan(total).float().mean()),
        "frac_truncated": float(all_truncated.mean()),  # cut off at max_new_tokens
        "prompts/truncated": int(counts[1]),  # cut to rollout.max_prompt_length
        "lr": e.optimizer.lr,
        "time/step": c.seconds["collect"] + update_seconds,
        "time/generate": c.seconds["generate"],
        "time/score": c.seconds["score"],
        "time/update": update_seconds,
        "memory/peak_mb": float(world.max(torch.tensor(peak_memory_mb(e.device)))),
        **_tool_metrics(world, sampled),
    }
    return {**metrics, **(_logged_metrics(world, scored.log, metrics) if counts[2] else {})}


def _logged_metrics(world, log: RewardLog | None, ours: dict) -> dict:
    """What the reward functions logged with log_metric, over every process (each name's mean
    of all its calls; one more collective, only in a step where some process logged). A name
    of one of the step's own metrics is refused: it would hide one or the other."""
    logged = merge_metrics(world.gather_objects({} if log is None else log.metrics))
    taken = sorted(set(logged) & set(ours))
    if taken:
        raise UserError(
            f"a reward function called log_metric({taken[0]!r}, ...): the step's metrics have a {taken[0]!r} "
            "of their own; choose another name"
        )
    return logged


def _tool_metrics(world, sampled: Rollout) -> dict:
    """Multi-turn rollouts (none for single-turn ones), over every process's rows: tool calls
    per rollout, calls answered with an error (a count), and the share of completion tokens
    that are the tools' (in the completion, out of the loss)."""
    if sampled.tool_calls is None:
        return {}
    tool_tokens = (sampled.completion_mask - sampled.loss_mask).clamp(min=0).sum()
    totals = world.sum(
        torch.tensor(
            [
                float(sampled.tool_calls.sum()),
                float(sampled.tool_failures.sum()),
                float(len(sampled)),
                float(tool_tokens),
                float(sampled.completion_mask.sum()),
            ],
            dtype=torch.float64,
        )
    ).tolist()
    calls, failures, rollouts, tool_tokens, tokens = totals
    return {
        "tools/calls_per_rollout": calls / max(rollouts, 1.0),
        "tools/failures": int(failures),
        "tools/mask_fraction": tool_tokens / max(tokens, 1.0),
    }


def _micro_batch_plan(world, n: int, minibatches: int, micro_batch_size: int) -> list[int]:
    """Forward/backward passes per minibatch, the same in every process: the most any process
    needs (a sharded model's passes are collectives, so every process runs as many; one
    with fewer rows pads with passes that weigh nothing)."""
    sizes = [len(m) for m in torch.tensor_split(torch.arange(n), minibatches)]
    counts = torch.tensor([math.ceil(s / micro_batch_size) if micro_batch_size else int(s > 0) for s in sizes])
    return world.max(counts).tolist()


def _update(e: Engine, batch: Rollout, targets: Targets, passes: Passes, live: Tensor, trained_rows: int) -> dict:
    """mu epochs of clipped-ratio updates; returns the step's loss, KL, entropy, clipping, grad
    norm (and the critic's own metrics). A loss is divided by the whole batch's counts (over
    all processes), so the processes' gradients sum to the whole batch's gradient. Every
    loss, count and statistic of the policy is over the loss mask's tokens (its actions).
    Where the rollout carries the sampler's log-probs, loss.engine_correction weighs each
    token's policy-gradient term against the old policy (grpo.train.engine_correction)."""
    n, world = len(batch), e.world
    mask = batch.loss_mask
    lo, tr = e.loss, e.train
    clip = dict(clip_low=lo.clip_low, clip_high=lo.clip_high, level=lo.ratio_level)
    sums = dict.fromkeys(("loss", "kl", "entropy", "clip_fraction", "value_loss", "first_pass_tokens"), 0.0)
    grad_norm, updates = 0.0, 0
    mismatch = Mismatch(lo.engine_correction, lo.engine_correction_cap)
    plan = _micro_batch_plan(world, n, tr.minibatches, tr.micro_batch_size)
    for epoch in range(tr.epochs):
        order = torch.randperm(n) if tr.minibatches > 1 else torch.arange(n)
        for minibatch, passes_needed in zip(torch.tensor_split(order, tr.minibatches), plan):
            totals = dict(
                num_sequences=float(world.sum(live[minibatch].sum())),
                num_tokens=float(world.sum(mask[minibatch].sum())),
                max_tokens=e.rollout.max_new_tokens,
            )
            # Similar lengths side by side (train.length_grouping), each process its own rows:
            # the number of micro-batches of train.micro_batch_size, and so of passes, does not
            # change; by train.micro_batch_tokens it follows the rows' lengths.
            micros = micro_batches(
                batch,
                minibatch,
                tr.micro_batch_size,
                by_length=tr.length_grouping,
                whole_groups=e.update_layout.whole_groups,
                tokens=tr.micro_batch_tokens,
            )
            if tr.micro_batch_tokens:  # the passes a process needs depend on its rows' lengths
                passes_needed = int(world.max(torch.tensor(len(micros))))
            padding = [None] * (passes_needed - len(micros))  # passes that weigh nothing: row 0, its loss mask emptied
            for micro in micros + padding:
                weightless = micro is None
                micro = torch.zeros(1, dtype=torch.long) if weightless else micro
                part = batch.select(micro)
                if weightless:
                    part.loss_mask = torch.zeros_like(part.loss_mask)
                # Cut to its longest completion (and prompt): T' <= T columns; every per-token
                # tensor of these rows is cut alike (`fit`), so the loss sees the same tokens.
                part = part.trimmed()
                rows = 0.0 if weightless else float(live[micro].sum())  # sequences it counts
                m = part.loss_mask  # (n, T')
                # As sampled (and as the passes above scored); the entropy, a metric, on the first epoch.
                logprobs, entropy = _policy_logprobs(e, part, with_entropy=epoch == 0)  # (n, T'), (n, T') or None
                old = part.fit(passes.old_logprobs[micro]) if passes.old_logprobs is not None else logprobs.detach()
                ref = part.fit(passes.ref_logprobs[micro]) if passes.ref_logprobs is not None else None
                advantages = part.fit(targets.advantages[micro])  # (n,) or (n, T')
                # The engine's mismatch: weights of the policy-gradient term and of the whole loss.
                # Nothing to weigh (or measure) where the sampler's log-probs are the old ones.
                engine = None if passes.old_from_sampler else part.sampled_logprobs
                pg_weight, kept = mismatch.weigh(old, engine, m, tally=epoch == 0)  # (n, T') or 1.0
                per_token = policy_loss(logprobs, old, advantages, m, **clip, dual_clip=lo.dual_clip) * pg_weight
                per_token = (
                    per_token + e.kl.loss_term(logprobs, ref, m)  # GRPO: + beta * KL; PPO: 0 (it is in the reward)
                ) * kept
                value_loss = e.critic.loss(part, micro, passes, targets, totals["num_tokens"])  # 0 without a critic
                loss = aggregate(per_token, m, lo.aggregation, **totals) + value_loss
                loss.backward()
                sums["loss"] += float(loss.detach())
                sums["value_loss"] += float(value_loss.detach())
                if epoch == 0:  # diagnostics of the policy as sampled
                    with torch.no_grad():
                        sums["first_pass_tokens"] += float(m.sum())
                        sums["entropy"] += float((entropy * m).sum())
                        if ref is not None:  # the KL the run moved, wherever its penalty goes
                            sums["kl"] += float((kl_estimate(logprobs.detach(), ref, lo.kl_estimator) * m).sum())
                sums["clip_fraction"] += float(clipped_fraction(logprobs, old, advantages, m, **clip)) * rows
            grad_norm += e.optimizer.step()  # clipped, stepped, scheduled: the policy's norm before clipping
            e.optimizer.zero_grad()
            updates += 1
    keys = list(sums)
    sums = dict(zip(keys, world.sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64)).tolist()))
    tokens = max(sums["first_pass_tokens"], 1.0)
    return {
        "loss": sums["loss"] / updates,
        "kl": sums["kl"] / tokens if passes.ref_logprobs is not None else None,
        "entropy": sums["entropy"] / tokens,
        "clip_fraction": sums["clip_fraction"] / (trained_rows * tr.epochs),
        "grad_norm": grad_norm / updates,
        **mismatch.metrics(world),
        **e.critic.metrics(sums["value_loss"] / updates, passes, mask, world),
    }


def _policy_logprobs(e: Engine, part: Rollout, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """The policy's forward for the update, to its log-probs at the rollout's temperature and
    repetition penalty (and the entropy, when asked): in bf16 under train.autocast (the
    backward follows its dtypes); through the head chunk by chunk (train.chunked_head); with
    checkpointing, in training mode (a group's prompt still runs once; the prompt's pass and
    the completions' are both checkpointed, layer by layer: grpo.train.layouts)."""
    with autocast(e.policy, e.compute_dtype), activation_checkpointing(e.policy, e.decisions.checkpointing):
        return e.update_layout.logprobs(
            e.policy,
            part,
            e.rollout.temperature,
            e.rollout.repetition_penalty,
            chunked_head=e.decisions.chunked_head,
            with_entropy=with_entropy,
        )
