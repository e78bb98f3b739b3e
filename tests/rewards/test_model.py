import json
import random
import sys

import pytest
import torch

from grpo.algo import bradley_terry_loss
from grpo.cli import main
from grpo.errors import UserError
from grpo.rewards import WeightedReward, score
from grpo.rewards.model import RewardModel, load_pairs, split_pairs
from grpo.tasks.tiny import save_tiny_model
from tests.helpers import BACKWARD, FORWARD, assert_close_scaled, gap, scale_of

ALPHABET = "abc0123456789 "


def sevens(n, seed):
    """Comparisons where the chosen completion holds a '7' somewhere and the rejected none.

    Both are random digit strings; a '7' ends the chosen one only 1 time in 6, so the head
    cannot read the answer off the last token: it must attend over the completion.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = "".join(rng.choice("abc") for _ in range(rng.randint(3, 6))) + " "
        chosen = [rng.choice("012345689") for _ in range(rng.randint(4, 8))]
        chosen[rng.randrange(len(chosen))] = "7"
        rejected = "".join(rng.choice("012345689") for _ in range(rng.randint(4, 8)))
        rows.append({"prompt": prompt, "chosen": "".join(chosen), "rejected": rejected})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("rm_base"), ALPHABET, hidden_size=64, layers=2, heads=4))


@pytest.fixture(scope="module")
def trained(base):
    """A reward model trained on the sevens task: its scores vary, unlike a fresh head's."""
    rm = RewardModel.from_base(base, seed=0)
    rm.fit(sevens(128, seed=1), lr=1e-3, epochs=1, progress=False)
    return rm


# ---- learning ---------------------------------------------------------------------------------


def test_learns_a_preference_and_generalises_to_held_out_pairs(base):
    train, held_out = split_pairs(sevens(400, seed=0), 0.25, seed=0)
    assert (len(train), len(held_out)) == (300, 100)
    rm = RewardModel.from_base(base, seed=0)
    before = rm.evaluate(held_out)
    losses = rm.fit(train, lr=1e-3, epochs=2, batch_size=16, progress=False)
    after = rm.evaluate(held_out)
    assert 0.3 <= before["accuracy"] <= 0.7  # a fresh head knows nothing
    assert after["accuracy"] >= 0.9
    assert after["margin"] > 1.0 > abs(before["margin"])
    assert len(losses) == 2 * 19  # ceil(300 / 16) batches per epoch
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def test_fit_is_reproducible_and_leaves_the_global_rng_alone(base):
    pairs = sevens(48, seed=3)
    state = torch.get_rng_state()
    first = RewardModel.from_base(base, seed=0).fit(pairs, lr=1e-3, batch_size=8, seed=5, progress=False)
    again = RewardModel.from_base(base, seed=0).fit(pairs, lr=1e-3, batch_size=8, seed=5, progress=False)
    other = RewardModel.from_base(base, seed=0).fit(pairs, lr=1e-3, batch_size=8, seed=6, progress=False)
    assert first == again
    assert first != other  # another seed, another order of the pairs
    assert torch.equal(torch.get_rng_state(), state)


def test_fit_shows_a_progress_bar_with_the_running_loss_on_a_terminal(base, capsys, monkeypatch):
    quiet, shown = RewardModel.from_base(base), RewardModel.from_base(base)
    capsys.readouterr()  # transformers' own loading bars
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    shown.fit(sevens(8, seed=4), batch_size=4, progress=True)
    err = capsys.readouterr().err
    assert "reward model" in err and "loss=" in err and "accuracy=" in err and "2/2" in err and "\r" in err
    assert "grpo rm train: step" not in err  # the bar, not lines
    quiet.fit(sevens(8, seed=4), batch_size=4, progress=False)
    assert capsys.readouterr().err == ""


def test_fit_logged_to_a_file_prints_a_line_every_log_every_batches(base, capsys):
    """stderr not a terminal (captured): one plain line per log_every batches, the first and
    the last always, each with the epoch, the epoch's running loss and accuracy, s/step."""
    rm = RewardModel.from_base(base)
    capsys.readouterr()
    losses = rm.fit(sevens(20, seed=4), batch_size=4, epochs=2, log_every=3, progress=True)  # 5 batches an epoch
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("  ")[:2] for line in lines] == [
        ["grpo rm train: step 1/10", "epoch 1/2"],
        ["grpo rm train: step 3/10", "epoch 1/2"],
        ["grpo rm train: step 6/10", "epoch 2/2"],
        ["grpo rm train: step 9/10", "epoch 2/2"],
        ["grpo rm train: step 10/10", "epoch 2/2"],
    ]
    fields = [dict(part.rsplit(" ", 1) for part in line.split("  ")[2:4]) for line in lines]
    # The running loss is the mean of the epoch's batch losses so far (epoch 2 starts afresh).
    for logged, batches in zip(fields, [losses[:1], losses[:3], losses[5:6], losses[5:9], losses[5:10]]):
        assert float(logged["loss"]) == pytest.approx(sum(batches) / len(batches), abs=1e-4)
        assert 0.0 <= float(logged["accuracy"]) <= 1.0
    assert all(line.endswith(" s/step") and "  elapsed " in line for line in lines)


def test_new_head_is_seeded(base):
    state = torch.get_rng_state()
    a, b, c = (RewardModel.from_base(base, seed=s) for s in (0, 0, 1))
    assert torch.equal(a.model.score.weight, b.model.score.weight)
    assert not torch.equal(a.model.score.weight, c.model.score.weight)
    assert torch.equal(torch.get_rng_state(), state)


# ---- scoring ----------------------------------------------------------------------------------


def test_save_and_load_round_trip(trained, tmp_path):
    from transformers import AutoModelForSequenceClassification

    pairs = sevens(6, seed=7)
    prompts, completions = [p["prompt"] for p in pairs], [p["chosen"] for p in pairs]
    assert trained.max_length == 256  # the tiny model's position embeddings
    try:
        trained.max_length = 100  # saved with the tokenizer
        trained.save(tmp_path / "rm")
    finally:
        trained.max_length = 256
    loaded = RewardModel.from_pretrained(str(tmp_path / "rm"))
    assert loaded.max_length == 100
    # The same weights; a loaded model's are mapped from the file at another alignment, which
    # the matmul kernels round differently in the packed pass: equal to float rounding.
    assert_close_scaled(loaded.scores(prompts, completions), trained.scores(prompts, completions))
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert plain.config.num_labels == 1
    assert plain.config.pad_token_id == trained.tokenizer.pad_token_id


def test_loading_errors_are_one_line_and_name_the_path(base, tmp_path):
    with pytest.raises(UserError, match="not a trained reward model") as info:
        RewardModel.from_pretrained(base)  # a causal LM: its score head would be random
    assert base in str(info.value) and "\n" not in str(info.value)
    missing = str(tmp_path / "nowhere")
    with pytest.raises(UserError, match="no such directory") as info:
        RewardModel.from_base(missing)
    assert missing in str(info.value) and "\n" not in str(info.value)
    (tmp_path / "empty").mkdir()  # exists, but holds no model
    with pytest.raises(UserError, match="no config.json") as info:
        RewardModel.from_pretrained(str(tmp_path / "empty"))
    assert str(tmp_path / "empty") in str(info.value) and "\n" not in str(info.value)


def test_scores_do_not_depend_on_batching_or_padding(trained):
    pairs = sevens(8, seed=8)
    prompts = [p["prompt"] for p in pairs]
    completions = [p["chosen"] + p["rejected"] * (i % 3) for i, p in enumerate(pairs)]  # mixed lengths
    one = trained.scores(prompts, completions, batch_size=1)
    eight = trained.scores(prompts, completions, batch_size=8)
    assert one.dtype == torch.float32 and one.shape == (8,)
    assert one.std() > 1e-3  # a trained model: equal scores would prove nothing
    assert_close_scaled(one, eight)
    # A short text padded next to a long one scores as it does alone.
    alone = trained.scores(["ab "], ["12"])
    padded = trained.scores(["ab ", "abcabc "], ["12", "0123456789" * 5])
    assert_close_scaled(padded[:1], alone)


def _classifier_base(tmp_path, kind: str) -> str:
    """A tiny causal LM of `kind` saved with the character tokenizer: what from_base builds on."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo.tasks.tiny import char_tokenizer

    tokenizer = char_tokenizer(ALPHABET)
    sizes = {
        "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
        "qwen2": dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        ),
        "gpt2": dict(n_embd=32, n_layer=2, n_head=4),
        "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32),
    }[kind]
    config = AutoConfig.for_model(
        kind,
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **({"n_positions": 64} if kind == "gpt2" else {}),
        **sizes,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / kind)
    tokenizer.save_pretrained(tmp_path / kind)
    return str(tmp_path / kind)


def _padded_scores(rm, prompts, completions):
    """The scores of every text padded to the batch's longest (the packed layout refused)."""
    packs, rm._packs = rm._packs, False
    try:
        return rm.scores(prompts, completions)
    finally:
        rm._packs = packs


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2", "opt"])
def test_scores_and_gradients_are_the_padded_passs_in_the_packed_layout(tmp_path, kind):
    """Texts of several lengths score in one packed pass of the backbone (positions restarting
    at each text, attention within it) where the probe says it serves (Llama and Qwen2 at
    least); the scores and the Bradley-Terry loss's gradients are the padded pass's to float
    rounding either way."""
    rm = RewardModel.from_base(_classifier_base(tmp_path, kind), seed=0)
    pairs = sevens(6, seed=3)
    prompts = [p["prompt"] for p in pairs]
    completions = [p["chosen"] + p["rejected"] * (i % 3) for i, p in enumerate(pairs)]  # mixed lengths
    got = rm.scores(prompts, completions)
    if kind in ("llama", "qwen2"):
        assert rm._packs is True
    assert got.std() > 1e-3
    assert_close_scaled(got, _padded_scores(rm, prompts, completions))

    def gradients(packs: bool) -> dict:
        rm._packs = packs
        rm.model.zero_grad(set_to_none=True)
        rewards = rm._forward(rm._encode(prompts * 2, [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]))
        bradley_terry_loss(rewards[:6], rewards[6:]).backward()
        return {n: p.grad.clone() for n, p in rm.model.named_parameters() if p.grad is not None}

    packs = rm._packs
    want, have = gradients(False), gradients(packs)
    assert want.keys() == have.keys()
    # Each to the whole model's gradient scale: a final norm's bias before a head that reads one
    # token has a gradient that cancels to rounding, whose scale is the others'.
    assert_close_scaled(have, want, BACKWARD, scale=scale_of(*want.values()))


@pytest.mark.parametrize("bug,kind", [("positions", "gpt2"), ("attention", "llama"), ("pooled", "llama")])
def test_a_packed_layout_that_moves_the_scores_is_not_taken(tmp_path, monkeypatch, bug, kind):
    """Each planted packing bug (positions that do not restart, shown where positions are
    absolute; attention across texts; the head reading the slot after the pooled one) moves
    the packed scores far from the padded ones; the probe then refuses the layout and the
    scores stay the padded pass's."""
    from grpo.infra import packing

    real = packing.pack_sequences

    def broken(input_ids, attention_mask):
        packed = real(input_ids, attention_mask)
        if bug == "positions":
            packed.position_ids = torch.arange(packed.position_ids.shape[1]).expand_as(packed.position_ids).clone()
        elif bug == "attention":  # every slot of a bin one unit
            packed.units = torch.zeros_like(packed.units)
        else:
            packed.index = (packed.index + 1).clamp(max=packed.input_ids.numel() - 1)
        return packed

    rm = RewardModel.from_base(_classifier_base(tmp_path, kind), seed=0)
    prompts, completions = ["ab ", "abcabc ", "c "], ["12", "0123456789" * 3, "7777"]
    want = _padded_scores(rm, prompts, completions)
    assert rm._packing_serves()  # without the bug, it packs
    monkeypatch.setattr(packing, "pack_sequences", broken)
    rm._packs = True
    assert (rm.scores(prompts, completions) - want).abs().max() > 1e-3  # the bug shows
    rm._packs = None
    assert_close_scaled(rm.scores(prompts, completions), want)
    assert rm._packs is False


def test_padding_is_on_the_right_for_models_with_absolute_positions(tmp_path):
    # Llama's rotary embeddings are relative, so even left padding would not move its scores;
    # GPT-2 adds absolute position embeddings, which left padding would shift.
    from transformers import GPT2Config, GPT2LMHeadModel

    from grpo.tasks.tiny import char_tokenizer

    tokenizer = char_tokenizer(ALPHABET)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    rm = RewardModel.from_base(str(tmp_path / "gpt2"))
    alone = rm.scores(["ab "], ["12"])
    padded = rm.scores(["ab ", "abcabc "], ["12", "0123456789" * 4])
    assert_close_scaled(padded[:1], alone)


@pytest.mark.parametrize("config_pad", [None, 0])
def test_pad_token_falls_back_to_eos_and_the_head_reads_past_padding(tmp_path, config_pad):
    # The head pools at the rightmost token whose id is not config.pad_token_id. A tokenizer
    # without a pad token pads with EOS; a config still naming another pad id (0 here) would
    # make the head read a padding position, and no pad id at all fails on batches > 1.
    from transformers import AutoTokenizer

    directory = save_tiny_model(tmp_path / "no_pad", ALPHABET)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["pad_token_id"] = config_pad
    (directory / "config.json").write_text(json.dumps(config))

    rm = RewardModel.from_base(str(directory))
    eos = rm.tokenizer.eos_token_id
    assert rm.tokenizer.pad_token_id == rm.model.config.pad_token_id == eos
    alone = rm.scores(["ab "], ["12"])
    padded = rm.scores(["ab ", "abcabc "], ["12", "0123456789" * 5])
    assert_close_scaled(padded[:1], alone)


def test_truncation_keeps_the_end_of_the_text(trained):
    short = trained.max_length
    try:
        trained.max_length = 6
        same_end = trained.scores(["a ", "bbbbbbbb "], ["0123456"] * 2)
        other_end = trained.scores(["a "], ["0123457"])
    finally:
        trained.max_length = short
    # Only the last 6 tokens are read: the same score, to float rounding (the two texts are
    # two rows of one pass, which a CPU's matmul kernels may round differently), where another
    # last token moves it by far more.
    assert gap(same_end[0], same_end[1]) <= FORWARD
    assert abs(float(same_end[0] - other_end[0])) > 1e-3


def test_score_steps_equals_scores_of_the_prefixes(trained):
    prompts, completions = ["ab ", "c "], ["1270", "90 7"]
    ends = [[1, 2, 4], [0, 4]]
    got = trained.score_steps(prompts, completions, ends)
    expected = trained.scores(["ab "] * 3 + ["c "] * 2, ["1", "12", "1270", "", "90 7"]).tolist()
    assert [len(steps) for steps in got] == [3, 2]
    assert_close_scaled(torch.tensor(got[0] + got[1]), torch.tensor(expected))
    with pytest.raises(ValueError, match="step end 5"):
        trained.score_steps(["ab "], ["1270"], [[5]])
    with pytest.raises(UserError, match="empty text"):  # no token for the head to read
        trained.score_steps([""], ["1270"], [[0]])


def test_reward_model_is_a_reward_function(trained):
    prompts, completions = ["ab ", "ab ", "c "], ["17", "18", "7"]
    columns = {"answer": ["7", "7", "7"]}  # other data columns reach it and are ignored
    reward = WeightedReward(name="rm", fn=trained, weight=1.0)
    got = score([reward], prompts, completions, columns)
    expected = trained.scores(prompts, completions)
    torch.testing.assert_close(got.per_function["rm"], expected)
    torch.testing.assert_close(got.total, expected)
    assert trained(prompts, completions, **columns) == pytest.approx(expected.tolist())


def test_chat_prompts_use_the_chat_template(base):
    rm = RewardModel.from_base(base)
    messages = [{"role": "user", "content": "ab"}]
    with pytest.raises(UserError, match="no chat template"):
        rm.text(messages, "12")
    rm.tokenizer.chat_template = "{% for m in messages %}{{ m['role'][0] }} {{ m['content'] }} {% endfor %}"
    assert rm.text(messages, "12") == "u ab a 12 "  # the completion is the assistant's turn
    assert rm.text("ab ", "12") == "ab 12"
    assert rm.scores([messages], ["12"]).shape == (1,)


def test_evaluate_counts_ties_as_half(trained):
    pairs = [{"prompt": "ab ", "chosen": "17", "rejected": "17"}] * 3
    assert trained.evaluate(pairs) == {"accuracy": 0.5, "margin": 0.0, "pairs": 3}
    swapped = [{"prompt": p["prompt"], "chosen": p["rejected"], "rejected": p["chosen"]} for p in sevens(20, 9)]
    result = trained.evaluate(sevens(20, 9))
    assert trained.evaluate(swapped)["accuracy"] == pytest.approx(1 - result["accuracy"])
    assert trained.evaluate(swapped)["margin"] == pytest.approx(-result["margin"])


# ---- comparison data --------------------------------------------------------------------------


def test_load_pairs_reads_rows_and_names_the_bad_one(tmp_path):
    good = sevens(3, seed=10)
    assert load_pairs(str(write_jsonl(tmp_path / "good.jsonl", good))) == good
    cases = {
        "missing": ([*good[:2], {"prompt": "a", "chosen": "1"}], "row 3 has no 'rejected'"),
        "number": ([good[0], {**good[1], "chosen": 7}], "row 2: 'chosen' must be a string, got int"),
        "few": (good[:1], "has 1 comparison; a reward model needs at least 2"),
        "prompt": ([{"chosen": "1", "rejected": "2"}] * 2, "no column 'prompt'"),
    }
    for name, (rows, message) in cases.items():
        with pytest.raises(UserError, match=message) as info:
            load_pairs(str(write_jsonl(tmp_path / f"{name}.jsonl", rows)))
        assert "\n" not in str(info.value)


def test_split_pairs_is_seeded_and_disjoint():
    pairs = [{"prompt": str(i), "chosen": "1", "rejected": "2"} for i in range(10)]
    train, held_out = split_pairs(pairs, 0.3, seed=1)
    assert len(held_out) == 3 and len(train) == 7
    assert sorted(p["prompt"] for p in train + held_out) == sorted(p["prompt"] for p in pairs)
    assert split_pairs(pairs, 0.3, seed=1) == (train, held_out)
    assert split_pairs(pairs, 0.3, seed=2) != (train, held_out)
    assert len(split_pairs(pairs[:2], 0.01)[1]) == 1  # a positive fraction holds out at least one
    assert split_pairs(pairs, 0.0)[1] == []


# ---- the command line -------------------------------------------------------------------------


def last_json(text):
    return json.loads(text.strip().splitlines()[-1])


def test_cli_trains_then_evaluates(base, tmp_path, capsys):
    data = str(write_jsonl(tmp_path / "pairs.jsonl", sevens(200, seed=11)))
    out = str(tmp_path / "rm")
    args = [
        "rm",
        "train",
        "--model",
        base,
        "--data",
        data,
        "--output",
        out,
        "--lr",
        "1e-3",
        "--epochs",
        "2",
        "--eval-fraction",
        "0.2",
        "--quiet",
    ]
    assert main(args) == 0
    trained = last_json(capsys.readouterr().out)
    assert trained["output"] == out
    assert (trained["pairs"], trained["train_pairs"]) == (40, 160)
    assert trained["accuracy"] >= 0.9

    assert main(["rm", "eval", "--model", out, "--data", data]) == 0
    evaluated = last_json(capsys.readouterr().out)
    assert evaluated["pairs"] == 200
    assert evaluated["accuracy"] >= 0.9 and evaluated["margin"] > 0

    # A second run into the same directory is refused before anything trains ...
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpo: error:") and "--overwrite" in err and "\n" not in err
    # ... unless asked for.
    assert main([*args, "--overwrite", "--epochs", "1"]) == 0
    assert last_json(capsys.readouterr().out)["output"] == out


def test_cli_log_every_sets_the_lines(base, tmp_path, capsys):
    data = str(write_jsonl(tmp_path / "pairs.jsonl", sevens(20, seed=11)))
    assert (
        main(
            [
                "rm",
                "train",
                "--model",
                base,
                "--data",
                data,
                "--output",
                str(tmp_path / "rm"),
                "--batch-size",
                "2",
                "--eval-fraction",
                "0",
                "--log-every",
                "4",
            ]
        )
        == 0
    )
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("grpo rm train: ")]
    assert [line.split()[4] for line in lines] == ["1/10", "4/10", "8/10", "10/10"]


def test_cli_missing_data_is_one_line(base, tmp_path, capsys):
    missing = str(tmp_path / "nope.jsonl")
    code = main(["rm", "train", "--model", base, "--data", missing, "--output", str(tmp_path / "rm"), "--quiet"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpo: error:") and missing in err and "\n" not in err
    assert not (tmp_path / "rm").exists()  # nothing written on failure
    assert main(["rm", "eval", "--model", base, "--data", missing]) == 2
    assert missing in capsys.readouterr().err


def test_cli_help_explains_reward_models(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["rm", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "one scalar score" in text and "comparisons" in text and "not the reward model" in text
    with pytest.raises(SystemExit):
        main(["rm", "train", "--help"])
    assert "--eval-fraction" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["rm", "train", "--model", "m", "--data", "d", "--output", "o", "--eval-fraction", "1.5"])
    assert stop.value.code == 2
