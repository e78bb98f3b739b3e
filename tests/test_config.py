"""grpo.config: defaults, algorithm presets, --set overrides, type and value errors, round trips,
field documentation, and the shipped grpo/ppo configs differing in exactly the three places."""

import copy
import math
import re
from pathlib import Path

import pytest
import yaml

from grpo.config import (
    PRESETS,
    Config,
    config_from_dict,
    config_to_dict,
    describe_fields,
    load_config,
)
from grpo.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
GRPO_YAML = ROOT / "configs" / "grpo.yaml"
PPO_YAML = ROOT / "configs" / "ppo.yaml"


def minimal(**extra) -> dict:
    """The smallest valid mapping: a model, a prompt file and one reward."""
    data = {"model": "tiny-model", "data": {"path": "prompts.jsonl"}, "rewards": [{"function": "exact_answer"}]}
    data.update(extra)
    return data


def user_error(data, overrides=()) -> str:
    """The UserError message config_from_dict raises, checked to be a single line."""
    with pytest.raises(UserError) as info:
        config_from_dict(data, list(overrides))
    return one_line(info)


def one_line(info) -> str:
    message = str(info.value)
    assert message, "empty UserError message"
    assert "\n" not in message and "\r" not in message, f"multi-line UserError: {message!r}"
    return message


def leaves(tree, prefix="") -> dict:
    """Flatten a nested dict/list into {dotted key: value} (list items by index); an empty
    mapping (data.task_options' default) is a leaf."""
    if isinstance(tree, dict) and tree:
        items = tree.items()
    elif isinstance(tree, list) and tree and all(isinstance(v, dict) for v in tree):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out = {}
    for key, value in items:
        out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


# ---- defaults and presets -------------------------------------------------------------------


def test_minimal_mapping_gets_the_documented_defaults():
    c = config_from_dict(minimal())
    assert isinstance(c, Config)
    assert (c.algorithm, c.model, c.seed, c.output_dir) == ("grpo", "tiny-model", 0, "runs/train")
    assert (c.data.path, c.data.prompt_column, c.data.split, c.data.shuffle) == (
        "prompts.jsonl",
        "prompt",
        "train",
        True,
    )
    assert len(c.rewards) == 1
    assert (c.rewards[0].function, c.rewards[0].model, c.rewards[0].weight) == ("exact_answer", None, 1.0)
    r = c.rollout
    assert (r.group_size, r.prompts_per_step, r.max_new_tokens, r.min_new_tokens) == (8, 4, 64, 0)
    assert (r.temperature, r.top_p, r.top_k) == (1.0, 1.0, 0)
    t = c.train
    assert (t.steps, t.iterations, t.lr, t.epochs, t.minibatches, t.micro_batch_size) == (100, 1, 1e-6, 1, 1, 0)
    assert (t.weight_decay, t.adam_betas, t.warmup_steps, t.schedule, t.max_grad_norm) == (
        0.0,
        [0.9, 0.999],
        0,
        "constant",
        1.0,
    )
    assert (t.checkpoint_every, t.keep_checkpoints, t.sample_every, t.tensorboard, t.dtype) == (
        0,
        2,
        10,
        False,
        "float32",
    )
    lo = c.loss
    assert (lo.beta, lo.scale, lo.eps, lo.aggregation) == (0.04, "group", 1e-4, "seq-mean-token-mean")
    assert (lo.clip_low, lo.clip_high, lo.ratio_level, lo.dual_clip, lo.drop_zero_std_groups) == (
        0.2,
        0.2,
        "token",
        None,
        False,
    )
    assert (lo.gamma, lo.lam, lo.whiten_advantages, lo.value_clip) == (1.0, 0.95, True, 0.2)
    assert (c.value.model, c.value.lr) == (None, None)
    assert (c.lora.r, c.lora.alpha, c.lora.target_modules) == (0, 16.0, "all-linear")


def test_defaults_are_not_shared_between_configs():
    a = config_from_dict(minimal())
    a.train.adam_betas.append(0.5)
    a.rewards.append("x")
    b = config_from_dict(minimal())
    assert b.train.adam_betas == [0.9, 0.999]
    assert len(b.rewards) == 1


@pytest.mark.parametrize(
    "algorithm, expected",
    [
        ("grpo", ("group", "loss", "k3")),
        ("ppo", ("critic", "reward", "k1")),
    ],
)
def test_algorithm_preset_fills_the_three_loss_keys(algorithm, expected):
    c = config_from_dict(minimal(algorithm=algorithm))
    assert (c.loss.baseline, c.loss.kl_in, c.loss.kl_estimator) == expected
    assert PRESETS[algorithm] == dict(zip(("baseline", "kl_in", "kl_estimator"), expected))


def test_no_algorithm_means_grpo():
    c = config_from_dict(minimal())
    assert (c.loss.baseline, c.loss.kl_in, c.loss.kl_estimator) == ("group", "loss", "k3")


def test_explicit_loss_keys_beat_the_preset():
    c = config_from_dict(minimal(algorithm="grpo", loss={"kl_estimator": "k2"}))
    assert (c.loss.baseline, c.loss.kl_in, c.loss.kl_estimator) == ("group", "loss", "k2")
    c = config_from_dict(minimal(algorithm="ppo", loss={"kl_in": "loss", "kl_estimator": "k3"}))
    assert (c.loss.baseline, c.loss.kl_in, c.loss.kl_estimator) == ("critic", "loss", "k3")
    c = config_from_dict(minimal(algorithm="ppo"), ["loss.baseline=group", "loss.kl_in=loss"])
    assert (c.loss.baseline, c.loss.kl_in, c.loss.kl_estimator) == ("group", "loss", "k1")
    # An explicit null is "unset": the preset fills it.
    c = config_from_dict(minimal(algorithm="ppo", loss={"baseline": None}))
    assert c.loss.baseline == "critic"


# ---- --set overrides ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, get, expected",
    [
        ("rollout.group_size=4", lambda c: c.rollout.group_size, 4),
        ("train.lr=1e-3", lambda c: c.train.lr, 1e-3),  # YAML reads 1e-3 as a string
        ("train.lr=3.0e-4", lambda c: c.train.lr, 3e-4),
        ("train.lr=0.5", lambda c: c.train.lr, 0.5),
        ("train.lr=2", lambda c: c.train.lr, 2.0),
        ("data.shuffle=false", lambda c: c.data.shuffle, False),
        ("train.tensorboard=true", lambda c: c.train.tensorboard, True),
        ("loss.value_clip=null", lambda c: c.loss.value_clip, None),
        ("loss.dual_clip=3", lambda c: c.loss.dual_clip, 3.0),
        ("train.adam_betas=[0.9, 0.95]", lambda c: c.train.adam_betas, [0.9, 0.95]),
        ("lora.target_modules=[q_proj, v_proj]", lambda c: c.lora.target_modules, ["q_proj", "v_proj"]),
        ("rewards.0.weight=2", lambda c: c.rewards[0].weight, 2.0),
        ("rewards.0.function=pkg.mod:fn", lambda c: c.rewards[0].function, "pkg.mod:fn"),
        (
            "rewards=[{function: a}, {function: b, weight: 0.5}]",
            lambda c: [(r.function, r.weight) for r in c.rewards],
            [("a", 1.0), ("b", 0.5)],
        ),
        ("data.path=a=b.jsonl", lambda c: c.data.path, "a=b.jsonl"),  # only the first '=' splits
        (" seed = 7", lambda c: c.seed, 7),
        ("algorithm=ppo", lambda c: c.loss.baseline, "critic"),
    ],
)
def test_set_override(override, get, expected):
    c = config_from_dict(minimal(), [override])
    value = get(c)
    assert value == expected
    assert type(value) is type(expected)


def test_overrides_apply_in_order_and_beat_the_mapping():
    c = config_from_dict(minimal(rollout={"group_size": 16}), ["rollout.group_size=4", "rollout.group_size=2"])
    assert c.rollout.group_size == 2
    assert c.rollout.prompts_per_step == 4  # the rest of the section is kept


def test_override_indexes_a_list_given_in_the_mapping():
    c = config_from_dict(minimal(train={"adam_betas": [0.9, 0.999]}), ["train.adam_betas.1=0.95"])
    assert c.train.adam_betas == [0.9, 0.95]
    data = minimal(rewards=[{"function": "a"}, {"function": "b"}])
    c = config_from_dict(data, ["rewards.1.weight=0.25", "rewards.0.function=c"])
    assert [(r.function, r.weight) for r in c.rewards] == [("c", 1.0), ("b", 0.25)]


def test_override_creates_a_missing_section():
    data = {"rewards": [{"function": "exact_answer"}]}
    c = config_from_dict(data, ["model=m", "data.path=p.jsonl", "value.lr=1e-5"])
    assert (c.model, c.data.path, c.data.prompt_column, c.value.lr) == ("m", "p.jsonl", "prompt", 1e-5)


def test_override_fills_an_empty_yaml_section():
    # `loss:` with nothing under it reads as None; --set must still be able to fill it.
    c = config_from_dict(minimal(loss=None), ["loss.beta=0.1"])
    assert c.loss.beta == 0.1


def test_load_config_applies_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(minimal(rollout={"group_size": 8})))
    c = load_config(str(path), ["rollout.group_size=4", "train.lr=1e-3", "rewards.0.weight=2", "lora.r=8"])
    assert (c.rollout.group_size, c.train.lr, c.rewards[0].weight, c.lora.r) == (4, 1e-3, 2.0, 8)
    assert load_config(path).rollout.group_size == 8  # the file itself is untouched


@pytest.mark.parametrize(
    "override, needle",
    [
        ("foo", "'foo'"),
        ("=3", "'=3'"),
        ("  =3", "=3"),
        ("rewards.5.weight=2", "rewards"),
        ("rewards.x.weight=2", "rewards"),
        ("rewards.-1.weight=2", "rewards"),
        ("train.adam_betas.2=0.5", "adam_betas"),
        ("model.name=x", None),  # model is a string: no sub-keys
        ("data.path=[1,", "data.path"),  # the value is not valid YAML
    ],
)
def test_malformed_override_is_a_one_line_user_error(override, needle):
    message = user_error(minimal(), [override])
    if needle is not None:
        assert needle in message


def test_set_without_equals_says_what_it_expects():
    message = user_error(minimal(), ["foo"])
    assert message == "--set expects key.sub=value, got 'foo'"


def test_bad_list_index_names_the_list():
    assert user_error(minimal(), ["rewards.5.weight=2"]) == "--set rewards.5.weight: 'rewards' has no item 5"


def test_overrides_do_not_mutate_the_callers_mapping():
    data = minimal(rollout={"group_size": 8})
    before = copy.deepcopy(data)
    config_from_dict(data, ["rollout.group_size=4", "rewards.0.weight=2", "data.path=other.jsonl"])
    assert data == before


# ---- type errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.lr=fast", "train.lr: expected float, got 'fast'"),
        ("rollout.group_size=true", "rollout.group_size: expected int, got True"),
        ("rollout.group_size=4.0", "rollout.group_size: expected int, got 4.0"),
        ("rollout.group_size='4'", "rollout.group_size: expected int, got '4'"),
        ("train.lr=true", "train.lr: expected float, got True"),
        ("data.shuffle=1", "data.shuffle: expected bool, got 1"),
        ("model=3", "model: expected str, got 3"),
        ("train.adam_betas=0.9", "train.adam_betas: expected list of float, got 0.9"),
        ("train.adam_betas=[0.9, x]", "train.adam_betas.1: expected float, got 'x'"),
        ("rollout.group_size={a: 1}", "rollout.group_size: expected int, got {'a': 1}"),
        ("train.lr=[1, 2]", "train.lr: expected float, got [1, 2]"),
        ("rollout=3", "rollout: expected a mapping, got 3"),
        ("loss.dual_clip=fast", "loss.dual_clip: expected float | null, got 'fast'"),
        ("loss.value_clip=true", "loss.value_clip: expected float | null, got True"),
    ],
)
def test_type_error_names_the_key(override, expected):
    assert user_error(minimal(), [override]) == expected


@pytest.mark.parametrize(
    "data, key",
    [
        (minimal(rewards="exact_answer"), "rewards"),  # a string where a list is expected
        (minimal(rewards=["exact_answer"]), "rewards.0"),  # a string where a mapping is expected
        (minimal(rewards=[{"function": "f", "weight": "heavy"}]), "rewards.0.weight"),
        (minimal(data="prompts.jsonl"), "data"),
        (minimal(seed={"value": 1}), "seed"),
        (minimal(lora={"target_modules": 3}), "lora.target_modules"),
    ],
)
def test_type_error_in_mapping_names_the_key(data, key):
    message = user_error(data)
    assert message.startswith(f"{key}: expected ")


def test_int_is_accepted_where_float_is_expected():
    c = config_from_dict(minimal(train={"lr": 1, "adam_betas": [0, 0]}, rewards=[{"function": "f", "weight": 2}]))
    assert c.train.lr == 1.0 and type(c.train.lr) is float
    assert c.train.adam_betas == [0.0, 0.0] and all(type(b) is float for b in c.train.adam_betas)
    assert type(c.rewards[0].weight) is float


def test_yaml_exponent_without_dot_is_read_as_float():
    data = yaml.safe_load("train:\n  lr: 1e-6\nloss:\n  eps: 1E-8\n  dual_clip: 3e0\n")
    assert data["train"]["lr"] == "1e-6"  # PyYAML (YAML 1.1) leaves it a string
    c = config_from_dict({**minimal(), **data})
    assert c.train.lr == 1e-6 and type(c.train.lr) is float
    assert c.loss.eps == 1e-8 and c.loss.dual_clip == 3.0


# ---- unknown keys and literal values --------------------------------------------------------


@pytest.mark.parametrize(
    "data, expected",
    [
        (minimal(algoritm="ppo"), "unknown config key 'algoritm' (did you mean 'algorithm'?)"),
        (
            minimal(rollout={"gropu_size": 4}),
            "unknown config key 'rollout.gropu_size' (did you mean 'rollout.group_size'?)",
        ),
        (
            minimal(data={"path": "p", "promt_column": "q"}),
            "unknown config key 'data.promt_column' (did you mean 'data.prompt_column'?)",
        ),
        (
            minimal(train={"learning_rate": 1e-3}),
            "unknown config key 'train.learning_rate': that is TRL's GRPOConfig name; "
            "it is 'train.lr' here (the policy's learning rate)",
        ),
        (
            minimal(loss={"kl_estimater": "k3"}),
            "unknown config key 'loss.kl_estimater' (did you mean 'loss.kl_estimator'?)",
        ),
        (minimal(value={"modle": "v"}), "unknown config key 'value.modle' (did you mean 'value.model'?)"),
        (minimal(lora={"rank": 8}), "unknown config key 'lora.rank'"),
        (
            minimal(rewards=[{"functon": "exact_answer"}]),
            "unknown config key 'rewards.0.functon' (did you mean 'rewards.0.function'?)",
        ),
        (
            minimal(rewards=[{"function": "a"}, {"function": "b", "wieght": 2}]),
            "unknown config key 'rewards.1.wieght' (did you mean 'rewards.1.weight'?)",
        ),
    ],
)
def test_unknown_key_with_hint(data, expected):
    assert user_error(data) == expected


def test_unknown_key_via_override():
    message = user_error(minimal(), ["rollout.gropu_size=4"])
    assert message == "unknown config key 'rollout.gropu_size' (did you mean 'rollout.group_size'?)"


def test_unknown_key_far_from_any_name_has_no_hint():
    assert user_error(minimal(zzzzzz=1)) == "unknown config key 'zzzzzz'"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("algorithm=gpro", "algorithm: expected one of 'grpo' | 'ppo', got 'gpro' (did you mean 'grpo'?)"),
        (
            "train.schedule=cosin",
            "train.schedule: expected one of 'constant' | 'linear' | 'cosine', got 'cosin' (did you mean 'cosine'?)",
        ),
        (
            "loss.aggregation=token_mean",
            "loss.aggregation: expected one of 'seq-mean-token-mean' | 'token-mean' | 'seq-mean-token-sum-norm', got 'token_mean' (did you mean 'token-mean'?)",
        ),
        ("train.dtype=fp16", "train.dtype: expected one of 'float32' | 'bfloat16', got 'fp16'"),
    ],
)
def test_literal_value_with_hint(override, expected):
    assert user_error(minimal(), [override]) == expected


@pytest.mark.parametrize(
    "override, key",
    [
        ("loss.baseline=critc", "loss.baseline"),
        ("loss.kl_in=reward", None),
        ("loss.kl_estimator=k4", "loss.kl_estimator"),
    ],
)
def test_optional_literal_rejects_other_values(override, key):
    if key is None:  # valid value, but group baseline + reward KL is impossible
        assert user_error(minimal(), [override]).startswith("loss.kl_in:")
    else:
        assert user_error(minimal(), [override]).startswith(f"{key}: expected ")


def test_optional_literal_keeps_the_hint():
    assert "did you mean 'critic'" in user_error(minimal(), ["loss.baseline=critc"])


# ---- impossible values ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["rollout.group_size=1"], "rollout.group_size"),  # group baseline needs G >= 2
        (["algorithm=ppo", "rollout.group_size=0"], "rollout.group_size"),
        (["rollout.prompts_per_step=0"], "rollout.prompts_per_step"),
        (["rollout.max_new_tokens=0"], "rollout.max_new_tokens"),
        (["rollout.min_new_tokens=65"], "rollout.min_new_tokens"),  # > max_new_tokens (64)
        (["rollout.min_new_tokens=-1"], "rollout.min_new_tokens"),
        (["rollout.temperature=0"], "rollout.temperature"),
        (["rollout.temperature=-1"], "rollout.temperature"),
        (["rollout.top_p=0"], "rollout.top_p"),
        (["rollout.top_p=1.5"], "rollout.top_p"),
        (["rollout.top_k=-1"], "rollout.top_k"),
        (["rollout.min_p=1"], "rollout.min_p"),
        (["rollout.min_p=-0.1"], "rollout.min_p"),
        (["rollout.repetition_penalty=0"], "rollout.repetition_penalty"),
        (["rollout.repetition_penalty=-1.2"], "rollout.repetition_penalty"),
        (["train.steps=0"], "train.steps"),
        (["train.iterations=101"], "train.iterations"),  # > steps (100)
        (["train.iterations=0"], "train.iterations"),
        (["train.lr=0"], "train.lr"),
        (["train.lr=-1e-3"], "train.lr"),
        (["train.lr=.nan"], "train.lr"),
        (["train.epochs=0"], "train.epochs"),
        (["train.minibatches=33"], "train.minibatches"),  # > 4 prompts * 8 completions
        (["train.minibatches=0"], "train.minibatches"),
        (["train.micro_batch_size=-1"], "train.micro_batch_size"),
        (["train.adam_betas=[0.9]"], "train.adam_betas"),
        (["train.adam_betas=[0.9, 1.0]"], "train.adam_betas"),
        (["train.max_grad_norm=-1"], "train.max_grad_norm"),
        (["train.warmup_steps=-1"], "train.warmup_steps"),
        (["train.checkpoint_every=-1"], "train.checkpoint_every"),
        (["train.sample_every=-1"], "train.sample_every"),
        (["train.keep_checkpoints=0"], "train.keep_checkpoints"),
        (["loss.clip_low=1.0"], "loss.clip_low"),
        (["loss.clip_low=0"], "loss.clip_low"),
        (["loss.clip_high=0"], "loss.clip_high"),
        (["loss.dual_clip=1.0"], "loss.dual_clip"),
        (["loss.beta=-0.01"], "loss.beta"),
        (["loss.eps=-1"], "loss.eps"),
        (["loss.gamma=1.5"], "loss.gamma"),
        (["loss.lam=-0.1"], "loss.lam"),
        (["loss.value_clip=0"], "loss.value_clip"),
        (["loss.kl_in=reward"], "loss.kl_in"),  # group baseline with the KL in the reward
        (["algorithm=ppo", "loss.baseline=group", "rollout.group_size=1"], "rollout.group_size"),
        (["value.lr=0"], "value.lr"),
        (["lora.r=-1"], "lora.r"),
        (["rewards=[{function: f, model: m}]"], "rewards.0"),  # both
        (["rewards=[{weight: 1}]"], "rewards.0"),  # neither
        (["rewards=[{function: f}, {weight: 2}]"], "rewards.1"),
        (["rewards=[{function: r1_format, process: true}]"], "rewards.0.process"),
        (["loss.supervision=process", "algorithm=ppo", "rollout.group_size=1"], "loss.supervision"),
        (["reward_model_update.verifier=r1_format"], "reward_model_update.verifier"),
        (["reward_model_update.replay=1.0"], "reward_model_update.replay"),
        (["rewards.0.weight=.nan"], "rewards.0.weight"),
        (["rewards.0.weight=.inf"], "rewards.0.weight"),
        (["rewards=[]"], "rewards"),
        (["model="], "model"),
        (["model=null"], "model"),
        (["data.path="], "data.path"),
    ],
)
def test_impossible_value_names_the_key(overrides, key):
    message = user_error(minimal(), overrides)
    assert message.startswith(f"{key}:"), message


@pytest.mark.parametrize(
    "data, key",
    [
        ({k: v for k, v in minimal().items() if k != "model"}, "model"),
        (minimal(data={}), "data.path"),
        ({k: v for k, v in minimal().items() if k != "rewards"}, "rewards"),
    ],
)
def test_missing_required_key(data, key):
    assert user_error(data).startswith(f"{key}:")


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm=ppo", "rollout.group_size=1"],  # the critic is the baseline: G = 1 is fine
        ["algorithm=ppo", "rollout.group_size=1", "train.minibatches=4"],  # batch = 4 completions
        ["rollout.group_size=2"],
        ["rollout.min_new_tokens=64"],
        ["rollout.top_p=1"],
        ["train.iterations=100"],
        ["train.minibatches=32"],
        ["loss.beta=0"],
        ["loss.dual_clip=3"],
        ["loss.value_clip=null"],
        ["algorithm=ppo", "loss.kl_in=loss"],  # critic + KL in the loss is allowed
    ],
)
def test_edge_values_are_valid(overrides):
    config_from_dict(minimal(), overrides)


@pytest.mark.parametrize("override", ["train.lr=.inf", "rollout.temperature=.inf"])
def test_infinite_rate_or_temperature_is_rejected(override):
    assert user_error(minimal(), [override]).startswith(override.split("=")[0] + ":")


# ---- load_config ----------------------------------------------------------------------------


def test_missing_file_is_a_one_line_error_naming_it(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(UserError) as info:
        load_config(path)
    message = one_line(info)
    assert str(path) in message and "not found" in message


def test_directory_is_not_a_config_file(tmp_path):
    with pytest.raises(UserError) as info:
        load_config(tmp_path)
    assert str(tmp_path) in one_line(info)


@pytest.mark.parametrize(
    "text",
    [
        "model: [unclosed\nseed: 0\n",
        "model: m\n  data: x\n bad: indent\n",
        "a: b: c\n",
        "key: 'unterminated\n",
    ],
)
def test_invalid_yaml_is_a_one_line_error_naming_the_file(tmp_path, text):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        load_config(path)
    message = one_line(info)
    assert message.startswith(f"{path}:")
    assert "invalid YAML" in message


@pytest.mark.parametrize(
    "text, kind", [("- model: m\n- seed: 0\n", "list"), ("just a string\n", "str"), ("42\n", "int")]
)
def test_yaml_top_level_must_be_a_mapping(tmp_path, text, kind):
    path = tmp_path / "list.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        load_config(path)
    message = one_line(info)
    assert "mapping" in message and kind in message


def test_config_from_dict_rejects_a_non_mapping():
    assert "mapping" in user_error([("model", "m")])


def test_empty_file_reports_the_first_missing_key(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    with pytest.raises(UserError) as info:
        load_config(path)
    assert one_line(info).startswith("model:")


# ---- writing and documenting ----------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        lambda: config_from_dict(minimal()),
        lambda: config_from_dict(
            minimal(algorithm="ppo"),
            ["rollout.group_size=1", "loss.dual_clip=3", "value.lr=1e-5", "lora.target_modules=[q, v]"],
        ),
        lambda: load_config(GRPO_YAML),
        lambda: load_config(PPO_YAML),
    ],
)
def test_config_to_dict_round_trips(source):
    c = source()
    d = config_to_dict(c)
    assert isinstance(d, dict) and isinstance(d["rollout"], dict) and isinstance(d["rewards"], list)
    assert config_from_dict(d) == c
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(d))) == c
    assert config_to_dict(config_from_dict(d)) == d


def test_config_to_dict_is_resolved_and_independent():
    c = config_from_dict(minimal(algorithm="ppo"))
    d = config_to_dict(c)
    assert (d["loss"]["baseline"], d["loss"]["kl_in"], d["loss"]["kl_estimator"]) == ("critic", "reward", "k1")
    d["train"]["adam_betas"].append(0.1)
    assert c.train.adam_betas == [0.9, 0.999]


def test_describe_fields_lists_every_leaf_key_with_a_doc():
    rows = describe_fields()
    keys = [key for key, _default, _doc in rows]
    assert len(keys) == len(set(keys))
    for key in (
        "rollout.group_size",
        "loss.kl_in",
        "rewards[].function",
        "rewards[].model",
        "rewards[].weight",
        "algorithm",
        "model",
        "data.path",
        "train.lr",
        "loss.beta",
        "value.lr",
        "lora.target_modules",
    ):
        assert key in keys
    # Every leaf of a resolved config appears, and nothing else (rewards items as rewards[]).
    expected = set()
    for key in leaves(config_to_dict(config_from_dict(minimal()))):
        expected.add(re.sub(r"^rewards\.\d+\.", "rewards[].", key))
    expected.add("rewards")
    assert set(keys) == expected
    for key, default, doc in rows:
        assert isinstance(doc, str) and doc.strip(), f"{key} has no doc"
        assert isinstance(default, str)


def test_every_field_doc_is_one_or_two_sentences_with_no_measured_number():
    """--help is the short text; the manual is docs/ (each doc names the page where more is
    needed, tests/test_docs.py checks the pointer) and measurements are benchmarks/README.md's."""
    for key, _default, doc in describe_fields():
        sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z0-9'])", doc.strip())
        assert len(sentences) <= 2 and len(doc) <= 250, f"{key}: {len(sentences)} sentences, {len(doc)} characters"
        measured = re.search(r"\d(\.\d+)?x\b|\d ?ms\b|[Mm]easured|benchmarks/", doc)
        assert measured is None, f"{key}: {measured.group(0)!r} is a measurement; it belongs in benchmarks/README.md"


def test_describe_fields_shows_the_defaults():
    shown = {key: default for key, default, _doc in describe_fields()}
    assert yaml.safe_load(shown["rollout.group_size"]) == 8
    assert yaml.safe_load(shown["loss.beta"]) == 0.04
    assert yaml.safe_load(shown["train.adam_betas"]) == [0.9, 0.999]
    assert yaml.safe_load(shown["loss.baseline"]) is None
    assert yaml.safe_load(shown["algorithm"]) == "grpo"
    assert shown["rewards"] == "[]"


# ---- the shipped configs --------------------------------------------------------------------

THE_DIFFERENCE = {"algorithm", "output_dir", "rollout.group_size", "loss.baseline", "loss.kl_in", "loss.kl_estimator"}


def test_shipped_configs_load_and_validate():
    grpo, ppo = load_config(GRPO_YAML), load_config(PPO_YAML)
    assert (grpo.algorithm, grpo.loss.baseline, grpo.loss.kl_in, grpo.loss.kl_estimator) == (
        "grpo",
        "group",
        "loss",
        "k3",
    )
    assert (ppo.algorithm, ppo.loss.baseline, ppo.loss.kl_in, ppo.loss.kl_estimator) == (
        "ppo",
        "critic",
        "reward",
        "k1",
    )
    assert grpo.rollout.group_size >= 2
    assert ppo.rollout.group_size == 1
    # The shipped loss keys agree with the presets they spell out.
    for c in (grpo, ppo):
        assert {k: getattr(c.loss, k) for k in PRESETS[c.algorithm]} == PRESETS[c.algorithm]


def test_shipped_configs_differ_in_exactly_the_three_places():
    grpo = leaves(config_to_dict(load_config(GRPO_YAML)))
    ppo = leaves(config_to_dict(load_config(PPO_YAML)))
    assert grpo.keys() == ppo.keys()
    differing = {key for key in grpo if grpo[key] != ppo[key]}
    assert differing == THE_DIFFERENCE


def _keyed_lines(path: Path) -> list[tuple[str, str]]:
    """(dotted key or '', line without its trailing comment) for each non-comment, non-blank line."""
    out, section = [], ""
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        body = line.split(" #")[0].rstrip()
        match = re.match(r"^(\s*)([A-Za-z_][\w]*)\s*:(.*)$", body)
        key = ""
        if match:
            indent, name, rest = match.groups()
            if not indent:
                section = name if not rest.strip() else ""
                key = name
            else:
                key = f"{section}.{name}" if section else name
        out.append((key, body))
    return out


def test_shipped_config_files_differ_only_on_those_lines():
    grpo, ppo = _keyed_lines(GRPO_YAML), _keyed_lines(PPO_YAML)
    assert len(grpo) == len(ppo)
    assert [k for k, _ in grpo] == [k for k, _ in ppo]  # same keys in the same order
    differing = {key for (key, a), (_, b) in zip(grpo, ppo) if a != b}
    assert differing == THE_DIFFERENCE


def test_shipped_configs_set_the_three_loss_keys_explicitly():
    for path in (GRPO_YAML, PPO_YAML):
        loss = yaml.safe_load(path.read_text())["loss"]
        assert {"baseline", "kl_in", "kl_estimator"} <= set(loss)
        assert math.isfinite(loss["beta"])


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "loss.epsilon=0.3",
            "unknown config key 'loss.epsilon': that is TRL's GRPOConfig name; it is 'loss.clip_low' here",
        ),
        (
            "train.num_iterations=2",
            "it is 'train.epochs' here (mu, update epochs per batch; our train.iterations resets the reference instead)",
        ),
        ("train.save_steps=5", "it is 'train.checkpoint_every' here"),
        (
            "num_generations=4",
            "unknown config key 'num_generations': that is TRL's GRPOConfig name; it is 'rollout.group_size' here",
        ),
        ("learning_rate=1e-6", "it is 'train.lr' here"),
        ("train.loss_type=dapo", "it is 'loss.aggregation' here"),
        ("use_vllm=true", "it is 'rollout.sampler' here (rollout.sampler: vllm"),
        ("vllm_gpu_memory_utilization=0.5", "it is 'rollout.vllm.gpu_memory_utilization' here"),
        ("vllm_enable_sleep_mode=true", "it is 'rollout.vllm.sleep' here"),
        ("repetition_penalty=1.1", "it is 'rollout.repetition_penalty' here"),
        ("loss.vllm_importance_sampling_mode=token_truncate", "it is 'loss.engine_correction' here"),
        ("vllm_importance_sampling_clip_max=3", "it is 'loss.engine_correction_cap' here"),
        ("loss.delta=2", "it is 'loss.dual_clip' here (INTELLECT-2's cap on the ratio"),
        ("train.steps_per_generation=4", "it is 'train.minibatches' here (optimizer steps per generated batch"),
        ("generation_batch_size=64", "it is 'rollout.prompts_per_step' here (completions generated per step"),
        ("disable_dropout=true", "TRL's GRPOConfig name; dropout is always off here"),
    ],
)
def test_trls_names_point_to_the_key_with_the_same_meaning(override, message):
    """A TRL user's GRPOConfig name is pointed at our key with its meaning, never at a key
    spelt alike (loss.epsilon is the clip range, not loss.eps, the std's epsilon)."""
    with pytest.raises(UserError) as err:
        config_from_dict(minimal(), [override])
    assert message in str(err.value) and "did you mean" not in str(err.value)


def test_the_docs_table_of_trl_names_is_the_config_s():
    from pathlib import Path

    from grpo.config import TRL_NAMES

    readme = (Path(__file__).parents[1] / "docs" / "coming-from-trl.md").read_text()
    for name, (ours, _) in TRL_NAMES.items():
        assert f"| `{name}` | " + (f"`{ours}`" if ours else "-") in readme, name
        if ours:  # and every key it points to exists
            node = config_from_dict(minimal())
            for part in ours.split("."):
                node = getattr(node, part)


@pytest.mark.parametrize(
    "rollout,resolved",
    [
        ({}, "token_tis"),  # the sampler draws from the distribution the loss scores
        ({"top_p": 0.9}, "none"),  # truncations: the ratio would carry the mass kept
        ({"top_k": 20}, "none"),
        ({"min_p": 0.1}, "none"),
        ({"min_new_tokens": 2}, "none"),
        ({"temperature": 0.7, "repetition_penalty": 1.2}, "token_tis"),  # scored exactly
    ],
)
def test_the_engine_correction_defaults_to_token_tis_unless_the_sampling_truncates(rollout, resolved):
    assert config_from_dict(minimal(rollout=rollout)).loss.engine_correction == resolved
    given = config_from_dict(minimal(rollout=rollout, loss={"engine_correction": "sequence_mask"}))
    assert given.loss.engine_correction == "sequence_mask"  # set explicitly, it stays
    assert config_from_dict(minimal(rollout=rollout)).loss.engine_correction_cap == 2.0


def test_a_bad_engine_correction_is_one_line():
    assert "loss.engine_correction_cap: must be > 1, got 1.0" in user_error(minimal(loss={"engine_correction_cap": 1}))
    message = user_error(minimal(loss={"engine_correction": "token_truncate"}))
    assert "loss.engine_correction: expected one of 'none' | 'token_tis' | 'sequence_mask'" in message
