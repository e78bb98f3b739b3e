"""grpo: reinforcement-learning fine-tuning of language models with GRPO and PPO.

GRPO (DeepSeekMath, arXiv 2402.03300) is PPO with three changes: the value model goes, the
baseline becomes the mean (and std) of a group of G sampled outputs for the same prompt, and
the KL penalty moves from the per-token reward into the loss. The math lives in `grpo.algo`
and `grpo.eval` as pure, tested functions; everything else imports it.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `grpo.train(config)` is the Python API of `grpo train`. It is imported on first use,
    # so that `grpo --version` and the pure math do not pay for loading transformers.
    if name == "train":
        import importlib

        return importlib.import_module("grpo.train")
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
