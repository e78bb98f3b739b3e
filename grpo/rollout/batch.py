"""The Rollout: one step's prompts and sampled completions, as tensors and as text."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo.errors import UserError


@dataclass
class Rollout:
    """N = prompts * G rows; rows g*G .. g*G+G-1 are the G completions of prompt g.

    `input_ids` holds each prompt (left-padded to P) followed by its completion
    (right-padded to T), so one forward pass scores the completion tokens. A prompt longer
    than rollout.max_prompt_length keeps its last tokens (see `Sampler`); `prompt_truncated`
    says which rows' prompts lost their start.

    Two masks over the completion columns, for two jobs. `completion_mask` marks the tokens
    that are there (attended to, counted in a completion's length, kept by `trimmed`);
    `loss_mask` marks the tokens that are the policy's actions and enter the loss (and every
    statistic of the policy: KL, entropy, clipping, the critic's targets). A single-turn
    sample's two masks are equal; a tool's or an environment's tokens inside a completion
    are in the first and not in the second, as is a whole completion the step leaves out of
    the loss (a truncated one under loss.mask_truncated_completions).
    """

    input_ids: Tensor  # (N, P + T) long
    attention_mask: Tensor  # (N, P + T) long: 1 on real prompt and completion tokens
    completion_mask: Tensor  # (N, T) float: 1 on completion tokens up to and including EOS
    prompts: list[
        str
    ]  # (N,) the prompt text fed to the model (chat template applied; a truncated prompt's kept tokens, decoded)
    completions: list[str]  # (N,) decoded completion text, without special tokens
    rows: list[
        dict
    ]  # (N,) the data row of each completion (its prompt's row, repeated; with an environment whose reset added text, its prompt so)
    group_size: int
    # (N,) bool: the row's prompt was cut to its last rollout.max_prompt_length tokens. Per
    # row, so that `select` keeps it right; None (a rollout built by hand) = no prompt was cut.
    prompt_truncated: Tensor | None = None
    # (N, T) float: 1 where the token is the policy's action and in the loss; None (a rollout
    # built by hand, or a single-turn sample) = a copy of completion_mask.
    loss_mask: Tensor | None = None
    # (N, T) float: the decoder's log-probs of the tokens it sampled (0 past each completion),
    # under the distribution it drew from; None when the decoder gives none.
    sampled_logprobs: Tensor | None = None
    # The optimizer steps the sampling weights had taken: the policy that drew this rollout.
    policy_version: int = 0
    # Whether sampled_logprobs are the trainer's own up to float rounding (the decoder's
    # `exact_logprobs`: the policy's float32 weights, the distribution the loss scores).
    logprobs_exact: bool = False
    # Multi-turn rollouts (grpo.rollout.turns); None for a single-turn sample:
    # (N,) each completion as chat messages: the model's turns (with their tool_calls) and the
    # tool messages that answered them, what reward functions get as `completions` (as TRL gives them).
    messages: list[list[dict]] | None = None
    environments: list | None = None  # (N,) each rollout's environment instance (rollout.environment)
    tool_calls: Tensor | None = None  # (N,) float: tool calls answered in each rollout
    tool_failures: Tensor | None = None  # (N,) float: of those, the ones answered with an error

    def __post_init__(self):
        if self.prompt_truncated is None:
            self.prompt_truncated = torch.zeros(len(self), dtype=torch.bool, device=self.input_ids.device)
        if self.loss_mask is None:
            self.loss_mask = self.completion_mask.clone()

    @classmethod
    def empty(cls, group_size: int) -> Rollout:
        """A rollout of no rows: a process's part of a batch split over more processes than it
        has prompts (iterative RL's, grpo.train.iterative)."""
        ids = torch.zeros(0, 1, dtype=torch.long)
        return cls(ids, ids.clone(), torch.zeros(0, 1), prompts=[], completions=[], rows=[], group_size=group_size)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_ids(self) -> Tensor:  # (N, T)
        return self.input_ids[:, -self.completion_mask.shape[1] :]

    @property
    def truncated_prompts(self) -> int:
        """How many distinct prompts were truncated: truncated rows / G (a prompt's G rows share
        its prompt). Exact for a sample and for any selection of whole groups."""
        return int(self.prompt_truncated.sum()) // self.group_size

    @property
    def position_ids(self) -> Tensor:  # (N, P + T): positions count real tokens only
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    def columns(self, exclude: str) -> dict[str, list]:
        """The data's other columns, one value per completion (what reward functions get)."""
        keys = [k for k in self.rows[0] if k != exclude] if self.rows else []
        return {k: [row.get(k) for row in self.rows] for k in keys}

    @property
    def scored_completions(self) -> list:
        """Each completion as reward functions get it: its text, or in a multi-turn rollout its
        messages (tool turns included), as TRL passes them."""
        return self.completions if self.messages is None else self.messages

    def reward_columns(self, exclude: str) -> dict[str, list]:
        """`columns`, and with an environment its instances as `environments` (as TRL passes them)."""
        columns = self.columns(exclude)
        if self.environments is not None:
            if "environments" in columns:
                raise UserError(
                    "data column 'environments' has the name of a reward-function argument; rename the column"
                )
            columns["environments"] = self.environments
        return columns

    def select(self, index: Tensor, trim: bool = False) -> Rollout:
        """The rows in `index` (a 1-D long tensor), e.g. a minibatch; with `trim`, `trimmed()`."""
        picked = index.tolist()
        part = Rollout(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            completion_mask=self.completion_mask[index],
            prompts=[self.prompts[i] for i in picked],
            completions=[self.completions[i] for i in picked],
            rows=[self.rows[i] for i in picked],
            group_size=self.group_size,
            prompt_truncated=self.prompt_truncated[index],
            loss_mask=self.loss_mask[index],
            sampled_logprobs=None if self.sampled_logprobs is None else self.sampled_logprobs[index],
            policy_version=self.policy_version,
            logprobs_exact=self.logprobs_exact,
            messages=None if self.messages is None else [self.messages[i] for i in picked],
            environments=None if self.environments is None else [self.environments[i] for i in picked],
            tool_calls=None if self.tool_calls is None else self.tool_calls[index.cpu()],
            tool_failures=None if self.tool_failures is None else self.tool_failures[index.cpu()],
        )
        return part.trimmed() if trim else part

    def trimmed(self) -> Rollout:
        """These rows without the columns that are padding in every row: the prompt's leading
        columns outside every attention mask and the completion's trailing columns outside
        every completion mask (at least one column of each is kept). What a forward pass of
        these rows needs, at no more width than its longest completion and prompt: causal
        attention lets no token see a later column, and positions count only real tokens
        (`position_ids`), so every kept position computes what it computes at full width.
        The completion columns kept are the first T' of T: `fit` cuts a per-token tensor of
        these rows to them."""
        t_len = self.completion_mask.shape[1]
        p_len = self.input_ids.shape[1] - t_len
        real = self.attention_mask[:, :p_len].bool().any(0)  # (P,)
        start = min(int(real.long().argmax()) if bool(real.any()) else p_len, max(p_len - 1, 0))
        scored = self.completion_mask.bool().any(0)  # (T,)
        keep = max(t_len - int(scored.flip(0).long().argmax()) if bool(scored.any()) else 0, min(t_len, 1))
        if start == 0 and keep == t_len:
            return self
        stop = p_len + keep
        return Rollout(
            input_ids=self.input_ids[:, start:stop],
            attention_mask=self.attention_mask[:, start:stop],
            completion_mask=self.completion_mask[:, :keep],
            prompts=self.prompts,
            completions=self.completions,
            rows=self.rows,
            group_size=self.group_size,
            prompt_truncated=self.prompt_truncated,
            loss_mask=self.loss_mask[:, :keep],
            sampled_logprobs=None if self.sampled_logprobs is None else self.sampled_logprobs[:, :keep],
            policy_version=self.policy_version,
            logprobs_exact=self.logprobs_exact,
            messages=self.messages,
            environments=self.environments,
            tool_calls=self.tool_calls,
            tool_failures=self.tool_failures,
        )

    def fit(self, x: Tensor) -> Tensor:
        """A per-token tensor of these rows, (n, T) at the untrimmed width, cut to this
        rollout's completion columns (the first T' of them, see `trimmed`); a per-sequence (n,)
        tensor as it is."""
        return x[:, : self.completion_mask.shape[1]] if x.dim() > 1 else x

    @property
    def completion_lengths(self) -> Tensor:  # (N,)
        return self.completion_mask.sum(1)

    def ended_without_eos(self, eos: int | None) -> Tensor:
        """(N,) bool: the rows whose last completion token is not `eos`, i.e. cut off at
        max_new_tokens rather than ended by the model (every row when there is no EOS)."""
        lengths = self.completion_lengths.long()
        last = self.completion_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)  # (N,)
        return (last != eos) if eos is not None else torch.ones_like(last, dtype=torch.bool)

    def to(self, device: torch.device | str) -> Rollout:
        self.input_ids = self.input_ids.to(device)
        self.attention_mask = self.attention_mask.to(device)
        self.completion_mask = self.completion_mask.to(device)
        self.prompt_truncated = self.prompt_truncated.to(device)
        self.loss_mask = self.loss_mask.to(device)
        if self.sampled_logprobs is not None:
            self.sampled_logprobs = self.sampled_logprobs.to(device)
        return self


def char_to_token_ends(tokenizer, completion_ids: list[int], char_ends: list[int]) -> list[int]:
    """Map character offsets in a decoded completion to token positions.

    A step that ends at character offset `end` (one past its last character) ends at the
    first token t whose decoded prefix ids[:t+1] is at least `end` characters long. Decoding
    prefixes (rather than tokens one by one) keeps multi-byte characters and merges right;
    a binary search keeps it to O(log T) decodes per step.
    """

    def decoded_length(t: int) -> int:
        return len(tokenizer.decode(completion_ids[: t + 1], skip_special_tokens=True))

    last = len(completion_ids) - 1
    ends = []
    for end in char_ends:
        lo, hi = 0, last
        while lo < hi:
            mid = (lo + hi) // 2
            if decoded_length(mid) >= end:
                hi = mid
            else:
                lo = mid + 1
        ends.append(lo)
    return ends
