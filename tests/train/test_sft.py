"""`grpo sft`: the supervised warm-up that puts a from-scratch model where RL can move it."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.cli import build_parser
from grpo.errors import UserError
from grpo.tasks import arithmetic
from grpo.tasks.tiny import char_tokenizer, tiny_llama
from grpo.train.sft import (
    IGNORE_INDEX,
    SFTConfig,
    completion_batch,
    completion_loss,
    sft,
    sft_sequence_length,
)
from tests.helpers import assert_close_scaled, scale_of

# A fast, tiny setting for runs whose result is not looked at closely.
TINY = dict(hidden_size=32, layers=1, heads=2, batch_size=16, warmup_steps=1)


def parser():
    return build_parser()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The default model after 100 updates (the defaults take 375): shaped, not yet right."""
    directory = tmp_path_factory.mktemp("sft") / "model"
    summary = sft(directory, SFTConfig(steps=100, warmup_steps=10), progress=False)
    return summary, directory


def greedy_completions(model, tokenizer, prompts):
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **encoded,
            do_sample=False,
            max_new_tokens=24,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)


# ---- the batch and the loss ---------------------------------------------------------------------


def test_labels_are_ignored_on_the_prompt_and_the_padding():
    tok = char_tokenizer(arithmetic.ALPHABET)
    short, long = arithmetic.problem_for(1, 2), arithmetic.problem_for(47, 85)
    batch = completion_batch(tok, [short.prompt, long.prompt], [short.solution, long.solution])
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    for row, p in enumerate([short, long]):
        n_prompt, n_completion = len(p.prompt), len(p.solution) + 1  # one token per character, + EOS
        length = n_prompt + n_completion
        assert tok.decode(ids[row, :n_prompt]) == p.prompt
        assert tok.decode(ids[row, n_prompt : length - 1]) == p.solution
        assert ids[row, length - 1] == tok.eos_token_id  # the model learns to stop
        assert (labels[row, :n_prompt] == IGNORE_INDEX).all()
        assert torch.equal(labels[row, n_prompt:length], ids[row, n_prompt:length])
        assert (labels[row, length:] == IGNORE_INDEX).all() and (ids[row, length:] == tok.pad_token_id).all()
        assert mask[row].tolist() == [1] * length + [0] * (ids.shape[1] - length)
    assert ids.shape[1] == len(long.prompt) + len(long.solution) + 1  # padded to the longest, no more


def test_loss_is_the_mean_next_token_cross_entropy_over_completion_tokens():
    tok = char_tokenizer(arithmetic.ALPHABET)
    problems = [arithmetic.problem_for(3, 4), arithmetic.problem_for(99, 99), arithmetic.problem_for(10, 5)]
    batch = completion_batch(tok, [p.prompt for p in problems], [p.solution for p in problems])
    labels = batch["labels"]
    logits = torch.randn(*labels.shape, len(tok), generator=torch.Generator().manual_seed(0))

    # Naive reference: position t predicts token t + 1, counted only where that is a completion token.
    terms = [
        -torch.log_softmax(logits[b, t], -1)[labels[b, t + 1]]
        for b in range(labels.shape[0])
        for t in range(labels.shape[1] - 1)
        if labels[b, t + 1] != IGNORE_INDEX
    ]
    expected = torch.stack(terms).mean()
    loss = completion_loss(logits, labels)
    assert_close_scaled(loss, expected, scale=scale_of(logits))  # rounding follows the logits

    # Whatever the model predicts for the prompt and past the end does not count...
    predicts_nothing = torch.zeros_like(labels, dtype=torch.bool)
    predicts_nothing[:, :-1] = labels[:, 1:] == IGNORE_INDEX
    predicts_nothing[:, -1] = True
    changed = logits.clone()
    changed[predicts_nothing] = torch.randn(int(predicts_nothing.sum()), len(tok)) * 10
    assert_close_scaled(completion_loss(changed, labels), loss, scale=scale_of(logits))
    # ...and what it predicts for a completion token does.
    changed = logits.clone()
    changed[0, len(problems[0].prompt) - 1] += 10 * torch.randn(len(tok))  # predicts the first completion token
    assert not torch.allclose(completion_loss(changed, labels), loss, atol=1e-3)


def test_sequence_length_bound_is_the_longest_sequence():
    tok = char_tokenizer(arithmetic.ALPHABET)
    for digits in (1, 2, 3, 4):
        top = 10**digits - 1
        worst = arithmetic.problem_for(top, top)  # the answer has digits + 1 digits
        batch = completion_batch(tok, [worst.prompt], [worst.solution])
        assert batch["input_ids"].shape[1] == sft_sequence_length(digits)
    longest = max(
        len(p) + len(s) + 1
        for p, s in (
            (f"{a}+{b}=", arithmetic.problem_for(a, b).solution) for a in range(10, 100) for b in range(10, 100)
        )
    )
    assert longest == sft_sequence_length(2) == 28


# ---- training ------------------------------------------------------------------------------------


@pytest.mark.learning
def test_short_run_lowers_the_loss(trained):
    summary, directory = trained
    assert summary["steps"] == 100
    assert summary["loss/last"] < 0.6 * summary["loss/first"], summary
    tok = char_tokenizer(arithmetic.ALPHABET)
    assert summary["parameters"] == sum(
        p.numel() for p in tiny_llama(tok, hidden_size=64, layers=2, heads=4).parameters()
    )
    assert summary["output"] == str(directory) and summary["time_s"] > 0


def test_saved_directory_loads_and_its_tokenizer_round_trips(trained):
    _, directory = trained
    model = AutoModelForCausalLM.from_pretrained(directory)
    tok = AutoTokenizer.from_pretrained(directory)
    assert model.config.max_position_embeddings == SFTConfig().max_positions
    assert model.config.eos_token_id == tok.eos_token_id is not None
    problem = arithmetic.problem_for(47, 85)
    text = problem.prompt + problem.solution
    ids = tok(text, add_special_tokens=True)["input_ids"]
    assert len(ids) == len(text) and tok.unk_token_id not in ids  # one known token per character
    assert tok.decode(ids) == text
    assert json.loads((directory / "sft_config.json").read_text())["steps"] == 100


def test_a_little_training_teaches_the_solution_shape(trained):
    _, directory = trained
    tok = AutoTokenizer.from_pretrained(directory)
    prompts = [row["prompt"] for row in arithmetic.make_rows(32, seed=123)]
    untrained = tiny_llama(tok, hidden_size=64, layers=2, heads=4, max_positions=64, seed=0).eval()
    shaped = AutoModelForCausalLM.from_pretrained(directory).eval()
    before = arithmetic.format_reward(prompts, greedy_completions(untrained, tok, prompts))
    after = arithmetic.format_reward(prompts, greedy_completions(shaped, tok, prompts))
    assert sum(before) / len(prompts) <= 0.1
    assert sum(after) / len(prompts) >= 0.5


def test_same_seed_same_weights_and_global_random_state_untouched(tmp_path):
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    runs = {}
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        sft(tmp_path / name, SFTConfig(steps=4, seed=seed, **TINY), progress=False)
        runs[name] = load_file(tmp_path / name / "model.safetensors")
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state
    assert runs["a"].keys() == runs["b"].keys()
    assert all(torch.equal(runs["a"][k], runs["b"][k]) for k in runs["a"])
    assert any(not torch.equal(runs["a"][k], runs["c"][k]) for k in runs["a"])


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(task="multiplication"), "unknown task"),
        (dict(hidden_size=30, heads=4), "must divide"),
        (dict(digits=6), "positions"),  # 76 positions > 64
        (dict(digits=[2, 6]), "positions"),  # the longest length of a mix counts
        (dict(digits=[]), "digits"),
        (dict(digits=[2, 0]), "digits"),
        (dict(steps=0), "steps"),
        (dict(lr=0.0), "lr"),
    ],
)
def test_bad_settings_stop_before_training(tmp_path, change, words):
    with pytest.raises(UserError, match=words) as caught:
        sft(tmp_path / "out", SFTConfig(**{**TINY, **change}), progress=False)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


# ---- the command ---------------------------------------------------------------------------------


def test_a_digits_list_mixes_problem_lengths_and_one_length_draws_as_before(tmp_path, monkeypatch, capsys):
    drawn = []
    make = arithmetic.make_problem

    def recording(rng, digits=2):
        drawn.append(digits)
        return make(rng, digits)

    monkeypatch.setattr(arithmetic, "make_problem", recording)
    args = parser().parse_args(
        [
            "sft",
            "--output",
            str(tmp_path / "mix"),
            "--steps",
            "4",
            "--batch-size",
            "16",
            "--hidden",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--digits",
            "1,3",
            "--quiet",
        ]
    )
    assert args.handler(args) == 0
    assert set(drawn) == {1, 3} and 16 <= drawn.count(1) <= 48  # 64 problems, each length about half
    assert json.loads((tmp_path / "mix" / "sft_config.json").read_text())["digits"] == [1, 3]
    # One length: the stream of problems is the one a plain int always drew.
    drawn.clear()
    sft(tmp_path / "one", SFTConfig(**{**TINY, "steps": 1, "digits": [2]}), progress=False)
    listed = list(drawn)
    drawn.clear()
    sft(tmp_path / "int", SFTConfig(**{**TINY, "steps": 1, "digits": 2}), progress=False)
    assert listed == drawn == [2] * TINY["batch_size"]
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == (
        tmp_path / "int" / "model.safetensors"
    ).read_bytes()


def test_command_prints_json_last_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "warm"
    argv = [
        "sft",
        "--output",
        str(out),
        "--steps",
        "3",
        "--batch-size",
        "8",
        "--hidden",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--seed",
        "5",
        "--quiet",
    ]
    args = parser().parse_args(argv)
    assert args.handler(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["output"] == str(out) and summary["steps"] == 3
    saved = json.loads((out / "sft_config.json").read_text())
    assert (saved["hidden_size"], saved["layers"], saved["heads"], saved["seed"], saved["batch_size"]) == (
        32,
        1,
        2,
        5,
        8,
    )
    assert saved["lr"] == SFTConfig().lr  # not given: the default
    before = (out / "model.safetensors").read_bytes()

    args = parser().parse_args([*argv[:-3], "--seed", "6", "--quiet"])
    with pytest.raises(UserError, match="not empty") as caught:
        args.handler(args)
    assert "\n" not in str(caught.value) and "--overwrite" in str(caught.value)
    assert (out / "model.safetensors").read_bytes() == before  # untouched

    args = parser().parse_args([*argv[:-3], "--seed", "6", "--quiet", "--overwrite"])
    assert args.handler(args) == 0
    assert (out / "model.safetensors").read_bytes() != before


def test_logged_to_a_file_it_prints_a_line_every_log_every_updates(tmp_path, capsys):
    """stderr not a terminal (pytest's capture): plain lines, the first, every 2nd, the last."""
    argv = [
        "sft",
        "--output",
        str(tmp_path / "warm"),
        "--steps",
        "5",
        "--batch-size",
        "4",
        "--hidden",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--log-every",
        "2",
    ]
    args = parser().parse_args(argv)
    assert args.handler(args) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("grpo sft:")]
    assert [line.split()[3] for line in lines] == ["1/5", "2/5", "4/5", "5/5"]
    assert all("loss" in line and "s/step" in line and "\r" not in line for line in lines)


def test_output_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    args = parser().parse_args(["sft", "--output", str(path), "--steps", "1", "--overwrite", "--quiet"])
    with pytest.raises(UserError, match="not a directory"):
        args.handler(args)


def test_help_says_why_a_warm_up_is_needed(capsys):
    with pytest.raises(SystemExit) as stop:
        parser().parse_args(["sft", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "zero advantage" in text and "--overwrite" in text and f"(default: {SFTConfig().steps})" in text
    with pytest.raises(SystemExit):
        parser().parse_args(["sft", "--output", "x", "--steps", "0"])  # argparse rejects it, exit 2
