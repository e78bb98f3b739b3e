"""The model card final/ and best/ carry (grpo.train.card): the Hub's YAML header, parsed; the
data, rewards, steps and samples of the run; the evaluation before and after, as
metrics.jsonl logged it; the command and config that reproduce it."""

import json
from pathlib import Path

import pytest
import yaml

import grpo
from grpo.config import config_from_dict, config_to_dict
from grpo.train.card import CARD, CONFIG, hub_id, model_card
from grpo.train.loop import train
from tests.train.test_in_loop_evaluation import SEVENS, config_of, lines


def header_and_body(text: str) -> tuple[dict, str]:
    """The card's YAML header, parsed, and the text after it."""
    assert text.startswith("---\n")
    head, _, body = text[4:].partition("\n---\n")
    return yaml.safe_load(head), body


def hub_config(**sections):
    """A config naming a hub model and a hub dataset (read, never loaded)."""
    tree = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "output_dir": "runs/gsm8k",
        "data": {"path": "openai/gsm8k", "config": "main"},
        "rewards": [{"function": SEVENS, "weight": 0.5}, {"function": "r1_format", "weight": 2}],
        "rollout": {"group_size": 8, "prompts_per_step": 4},
        "train": {"steps": 3},
        **sections,
    }
    return config_from_dict(tree)


def test_a_card_names_hub_models_and_datasets_in_its_header():
    c = hub_config()
    head, body = header_and_body(model_card(c, steps=3, rows=7473))
    assert head["base_model"] == "Qwen/Qwen2.5-0.5B-Instruct" and head["datasets"] == ["openai/gsm8k"]
    assert head["library_name"] == "transformers" and {"grpo", "reinforcement-learning"} <= set(head["tags"])
    assert head["model_name"] == "gsm8k"
    assert f"| `{SEVENS}` | 0.5 |" in body and "| `r1_format` | 2 |" in body  # the rewards and their weights
    assert "| configuration | `main` |" in body and "| split | `train` |" in body and "| rows | 7473 |" in body
    assert "| steps | 3 |" in body and "| completions sampled | 96 |" in body  # 3 steps x 4 prompts x 8
    assert f"grpo {grpo.__version__}" in body and f"grpo train {CONFIG}" in body
    shown = body.split("```yaml\n")[1].split("```")[0]
    assert yaml.safe_load(shown) == config_to_dict(c)  # the resolved config, whole
    # Not evaluated: the command that measures it, with the run's first function reward.
    assert f"grpo eval --model runs/gsm8k/final --data HELD_OUT_DATA --verifier {SEVENS}" in body


def test_a_pushed_card_names_its_repository_and_an_adapter_is_peft_s():
    c = hub_config(train={"steps": 3, "push_to_hub": "someone/gsm8k-grpo"}, lora={"r": 8, "save": "adapter"})
    head, body = header_and_body(model_card(c, steps=3, adapter=True))
    assert head["model_name"] == "gsm8k-grpo" and head["library_name"] == "peft" and "lora" in head["tags"]
    assert "grpo eval --model someone/gsm8k-grpo " in body


@pytest.mark.parametrize(
    "name,expected",
    [
        ("openai/gsm8k", "openai/gsm8k"),
        ("gpt2", "gpt2"),
        ("arithmetic:100", None),  # generated rows
        ("reasoning_gym:leg_counting?size=10", None),
        ("./data/prompts.jsonl", None),
        ("/abs/model", None),
        ("<dataset given to grpo.train>", None),
    ],
)
def test_only_hub_ids_go_into_the_header(name, expected):
    assert hub_id(name) == expected


def test_a_local_folder_is_no_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-model").mkdir()
    assert hub_id("my-model") is None and hub_id("your-model") == "your-model"


@pytest.fixture(scope="module")
def evaluated_run(tiny_model, prompts_file, tmp_path_factory):
    """2 steps, evaluated at 0, 1 and 2, best/ kept by pass@1."""
    out = tmp_path_factory.mktemp("card") / "run"
    config = config_of(
        tiny_model,
        prompts_file,
        out,
        steps=2,
        eval={"data": prompts_file, "n": 2, "k": [1, 2], "every": 1, "threshold": 0.125, "seed": 3},
        train={"keep_best": "eval/pass@1"},
    )
    train(config, progress=False)
    return out


def evaluation_column(body: str, column: int) -> dict[str, str]:
    """{metric: cell} of the card's evaluation table, `column` 1 being the first evaluation."""
    table = body.split("## Evaluation")[1].split("## Reproduce")[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `eval/")]
    return {row[0].strip("| `"): row[column].strip(" |") for row in rows}


def cell(line: dict, name: str) -> str:
    return f"{line[name]:.3f} ({line[name + '_lo']:.3f}-{line[name + '_hi']:.3f})"


def test_the_card_of_a_run_reports_its_data_steps_and_evaluation(evaluated_run, prompts_file):
    out = evaluated_run
    head, body = header_and_body((out / "final" / CARD).read_text())
    assert "base_model" not in head and "datasets" not in head  # a local folder and file: not the Hub's
    assert head["library_name"] == "transformers" and "grpo" in head["tags"]
    logged = {m["step"]: m for m in lines(out)}
    assert "| step 0 | step 2 |" in body  # before and after
    before, after = evaluation_column(body, 1), evaluation_column(body, 2)
    for name in ("eval/pass@1", "eval/pass@2", "eval/maj@1", "eval/maj@2"):
        assert before[name] == cell(logged[0], name) and after[name] == cell(logged[2], name)
    assert after["eval/truncated"] == f"{logged[2]['eval/truncated']:.3f}"
    rows = len(Path(prompts_file).read_text().splitlines())
    assert f"| rows | {rows} |" in body and f"| data | `{prompts_file}` |" in body
    assert "| steps | 2 |" in body and "| completions sampled | 64 |" in body  # 2 steps x 4 prompts x 8
    tokens = sum(logged[s]["tokens/completion"] for s in (1, 2))
    assert f"| tokens generated | {tokens} |" in body
    # The config beside the weights is the run's config.yaml: `grpo train grpo_config.yaml` reruns it.
    assert yaml.safe_load((out / "final" / CONFIG).read_text()) == yaml.safe_load((out / "config.yaml").read_text())


def test_best_s_card_is_that_of_the_step_it_holds(evaluated_run):
    out = evaluated_run
    record = json.loads((out / "best" / "best.json").read_text())
    _, body = header_and_body((out / "best" / CARD).read_text())
    logged = {m["step"]: m for m in lines(out)}
    assert f"| steps | {record['step']} |" in body
    column = 2 if record["step"] else 1  # best at step 0: one column, before is after
    assert evaluation_column(body, column)["eval/pass@1"] == cell(logged[record["step"]], "eval/pass@1")
    assert (out / "best" / CONFIG).exists() and not (out / "best.tmp").exists()
