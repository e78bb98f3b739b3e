"""How a decoder samples: one `SamplingParams`, built once from the rollout config.

Every decoder (`grpo.rollout.decoders`) is handed the same object; the rollout config's
fields of the same names document each option (`grpo.config.RolloutConfig`). An option is
added here and there, and mapped to `generate` in `decoders.generation_config`: nowhere else
(except the fast loop's own, `FAST_ONLY`).
Plain data, no torch: the decoder registry and the run's preflight read it without loading torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The fields the tokenizer gives, not the rollout config.
_TOKENS = ("eos_token_ids", "pad_token_id", "bos_token_id")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    # auto: the fast loop draws fast, other decoders their own way; generate: generate's tokens
    # bit for bit; fast: the same distribution, drawn faster (the last two: the fast loop only)
    draw: str = "auto"
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    bos_token_id: int | None = None

    @property
    def reshapes(self) -> bool:
        """Whether the distribution drawn from is other than the one the loss scores (the
        logits at the temperature, after the repetition penalty): top-p, top-k or min-p cut
        it, or min_new_tokens forbids EOS for the first tokens."""
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0 or self.min_new_tokens > 0

    @property
    def fast_draw(self) -> bool:
        """Whether the fast loop draws the fast way (rollout.draw auto or fast) rather than
        generate's, bit for bit."""
        return self.draw != "generate"

    @classmethod
    def of(cls, tokenizer, **options) -> SamplingParams:
        """`options` (fields of OPTIONS) with the tokenizer's EOS, padding (0 when it has none)
        and BOS tokens."""
        eos = tokenizer.eos_token_id
        return cls(
            **options,
            eos_token_ids=() if eos is None else (eos,),
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            bos_token_id=tokenizer.bos_token_id,
        )

    @classmethod
    def from_config(cls, rollout, tokenizer) -> SamplingParams:
        """The options of `rollout` (a `grpo.config.RolloutConfig`), with `tokenizer`'s tokens."""
        return cls.of(tokenizer, **{name: getattr(rollout, name) for name in OPTIONS})


# The sampling options: the fields a rollout config sets (under the same names).
OPTIONS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name not in _TOKENS)
# Those only the fast loop reads (`generate` has no such option; the others refuse a value but the default).
FAST_ONLY = ("draw",)
