"""Evaluation: pass@k and maj@k (pure functions), the runner behind `grpo eval`, and plots.

`pass_at_k` and `maj_at_k` need only numpy; the runner (torch, transformers) and the plots
(matplotlib) are imported on first use of their names.
"""

from grpo.eval.metrics import maj_at_k, pass_at_k

__all__ = [
    "Verifier",
    "evaluate",
    "maj_at_k",
    "measure",
    "pass_at_k",
    "plot_curves",
    "plot_rewards",
    "reward_verifier",
    "task_verifier",
]

_LAZY = {
    "Verifier": "grpo.eval.runner",
    "evaluate": "grpo.eval.runner",
    "measure": "grpo.eval.runner",
    "reward_verifier": "grpo.eval.runner",
    "task_verifier": "grpo.eval.runner",
    "plot_curves": "grpo.eval.plots",
    "plot_rewards": "grpo.eval.plots",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'grpo.eval' has no attribute {name!r}")
