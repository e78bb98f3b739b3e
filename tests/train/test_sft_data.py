"""`grpo sft --model M --data FILE`: fine-tuning an existing model on the user's rows, on a
tiny Llama with a character tokenizer that adds a BOS, and a ChatML template whose end of turn
is the EOS (as Qwen's instruct models have it)."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file
from tokenizers.processors import TemplateProcessing
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo
from grpo.cli import main
from grpo.rollout import Sampler
from grpo.tasks.tiny import char_tokenizer, tiny_llama
from grpo.train import sft as sft_module
from grpo.train.sft import (
    IGNORE_INDEX,
    FineTuneConfig,
    completion_batch,
    completion_loss,
    conversation_pieces,
    encode_pieces,
    sft,
)

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +=?\n"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
POSITIONS = 96


def chat_tokenizer():
    """One token per character, <s> before every encoded text, ChatML with <|im_end|> as EOS."""
    tok = char_tokenizer(ALPHABET)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    tok.chat_template = CHATML
    return tok


TOK = chat_tokenizer()


def user(text):
    return [{"role": "user", "content": text}]


def sums(n, seed):
    """Rows "add a and b" -> the sum, the prompts as chat messages."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": user(f"add {a} and {b}"), "completion": str(a + b)})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny model and its tokenizer, saved as a Hugging Face directory."""
    directory = tmp_path_factory.mktemp("chat-model")
    tiny_llama(TOK, hidden_size=32, layers=1, heads=2, max_positions=POSITIONS).save_pretrained(directory)
    TOK.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "sums.jsonl", sums(32, seed=0))


def mean_loss(model_dir, rows):
    """The mean next-token loss of the rows' completions (and EOS) under the saved model."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = completion_batch(tok, [r["prompt"] for r in rows], [r["completion"] for r in rows])
    with torch.no_grad():
        return completion_loss(
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"]
        ).item()


def run(argv, capsys):
    """`grpo ARGV` in this process: (exit status, stdout, stderr)."""
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# ---- what is learned ---------------------------------------------------------------------------


def test_only_the_completion_and_its_eos_are_learned():
    prompts, completions = [user("add 1 and 2"), "add 30 and 4 ="], ["3", "34"]
    batch = completion_batch(TOK, prompts, completions)
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        chat = isinstance(prompt, list)  # the template's own special tokens only, as apply_chat_template tokenizes
        context = TOK(
            TOK.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False) if chat else prompt,
            add_special_tokens=not chat,
        )["input_ids"]
        target = [*TOK(completion, add_special_tokens=False)["input_ids"], TOK.eos_token_id]
        length = len(context) + len(target)
        assert ids[row, :length].tolist() == context + target
        assert labels[row, :length].tolist() == [IGNORE_INDEX] * len(context) + target
        assert (labels[row, length:] == IGNORE_INDEX).all() and (ids[row, length:] == TOK.pad_token_id).all()
        assert mask[row].tolist() == [1] * length + [0] * (ids.shape[1] - length)


def test_a_chat_prompt_is_encoded_exactly_as_the_sampler_encodes_it(base):
    """The context sft trains on is, token for token, what `grpo train` samples from: the chat
    template with its generation prompt and only the special tokens it writes (a plain prompt:
    the tokenizer's <s>)."""
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    rows = [
        {"prompt": user("add 2 and 5")},
        {"prompt": [{"role": "system", "content": "be brief"}, *user("add 13 and 4")]},
        {"prompt": "plain 9 + 9 ="},
    ]
    rollout = Sampler(TOK, prompt_column="prompt", group_size=1, max_new_tokens=2, backend="hf").sample(model, rows)
    p_len = rollout.input_ids.shape[1] - rollout.completion_mask.shape[1]
    batch = completion_batch(TOK, [r["prompt"] for r in rows], ["x"] * len(rows))
    assert TOK.decode(batch["input_ids"][0, :30]) == "<|im_start|>user\nadd 2 and 5<|im_end|>\n<|im_start|>assistant\n"
    assert TOK.decode(batch["input_ids"][2, :14]) == "<s>plain 9 + 9 ="
    for row in range(len(rows)):
        sampled = rollout.input_ids[row, :p_len][rollout.attention_mask[row, :p_len].bool()].tolist()
        learned_from = batch["input_ids"][row][batch["labels"][row] == IGNORE_INDEX][: len(sampled)].tolist()
        assert learned_from == sampled
        assert batch["labels"][row, len(sampled)] == TOK("x", add_special_tokens=False)["input_ids"][0]


def test_every_assistant_message_of_a_conversation_is_learned():
    messages = [
        {"role": "system", "content": "sums"},
        *user("add 1 and 2"),
        {"role": "assistant", "content": "3"},
        *user("and 4 more"),
        {"role": "assistant", "content": "7"},
    ]
    pieces, all_turns = conversation_pieces(TOK, messages)
    assert all_turns
    ids, labels = encode_pieces(TOK, pieces)
    # The sequence is the template's rendering of the whole conversation (the last turn ends at its EOS).
    rendered = TOK.apply_chat_template(messages, tokenize=False)
    assert ids == TOK(rendered.removesuffix("\n"))["input_ids"]
    assert ids.count(TOK.bos_token_id) == 1
    learned = [TOK.decode([i]) if label != IGNORE_INDEX else "." for i, label in zip(ids, labels)]
    assert [t for t in learned if t != "."] == ["3", "<|im_end|>", "7", "<|im_end|>"]
    # Each learned message is predicted from the conversation before it, rendered as the sampler would.
    for content, before in (("3", messages[:2]), ("7", messages[:4])):
        context = TOK(TOK.apply_chat_template(before, add_generation_prompt=True, tokenize=False))["input_ids"]
        at = len(context)
        assert ids[:at] == context and labels[at] != IGNORE_INDEX and TOK.decode([ids[at]]) == content


def test_a_template_that_rewrites_earlier_turns_learns_the_last_message_only():
    """A template that drops earlier assistant messages (as reasoning templates drop old
    thoughts) does not render a conversation as its prefixes: the last message is learned,
    from the context the sampler would give it."""
    tok = chat_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = [
        *user("add 1 and 2"),
        {"role": "assistant", "content": "3"},
        *user("and 4"),
        {"role": "assistant", "content": "7"},
    ]
    pieces, all_turns = conversation_pieces(tok, messages)
    assert not all_turns
    assert pieces == [
        (tok.apply_chat_template(messages[:3], add_generation_prompt=True, tokenize=False), False),
        ("7", True),
    ]


# ---- training ---------------------------------------------------------------------------------


def test_fine_tuning_raises_the_likelihood_of_the_completions(base, data, tmp_path, capsys):
    rows = sums(32, seed=0)
    status, out, _ = run(
        [
            "sft",
            "--model",
            base,
            "--data",
            data,
            "--output",
            str(tmp_path / "o"),
            "--lr",
            "1e-2",
            "--epochs",
            "8",
            "--quiet",
        ],
        capsys,
    )
    assert status == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["rows"] == 32 and summary["steps"] == 8 * 4 and summary["epochs"] == 8
    assert summary["loss/last"] < 0.5 * summary["loss/first"], summary
    before, after = mean_loss(base, rows), mean_loss(tmp_path / "o", rows)
    assert after < 0.5 * before, (before, after)
    saved = json.loads((tmp_path / "o" / "sft_config.json").read_text())
    assert (saved["model"], saved["data"], saved["lr"], saved["shape"], saved["rows"]) == (
        base,
        data,
        1e-2,
        "prompt",
        32,
    )
    assert AutoTokenizer.from_pretrained(tmp_path / "o").chat_template == CHATML


def test_grpo_sft_packs_by_default_learns_and_padded_is_one_flag_away(base, data, tmp_path, capsys, monkeypatch):
    """`grpo sft --model` on chat rows of several lengths: by default every batch goes packed (a
    Llama: the probe serves) and the completions are learned; `--layout padded` never packs,
    and the two runs end at the same loss to float rounding of 30 updates."""
    calls = []
    real = sft_module.packed_batch
    monkeypatch.setattr(sft_module, "packed_batch", lambda model, batch: calls.append(1) or real(model, batch))
    summaries = {}
    for layout in ("auto", "padded"):
        calls.clear()
        argv = ["sft", "--model", base, "--data", data, "--output", str(tmp_path / layout), "--lr", "1e-2"]
        status, out, _ = run(
            [*argv, "--epochs", "8", "--quiet"] + ([] if layout == "auto" else ["--layout", layout]), capsys
        )
        assert status == 0
        summaries[layout] = json.loads(out.strip().splitlines()[-1])
        assert len(calls) == (summaries[layout]["steps"] if layout == "auto" else 0)
    for layout, summary in summaries.items():
        assert summary["loss/last"] < 0.5 * summary["loss/first"], (layout, summary)
    assert summaries["auto"]["loss/first"] == pytest.approx(summaries["padded"]["loss/first"], rel=1e-5)
    assert summaries["auto"]["loss/last"] == pytest.approx(summaries["padded"]["loss/last"], rel=1e-2)


def test_lora_trains_an_adapter_and_saves_it_merged(base, data, tmp_path, capsys):
    status, out, _ = run(
        [
            "sft",
            "--model",
            base,
            "--data",
            data,
            "--output",
            str(tmp_path / "o"),
            "--lr",
            "3e-2",
            "--steps",
            "24",
            "--lora-r",
            "8",
            "--quiet",
        ],
        capsys,
    )
    assert status == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert 0 < summary["trainable_parameters"] < summary["parameters"] / 2
    weights, start = load_file(tmp_path / "o" / "model.safetensors"), load_file(f"{base}/model.safetensors")
    assert weights.keys() == start.keys()  # a plain model: no adapter keys, no peft needed to load it
    moved = {key for key in weights if not torch.equal(weights[key], start[key])}
    # The adapter merged into the linear layers it adapted ("all-linear": not the output head).
    assert moved and all(key.endswith("proj.weight") for key in moved), moved
    assert mean_loss(tmp_path / "o", sums(32, seed=0)) < mean_loss(base, sums(32, seed=0)) - 0.1


def test_same_seed_same_weights_and_global_random_state_untouched(base, data, tmp_path):
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    runs = {}
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        config = FineTuneConfig(model=base, data=data, steps=3, batch_size=4, lr=1e-2, lora_r=2, seed=seed)
        sft(tmp_path / name, config, progress=False)
        runs[name] = load_file(tmp_path / name / "model.safetensors")
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state
    assert all(torch.equal(runs["a"][k], runs["b"][k]) for k in runs["a"])
    assert any(not torch.equal(runs["a"][k], runs["c"][k]) for k in runs["a"])


def test_conversations_are_found_without_options_and_learned(base, tmp_path, capsys):
    rows = [{"messages": [*r["prompt"], {"role": "assistant", "content": r["completion"]}]} for r in sums(16, seed=1)]
    path = write_jsonl(tmp_path / "chats.jsonl", rows)
    status, out, err = run(
        [
            "sft",
            "--model",
            base,
            "--data",
            path,
            "--output",
            str(tmp_path / "o"),
            "--lr",
            "1e-2",
            "--steps",
            "16",
            "--quiet",
        ],
        capsys,
    )
    assert status == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["loss/last"] < 0.5 * summary["loss/first"]
    assert json.loads((tmp_path / "o" / "sft_config.json").read_text())["shape"] == "messages"
    assert "warning" not in err


def test_trl_conversational_completions_are_learned_as_their_text(base, tmp_path, capsys):
    rows = [
        {"prompt": r["prompt"], "completion": [{"role": "assistant", "content": r["completion"]}]}
        for r in sums(4, seed=4)
    ]
    status, out, err = run(
        [
            "sft",
            "--model",
            base,
            "--data",
            write_jsonl(tmp_path / "trl.jsonl", rows),
            "--output",
            str(tmp_path / "o"),
            "--steps",
            "1",
            "--quiet",
        ],
        capsys,
    )
    assert status == 0, err
    as_text = [{"prompt": r["prompt"], "completion": r["completion"][0]["content"]} for r in rows]
    assert json.loads(out.strip().splitlines()[-1])["loss/first"] == pytest.approx(mean_loss(base, as_text), rel=1e-5)


@pytest.mark.parametrize("lora", [[], ["--lora-r", "4"]], ids=["full", "lora"])
def test_grpo_train_starts_from_the_output(base, data, tmp_path, capsys, make_config, lora):
    """Done when: `grpo sft --model M --data D --output O`, then `grpo train` with model O."""
    out = tmp_path / "warm"
    status, _, err = run(
        ["sft", "--model", base, "--data", data, "--output", str(out), "--steps", "2", "--quiet", *lora], capsys
    )
    assert status == 0, err
    config = make_config(
        model=str(out),
        data={"path": data},
        train={"steps": 2, "lr": 1e-3},
        rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 4, "min_new_tokens": 0},
    )
    result = grpo.train(config, progress=False)
    assert len(result.metrics) == 2 and (result.final_dir / "model.safetensors").exists()


def test_long_rows_are_cut_to_their_last_tokens_with_a_warning(base, tmp_path, capsys):
    rows = [{"prompt": "x " * 60 + "add 1 and 2", "completion": "3"}, *sums(3, seed=2)]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    argv = ["sft", "--model", base, "--data", path, "--output", str(tmp_path / "o"), "--steps", "1", "--quiet"]
    status, _, err = run(argv, capsys)
    assert status == 2 and err.count("\n") == 1
    assert f"{path} row 1: 134 tokens, more than the model's {POSITIONS} positions" in err and "--max-length" in err

    status, out, err = run([*argv, "--max-length", "40"], capsys)
    assert status == 0
    assert "warning: 1 of 4 rows are longer than --max-length 40 tokens" in err
    assert json.loads(out.strip().splitlines()[-1])["truncated"] == 1

    status, _, err = run([*argv, "--max-length", str(POSITIONS + 1), "--overwrite"], capsys)
    assert status == 2 and f"--max-length: {POSITIONS + 1} is more than the model's {POSITIONS} positions" in err

    path = write_jsonl(
        tmp_path / "long_answer.jsonl", [*sums(2, seed=3), {"prompt": "add 1 and 2", "completion": "3" * 10}]
    )
    status, _, err = run([*argv[:4], path, *argv[5:], "--max-length", "8", "--overwrite"], capsys)
    assert status == 2 and err.count("\n") == 1
    assert f"{path} row 3: its completion and EOS alone are 11 tokens, too many for --max-length 8" in err


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "M", "--task", "arithmetic", "--data", "D"], "--model and --task exclude each other"),
        (["--data", "D"], "--data needs --model"),
        (["--model", "M"], "--model needs --data"),
        (["--model", "M", "--data", "D", "--hidden", "32"], "--hidden: options of --task"),
        (["--epochs", "2"], "--epochs: fine-tuning options"),
        (["--lora-r", "4", "--task", "arithmetic"], "--lora-r: fine-tuning options"),
        (["--model", "M", "--data", "D", "--lora-r", "-1"], "lora_r must be >= 0"),
    ],
)
def test_mixed_modes_are_one_line(argv, words, tmp_path, capsys):
    status, _, err = run(["sft", "--output", str(tmp_path / "o"), *argv], capsys)
    assert status == 2 and words in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "rows, words",
    [
        ([{"prompt": "add 1 and 2", "answer": "3"}], "row 1: no column 'completion' (columns: prompt, answer)"),
        (
            [{"prompt": "add 1 and 2", "completion": "3"}, {"prompt": "add 2 and 2", "completion": "  "}],
            "row 2: empty completion",
        ),
        ([{"prompt": "add 1 and 2", "completion": None}], "row 1: 'completion' must be a string"),
        ([{"question": "add 1 and 2", "completion": "3"}], "--prompt-column: no column 'prompt'"),
        ([{"messages": user("add 1 and 2")}], "row 1: no assistant message"),
        (
            [{"messages": [*user("hi"), {"role": "assistant", "content": ""}]}],
            "row 1: message 2 (the assistant's) is empty",
        ),
    ],
)
def test_bad_rows_are_one_line_naming_the_row(rows, words, base, tmp_path, capsys):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    status, _, err = run(["sft", "--model", base, "--data", path, "--output", str(tmp_path / "o"), "--quiet"], capsys)
    assert status == 2 and words in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_a_missing_file_and_a_missing_model_are_one_line(base, data, tmp_path, capsys):
    status, _, err = run(
        ["sft", "--model", base, "--data", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "o")], capsys
    )
    assert status == 2 and err.startswith("grpo: error: --data: no such file") and err.count("\n") == 1
    status, _, err = run(
        ["sft", "--model", str(tmp_path / "nothing"), "--data", data, "--output", str(tmp_path / "o")], capsys
    )
    assert status == 2 and err.startswith("grpo: error: --model: no such directory") and err.count("\n") == 1
    status, _, err = run(
        ["sft", "--model", base, "--data", data, "--output", str(tmp_path / "o"), "--device", "tpu"], capsys
    )
    assert status == 2 and "--device: unknown device 'tpu'" in err and err.count("\n") == 1
