"""Training: the step shared by GRPO and PPO, the outer loop, model loading, SFT warm-up.

`grpo.train` is also callable: `grpo.train(config)` is `grpo.train.train(config)`, the
Python API of `grpo train`. (A module can't be called, and the package's attribute `train`
is this subpackage as soon as it is imported, so the module itself is made callable.)
The loop, and with it torch and transformers, is imported on first use.
"""

import sys
import types

__all__ = ["TrainResult", "train"]


def __getattr__(name: str):
    if name in __all__:
        from grpo.train import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'grpo.train' has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    def __call__(self, config, **kwargs):
        from grpo.train.loop import train

        return train(config, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
