"""Pure tensor math for GRPO and PPO: no config objects, no I/O, no model state.

Shapes: N completions (rows g*G .. g*G+G-1 are the G completions of prompt g), T completion
tokens, V vocabulary. Every function documents its formula and its source.
"""

from grpo.algo.advantages import ADVANTAGE_SCALES, gae, group_advantages, process_advantages, whiten
from grpo.algo.kl import KL_ESTIMATORS, kl_estimate, kl_penalized_rewards
from grpo.algo.logprobs import entropy, head_logprobs, token_logprobs
from grpo.algo.losses import (
    AGGREGATIONS,
    aggregate,
    bradley_terry_loss,
    pairwise_wins,
    clipped_fraction,
    policy_loss,
    policy_ratio,
    value_loss,
)

__all__ = [
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "aggregate",
    "bradley_terry_loss",
    "pairwise_wins",
    "clipped_fraction",
    "entropy",
    "gae",
    "group_advantages",
    "head_logprobs",
    "kl_estimate",
    "kl_penalized_rewards",
    "policy_loss",
    "policy_ratio",
    "process_advantages",
    "token_logprobs",
    "value_loss",
    "whiten",
]
