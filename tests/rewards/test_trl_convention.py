"""Reward functions run exactly as TRL's GRPOTrainer calls them: all by keyword, with
prompts, completions (message lists for conversational prompts), completion_ids,
trainer_state and every other column; sync or async. Written as TRL's docs write them."""

import json
from types import SimpleNamespace

import pytest

import grpo
from grpo.errors import UserError
from grpo.rewards import load_rewards, score
from tests.rewards import trl_style_rewards as trl


def specs(*names):
    return load_rewards([(f"tests.rewards.trl_style_rewards:{n}", 1.0) for n in names])


def test_plain_prompts_get_text_completions_and_every_argument_by_keyword():
    trl.CALLS.clear()
    prompts, completions = ["a", "b"], ["x" * 18, "\\boxed{7}"]
    result = score(
        specs("reward_len", "reward_func", "length_in_tokens", "curriculum"),
        prompts,
        completions,
        {"ground_truth": ["1", "7"]},
        completion_ids=[[5, 6, 2], [7, 2]],
        trainer_state=SimpleNamespace(global_step=3, max_steps=12),
    )
    per = {name.split(":")[1]: values.tolist() for name, values in result.per_function.items()}
    assert per == {
        "reward_len": [-2.0, -11.0],
        "reward_func": [0.0, 1.0],
        "length_in_tokens": [3.0, 2.0],
        "curriculum": [0.25, 0.25],
    }
    assert trl.CALLS[0] == {
        "fn": "reward_len",
        "completions": completions,
        "kwargs": ["completion_ids", "ground_truth", "prompts", "trainer_state"],
    }


def test_conversational_prompts_get_message_completions():
    prompts = [[{"role": "user", "content": "think"}]] * 2
    completions = ["<think>hm</think><answer>4</answer>", "4"]
    result = score(specs("format_reward_func", "async_reward"), prompts, completions, {})
    assert [v.tolist() for v in result.per_function.values()] == [[1.0, 0.0], [5.0, 5.0]]


def test_a_run_calls_trl_style_rewards_with_token_ids_and_the_trainer_state(make_config, tiny_model, tmp_path):
    """A chat model (a template added to the tiny model's tokenizer), conversational data,
    TRL's reward functions: they run unchanged, and see each completion's token ids (up to
    and including EOS) and the step."""
    from transformers import AutoTokenizer

    model = tmp_path / "chat-model"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(model)
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": p}], "ground_truth": "7"}) + "\n"
            for p in ["ab", "ba", "cab", "c"]
        )
    )
    rewards = [
        {"function": f"tests.rewards.trl_style_rewards:{n}"}
        for n in ("format_reward_func", "length_in_tokens", "curriculum", "async_reward")
    ]
    trl.CALLS.clear()
    config = make_config(
        model=str(model),
        data={"path": str(data)},
        rewards=rewards,
        rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6, "min_new_tokens": 0},
        train={"steps": 3, "lr": 1e-3},
    )
    result = grpo.train(config, progress=False)
    assert len(result.metrics) == 3
    steps = [c for c in trl.CALLS if c["fn"] == "curriculum"]
    assert [(c["global_step"], c["max_steps"]) for c in steps] == [(0, 3), (1, 3), (2, 3)]
    ids = [c["completion_ids"] for c in trl.CALLS if c["fn"] == "length_in_tokens"]
    assert len(ids) == 3 and all(len(batch) == 8 for batch in ids)
    eos = AutoTokenizer.from_pretrained(tiny_model).eos_token_id
    for batch in ids:
        assert all(1 <= len(row) <= 6 and (len(row) == 6 or row[-1] == eos) and eos not in row[:-1] for row in batch)
    lengths = [m["completion_length/mean"] for m in result.metrics]
    means = [sum(map(len, batch)) / len(batch) for batch in ids]
    assert means == pytest.approx(lengths)


def test_grpo_eval_calls_a_verifier_as_training_calls_a_reward():
    from grpo.eval.runner import reward_verifier

    plain = reward_verifier("tests.rewards.trl_style_rewards:reward_func")
    assert plain.check_group(["\\boxed{7}", "8"], {"prompt": "q", "ground_truth": "7"}) == [True, False]
    chat = reward_verifier("tests.rewards.trl_style_rewards:format_reward_func")
    row = {"prompt": [{"role": "user", "content": "q"}]}
    assert chat.check_group(["<think>a</think><answer>1</answer>", "1"], row) == [True, False]
    legacy = reward_verifier(lambda p, c, **kw: [float(x == "1") for x in c])  # positional, plain prompts
    assert legacy.check_group(["1", "2"], {"prompt": "q"}) == [True, False]
    # Two positional parameters named after other arguments (columns here): all by keyword, as TRL calls it.
    named = reward_verifier(lambda answer, tag, **kw: [float(c == answer[0] + tag[0]) for c in kw["completions"]])
    assert named.check_group(["1x", "2"], {"prompt": "q", "answer": "1", "tag": "x"}) == [True, False]


def test_python_functions_are_rewards_in_a_config(make_config, tmp_path):
    """grpo.train({..., "rewards": [fn, ...]}): functions given directly (bare, or as
    {function: fn, weight: w}), named 'module:qualname' in the metrics and config.yaml."""
    import yaml

    config = make_config(
        rewards=[trl.reward_len, {"function": lambda completions, **kw: [1.0] * len(completions), "weight": 0.5}],
        train={"steps": 2, "lr": 1e-3},
    )
    result = grpo.train(config, progress=False)
    assert "reward/tests.rewards.trl_style_rewards:reward_len" in result.metrics[-1]
    assert (
        result.metrics[-1][
            "reward/tests.rewards.test_trl_convention:test_python_functions_are_rewards_in_a_config.<locals>.<lambda>"
        ]
        == 1.0
    )
    written = yaml.safe_load((result.output_dir / "config.yaml").read_text())
    assert [r["function"] for r in written["rewards"]][0] == "tests.rewards.trl_style_rewards:reward_len"
    isolated = make_config(
        rewards=[{"function": lambda completions, **kw: [0.0] * len(completions), "isolate": True}],
        output_dir=str(tmp_path / "isolated"),
    )
    with pytest.raises(UserError, match="isolate"):
        grpo.train(isolated, progress=False)


def test_rewards_given_beside_the_config_replace_its_rewards(make_config):
    """grpo.train(config, rewards=[fn, ...]), as TRL's reward_funcs: the config's own rewards
    are not called."""
    config = make_config(
        rewards=[{"function": lambda completions, **kw: [0.0] * len(completions)}], train={"steps": 1, "lr": 1e-3}
    )
    result = grpo.train(config, progress=False, rewards=[trl.reward_len, {"function": "r1_format", "weight": 0.0}])
    names = {key for key in result.metrics[-1] if key.startswith("reward/")}
    assert "reward/tests.rewards.trl_style_rewards:reward_len" in names
    assert not any("lambda" in name for name in names)
    by_spec = grpo.train(config, progress=False, overwrite=True, rewards=["r1_format"])  # a spec string, as documented
    assert {key for key in by_spec.metrics[-1] if key.startswith("reward/")} == {
        "reward/mean",
        "reward/std",
        "reward/r1_format",
    }
    with pytest.raises(UserError, match="rewards"):
        grpo.train(config, progress=False, rewards=[42])


def test_rewards_given_beside_the_config_need_none_in_it(make_config, tmp_path):
    """As TRL's GRPOTrainer takes reward_funcs beside a config that names none, a config (a
    mapping or a YAML file) may leave `rewards` out when grpo.train is given them."""
    import yaml

    config = make_config(train={"steps": 1, "lr": 1e-3})
    del config["rewards"]
    with pytest.raises(UserError, match="rewards: at least one reward is required"):
        grpo.train(config, progress=False)
    result = grpo.train(config, progress=False, rewards=[trl.reward_len])
    assert "reward/tests.rewards.trl_style_rewards:reward_len" in result.metrics[-1]
    path = tmp_path / "no-rewards.yaml"
    path.write_text(yaml.safe_dump({**config, "output_dir": str(tmp_path / "from-yaml")}))
    from_yaml = grpo.train(path, progress=False, rewards=["r1_format"])
    assert "reward/r1_format" in from_yaml.metrics[-1]
