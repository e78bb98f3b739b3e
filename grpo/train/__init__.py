"""Training: the step shared by GRPO and PPO, the outer loop, model loading.

`grpo.train` is also callable: `grpo.train(config)` is `grpo.train.train(config)`, the
Python API of `grpo train`. (A module can't be called, and the package's attribute `train`
is this subpackage as soon as it is imported, so the module itself is made callable.)
"""

import sys
import types

from grpo.train.loop import TrainResult, train

__all__ = ["TrainResult", "train"]


class _CallableModule(types.ModuleType):
    def __call__(self, config, **kwargs) -> TrainResult:
        return train(config, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
