"""Evaluation: pass@k and maj@k (pure functions); the evaluation runner lands with `grpo eval`."""

from grpo.eval.metrics import maj_at_k, pass_at_k

__all__ = ["maj_at_k", "pass_at_k"]
