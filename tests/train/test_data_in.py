"""Data in, every common way (issue 58): a GSM8K-shaped dataset folder with two configurations,
loaded by name with a system prompt, trains; rows handed to grpo.train as a Dataset or a list
of dicts, and a model and tokenizer handed over already loaded, train as the same run from
files does."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo
import grpo.rollout.sampler as sampler_module
from grpo.errors import UserError
from grpo.tasks.tiny import tiny_llama, tool_chat_tokenizer
from tests.dataset_folders import offline_datasets, write_gsm8k_folder

SYSTEM = "Reason, then answer after ####."
ROWS = [{"prompt": p, "tag": i} for i, p in enumerate(["a", "b", "c", "ab", "ba", "cab", "abc", "cc"])]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Llama whose tokenizer has a ChatML template that renders a system message."""
    directory = tmp_path_factory.mktemp("chat_model")
    tokenizer = tool_chat_tokenizer()
    tiny_llama(tokenizer, hidden_size=32, layers=1, heads=2).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture
def datasets_offline(tmp_path, monkeypatch):
    return offline_datasets(tmp_path, monkeypatch)


@pytest.fixture
def rendered(monkeypatch):
    """The prompt tokens every sampling started from, decoded: what the model saw."""
    seen: list[str] = []
    real = sampler_module.encode_prompts

    def recording(tokenizer, texts, max_prompt_length, **options):
        ids, mask, cut, shown = real(tokenizer, texts, max_prompt_length, **options)
        seen.extend(tokenizer.decode(row[row_mask.bool()]) for row, row_mask in zip(ids, mask))
        return ids, mask, cut, shown

    monkeypatch.setattr(sampler_module, "encode_prompts", recording)
    return seen


def gsm8k_config(model: str, folder: Path, out: Path, **data) -> dict:
    return {
        "model": model,
        "seed": 0,
        "output_dir": str(out),
        "data": {"path": str(folder), "prompt_column": "question", "system_prompt": SYSTEM, **data},
        "rewards": [{"function": "exact_answer"}],
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        "train": {"steps": 2, "sample_every": 1},
    }


def test_a_gsm8k_shaped_folder_with_two_configurations_and_a_system_prompt_trains(
    chat_model, tmp_path, datasets_offline, rendered
):
    folder = write_gsm8k_folder(tmp_path / "gsm8k")
    result = grpo.train(gsm8k_config(chat_model, folder, tmp_path / "run", config="socratic"), progress=False)
    assert [m["step"] for m in result.metrics] == [1, 2]
    assert AutoModelForCausalLM.from_pretrained(result.final_dir) is not None
    # The named configuration's rows, each rendered by the chat template after the system message.
    assert len(rendered) == 4 and all(text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>") for text in rendered)
    assert all("<|im_start|>user\nSocratic: What is " in text for text in rendered), rendered
    assert all(text.endswith("<|im_start|>assistant\n") for text in rendered)
    # The reward functions get the conversational prompt; config.yaml records the keys.
    sample = json.loads((result.output_dir / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"][0] == {"role": "system", "content": SYSTEM} and sample["prompt"][1]["role"] == "user"
    assert yaml.safe_load((result.output_dir / "config.yaml").read_text())["data"]["config"] == "socratic"


def test_an_unknown_configuration_is_one_line_listing_the_dataset_s_before_any_model_loads(
    chat_model, tmp_path, datasets_offline
):
    folder = write_gsm8k_folder(tmp_path / "gsm8k")
    with pytest.raises(UserError) as info:
        grpo.train(gsm8k_config(chat_model, folder, tmp_path / "run", config="mian"), progress=False)
    assert str(info.value) == f"data.config: {folder} has no configuration 'mian' (configurations: main, socratic)"
    assert not (tmp_path / "run").exists()  # refused before output_dir is touched


def test_a_system_prompt_with_a_model_that_has_no_chat_template_is_one_line(tiny_model, tmp_path, rendered):
    config = {
        "model": tiny_model,
        "output_dir": str(tmp_path / "run"),
        "data": {"system_prompt": SYSTEM},
        "rewards": [{"function": "tests.train.rewards_for_tests:sevens"}],
    }
    with pytest.raises(UserError, match=r"^data.system_prompt: the model's tokenizer has no chat template") as info:
        grpo.train(config, dataset=ROWS, progress=False)
    assert "\n" not in str(info.value) and rendered == [] and not (tmp_path / "run").exists()


# ---- rows and models handed to grpo.train ---------------------------------------------------------


def run(make_config, name, *, keep=("data", "model"), steps=3, **handed):
    """make_config's run (train.steps `steps`) in folder `name`, its data and model kept
    as `keep` says, and `handed` as grpo.train's arguments."""
    config = make_config(train={"steps": steps, "lr": 1e-3, "sample_every": 0})
    config["output_dir"] = str(Path(config["output_dir"]).parent / name)
    for key in {"data", "model"} - set(keep):
        del config[key]
    return grpo.train(config, progress=False, **handed)


def same_run(got, want):
    for key in ("reward/mean", "kl", "loss", "entropy"):
        assert [m[key] for m in got.metrics] == [m[key] for m in want.metrics], key


def test_a_list_of_dicts_and_a_dataset_are_the_run_from_a_file(make_config, prompts_file):
    from datasets import Dataset, DatasetDict

    want = run(make_config, "file")
    rows = [json.loads(line) for line in Path(prompts_file).read_text().splitlines()]
    same_run(run(make_config, "list", keep=["model"], dataset=rows), want)
    same_run(run(make_config, "dataset", keep=["model"], train_dataset=Dataset.from_list(rows)), want)
    split = DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:1])})
    handed = run(make_config, "dict", dataset=split)  # replaces the config's data.path
    same_run(handed, want)
    recorded = yaml.safe_load((handed.output_dir / "config.yaml").read_text())
    assert recorded["data"]["path"] == "<dataset given to grpo.train>"


@pytest.mark.learning
def test_a_dataset_handed_to_grpo_train_learns(make_config):
    from datasets import Dataset

    result = run(make_config, "learn", keep=["model"], steps=30, dataset=Dataset.from_list(ROWS))
    rewards = [m["reward/mean"] for m in result.metrics]
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 >= 0.2, [round(r, 3) for r in rewards]


def test_a_model_handed_over_trains_in_place_with_a_copy_as_reference(make_config, tiny_model):
    want = run(make_config, "path")
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    got = run(make_config, "object", keep=["data"], model=model, processing_class=tokenizer)
    same_run(got, want)  # the same numbers as the model loaded from its folder
    assert got.metrics[-1]["kl"] > 0  # the reference stayed where the policy started
    assert got.summary["parameters"] == 2 * sum(p.numel() for p in model.parameters())
    final = AutoModelForCausalLM.from_pretrained(got.final_dir).state_dict()
    trained = model.state_dict()
    assert all(torch.equal(final[k], trained[k]) for k in trained)  # final/ is the object, trained in place
    assert any(not torch.equal(initial[k], trained[k]) for k in initial)
    assert (got.final_dir / "tokenizer.json").is_file()
    recorded = yaml.safe_load((got.output_dir / "config.yaml").read_text())["model"]
    assert recorded == f"<model given to grpo.train: {tiny_model}>"


def test_a_model_handed_over_without_its_tokenizer_takes_its_folder_s(make_config, tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    result = run(make_config, "no-tokenizer", keep=["data"], steps=1, model=model)
    assert (result.final_dir / "tokenizer.json").is_file()


def test_what_cannot_be_handed_over_is_one_line_before_anything_runs(make_config, tiny_model):
    from grpo.tasks.tiny import char_tokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    unsaved = tiny_llama(char_tokenizer("ab"), hidden_size=8, layers=1, heads=2)  # no folder to take a tokenizer from
    config = make_config()
    cases = [
        (dict(model=object()), "^model: expected a model folder or hub id, or a transformers PreTrainedModel"),
        (dict(model=unsaved), "^tokenizer: hand the model's tokenizer too"),
        (dict(dataset=ROWS, train_dataset=ROWS), "^dataset and train_dataset: two names of one argument; give one$"),
        (
            dict(model=model, overrides=["rollout.async.max_staleness=1"]),
            "^rollout.async: a model or tokenizer handed to grpo.train",
        ),
        (
            dict(dataset={"prompt": "a"}),
            "^dataset: expected a datasets.Dataset, a DatasetDict or a list of dicts, got dict$",
        ),
    ]
    for handed, message in cases:
        with pytest.raises(UserError, match=message):
            grpo.train(config, progress=False, **handed)
    # A resume from the config.yaml of a run whose model was handed over, without it.
    with pytest.raises(
        UserError, match=r"^model: this run's model was handed to grpo.train\(model=...\): hand it again"
    ):
        grpo.train({**config, "model": f"<model given to grpo.train: {tiny_model}>"}, progress=False)
    assert not Path(config["output_dir"]).exists()
