"""The typed run configuration: a YAML file plus dotted `--set` overrides, checked up front.

- `grpo.config.fields`: `opt(default, doc)`, how every config of the project declares a field
  with its documentation (`--help` prints it), and the walks over such dataclasses; a leaf
  (it imports nothing of grpo), which a module that only declares fields imports alone;
- `grpo.config.schema`: the run's dataclasses (`Config` and its sections), their defaults and
  the algorithm presets;
- `grpo.config.reading`: YAML or a mapping plus overrides -> `Config`, and back to plain data;
- `grpo.config.checks`: `validate`, every impossible value and refused combination as one
  line that names its key, before any model is loaded (those that need an engine's facts:
  `grpo.train.preflight`).

The package imports nothing of grpo but `grpo.errors`, `grpo.refusals` and `grpo.infra`
(tests/test_architecture.py): every floor above reads the schema.

The names below are the package's: import them from `grpo.config`.
"""

from grpo.config.checks import REPORTERS, hub_repo, lookahead, reporters, validate
from grpo.config.fields import REQUIRED, as_tree, field_default, key_of, opt
from grpo.config.reading import (
    TRL_NAMES,
    config_from_dict,
    config_to_dict,
    describe_fields,
    load_config,
    parse_override,
    read_config_file,
    truncates,
)
from grpo.config.schema import (
    PRESETS,
    AsyncConfig,
    Config,
    DataConfig,
    InLoopEvalConfig,
    LoraConfig,
    LossConfig,
    RewardConfig,
    RewardModelUpdateConfig,
    RolloutConfig,
    TrainConfig,
    ValueConfig,
    VllmConfig,
)

__all__ = [
    "AsyncConfig",
    "Config",
    "DataConfig",
    "InLoopEvalConfig",
    "LoraConfig",
    "LossConfig",
    "PRESETS",
    "REPORTERS",
    "REQUIRED",
    "RewardConfig",
    "RewardModelUpdateConfig",
    "RolloutConfig",
    "TRL_NAMES",
    "TrainConfig",
    "ValueConfig",
    "VllmConfig",
    "as_tree",
    "config_from_dict",
    "config_to_dict",
    "describe_fields",
    "field_default",
    "hub_repo",
    "key_of",
    "load_config",
    "lookahead",
    "opt",
    "parse_override",
    "read_config_file",
    "reporters",
    "truncates",
    "validate",
]
