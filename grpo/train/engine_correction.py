"""The update's side of the train-inference mismatch (grpo.algo.correction): the weights of
loss.engine_correction for each micro-batch, and the step's mismatch metrics.

It runs wherever the rollout carries the sampler's log-probs (`Rollout.sampled_logprobs`):
an engine's, and our fast loop's (whose numbers are the trainer's own up to float rounding
while it draws from the distribution the loss scores, so its weights are 1 to ~1e-5). The
trainer's side is the old policy's log-probs, the anchor of the loss's ratio: the old-policy
pass where one ran, else the update's own first pass, detached (the same weights that
sampled). A rollout without sampler log-probs (`generate`) is neither corrected nor measured.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo.algo.correction import engine_correction, mismatch_kl, mismatch_log_ratio
from grpo.infra.distributed import World

METRICS = ("rollout/mismatch_kl", "rollout/mismatch_ratio_max", "rollout/frac_corrected")


class Mismatch:
    """One update's correction: `weigh` gives each micro-batch's weights and, when asked,
    tallies its tokens; `metrics` reduces the tallies over every process."""

    def __init__(self, mode: str, cap: float):
        self.mode, self.cap = mode, cap
        self.sums = torch.zeros(3, dtype=torch.float64)  # KL summed, tokens, tokens corrected
        self.ratio_max = -torch.inf  # largest pi_old / pi_sampler over the loss mask's tokens

    def weigh(
        self, old_logprobs: Tensor, sampled_logprobs: Tensor | None, mask: Tensor, *, tally: bool
    ) -> tuple[Tensor | float, Tensor | float]:
        """(n, T') weights of the policy-gradient term and of the whole per-token loss, both
        detached (1.0 without sampler log-probs). token_tis weighs the policy-gradient term
        only, never the KL penalty (the penalty's samples are the trainer's business, not the
        engine's); sequence_mask takes a sequence out of the whole loss. With `tally`, adds
        these tokens to the metrics (once per token: on the first epoch)."""
        if sampled_logprobs is None:
            return 1.0, 1.0
        old_logprobs = old_logprobs.detach()
        weights, changed = engine_correction(old_logprobs, sampled_logprobs, mask, self.mode, cap=self.cap)
        if tally:  # in float64: k3 = r - 1 - log r cancels, and in float32 it is noise below ~1e-7
            valid = mask.bool()
            old64, sampled64 = old_logprobs.double(), sampled_logprobs.double()
            kl = mismatch_kl(old64, sampled64, mask)
            self.sums += torch.stack([kl.sum(), valid.sum(), changed.sum()]).double().cpu()
            if bool(valid.any()):
                ratio = mismatch_log_ratio(old64, sampled64, mask)[valid].max().exp()
                self.ratio_max = max(self.ratio_max, float(ratio))
        return weights, (weights if self.mode == "sequence_mask" else 1.0)

    def metrics(self, world: World) -> dict:
        """rollout/mismatch_kl (the token mean of k3 KL(pi_sampler || pi_old)),
        rollout/mismatch_ratio_max (the largest pi_old / pi_sampler) and
        rollout/frac_corrected (the fraction of the tokens whose weight the correction set),
        over every process's loss-mask tokens; None where no token was measured. Every process
        calls it (two collectives)."""
        kl, tokens, corrected = world.sum(self.sums).tolist()
        ratio_max = float(world.max(torch.tensor(self.ratio_max, dtype=torch.float64)))
        if not tokens:
            return dict.fromkeys(METRICS)
        return dict(zip(METRICS, (kl / tokens, ratio_max, corrected / tokens)))
