"""Context limits: prompts cut to their last rollout.max_prompt_length tokens (counted after the
chat template and special tokens), and one-line errors where a prompt and its completion cannot
fit the model's positions."""

import copy

import pytest
import torch
from tokenizers.processors import TemplateProcessing
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, PretrainedConfig

from grpo.errors import UserError
from grpo.infra.hf import context_length
from grpo.rollout import Sampler, check_context
from grpo.tasks.tiny import char_tokenizer, tiny_llama

TOKENIZER = char_tokenizer("0123456789abcdefghijklmnopqrstuvwxyz :|")  # one token per character
G, NEW = 3, 6
# Mixed lengths (a left-padded batch): two longer than 10 tokens, one exactly 10, one shorter.
PROMPTS = ["abcdefghijklmnopqrstuvwxyz0123", "12 ab", "the quick brown fox", "0123456789"]
LLAMA = tiny_llama(TOKENIZER, hidden_size=32, max_positions=64).eval()


def gpt2(tokenizer=TOKENIZER, positions=32):
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=positions,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def sample(prompts, model=LLAMA, tokenizer=TOKENIZER, seed=0, **options):
    options = {"draw": "generate", **options}  # generate's tokens, whichever samples
    sampler = Sampler(tokenizer, prompt_column="prompt", group_size=G, max_new_tokens=NEW, **options)
    torch.manual_seed(seed)
    return sampler.sample(model, [{"prompt": p} for p in prompts])


def per_row(values):
    return [v for v in values for _ in range(G)]


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_long_prompts_keep_their_last_tokens(backend):
    cut = sample(PROMPTS, max_prompt_length=10, backend=backend)
    by_hand = sample([p[-10:] for p in PROMPTS], backend=backend)  # the same prompts, cut before sampling
    assert cut.input_ids.shape[1] == 10 + by_hand.completion_mask.shape[1]
    assert torch.equal(cut.input_ids, by_hand.input_ids)
    assert torch.equal(cut.attention_mask, by_hand.attention_mask)
    assert cut.completions == by_hand.completions
    assert cut.prompts == per_row([p[-10:] for p in PROMPTS])  # what the model saw
    assert cut.rows == per_row([{"prompt": p} for p in PROMPTS])  # the data keeps the whole prompt
    assert cut.prompt_truncated.tolist() == per_row([True, False, True, False])  # 10 tokens exactly is not cut
    assert cut.truncated_prompts == 2
    assert by_hand.truncated_prompts == 0
    # select keeps each row's flag: the last two groups (one cut prompt), then a minibatch of rows.
    assert cut.select(torch.arange(2 * G, 4 * G)).truncated_prompts == 1
    assert cut.select(torch.tensor([0, 4, 7])).prompt_truncated.tolist() == [True, False, True]


def test_special_tokens_count_toward_the_limit():
    """A tokenizer that adds <s>: 10 characters are 11 tokens, so cut (the <s> goes); 9 are not."""
    tokenizer = copy.deepcopy(TOKENIZER)
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    rollout = sample(["0123456789", "abcdefghi"], tokenizer=tokenizer, max_prompt_length=10)
    prompt_ids = rollout.input_ids[:, :10]
    assert prompt_ids[0].tolist() == tokenizer("0123456789", add_special_tokens=False)["input_ids"]
    assert prompt_ids[G].tolist() == tokenizer("abcdefghi")["input_ids"]  # <s> kept
    assert rollout.prompt_truncated.tolist() == per_row([True, False])
    assert rollout.prompts[0] == "0123456789"


def test_a_template_that_writes_the_bos_gets_it_once():
    """Llama 3's, Gemma's and Mistral's templates write the BOS their tokenizer also adds: a chat
    prompt is tokenized without the tokenizer's special tokens (as TRL does), a plain one with
    them, and a batch of both each its own way; the SFT examples as the sampler's prompts."""
    from grpo.train.sft_data import completion_batch

    tokenizer = copy.deepcopy(TOKENIZER)
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    bos = tokenizer.bos_token_id
    chat, plain = [{"role": "user", "content": "12 ab"}], "12 ab|"
    one_bos = [bos, *tokenizer("12 ab|", add_special_tokens=False)["input_ids"]]
    for prompts in ([chat, chat], [plain, plain], [chat, plain]):
        rollout = sample(prompts, tokenizer=tokenizer)
        for row in (0, G):
            assert rollout.input_ids[row, : len(one_bos)].tolist() == one_bos
    batch = completion_batch(tokenizer, [chat, plain], ["7", "7"])
    for row in range(2):
        assert batch["input_ids"][row, : len(one_bos)].tolist() == one_bos


def test_chat_prompts_are_cut_after_the_template():
    tokenizer = copy.deepcopy(TOKENIZER)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}|{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    texts = [f"u: {p}|a:" for p in PROMPTS]  # what the template makes of them
    cut = sample(chats, tokenizer=tokenizer, max_prompt_length=12)
    by_hand = sample([t[-12:] for t in texts], tokenizer=tokenizer)
    assert torch.equal(cut.input_ids, by_hand.input_ids)
    assert cut.prompts == per_row([t[-12:] for t in texts])  # ending in the generation prompt "|a:"
    assert cut.truncated_prompts == 3  # all but "12 ab" (11 tokens with the template)


def test_no_limit_samples_what_generate_samples():
    """max_prompt_length 0 (and a limit no prompt reaches) changes nothing: the same tokens as
    transformers' generate on the whole prompts, from the same seed."""
    unlimited = sample(PROMPTS, backend="hf")
    roomy = sample(PROMPTS, backend="hf", max_prompt_length=30)
    fast = sample(PROMPTS)
    tokenizer = copy.deepcopy(TOKENIZER)
    tokenizer.padding_side = "left"
    enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    torch.manual_seed(0)
    expected = LLAMA.generate(
        input_ids=enc["input_ids"].repeat_interleave(G, 0),
        attention_mask=enc["attention_mask"].repeat_interleave(G, 0),
        generation_config=GenerationConfig(
            do_sample=True,
            top_k=0,
            max_new_tokens=NEW,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        ),
    )
    assert torch.equal(unlimited.input_ids, expected)
    for rollout in (roomy, fast):
        assert torch.equal(rollout.input_ids, unlimited.input_ids)
        assert rollout.prompts == per_row(PROMPTS)
        assert rollout.truncated_prompts == 0
    assert len(set(unlimited.completions)) > len(PROMPTS)  # the samples are not all alike


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(max_position_embeddings=32, hidden_size=32, num_attention_heads=2),
        GPT2Config(n_positions=32, n_embd=32, n_head=2),
    ],
    ids=["llama", "gpt2"],
)
def test_check_context_says_which_numbers_do_not_fit(config):
    assert context_length(config) == 32
    check_context(config, 24, 8)  # fits exactly
    check_context(config, 0, 40)  # no limit: nothing to check up front (each sample is checked)
    with pytest.raises(UserError) as err:
        check_context(config, 25, 8)
    assert str(err.value) == (
        "rollout.max_prompt_length (25) + rollout.max_new_tokens (8) = 33 tokens exceed the model's 32 positions (lower either)"
    )
    with pytest.raises(
        UserError, match=r"^eval\.max_prompt_length \(1\) \+ eval\.max_new_tokens \(32\) = 33 tokens exceed"
    ):
        check_context(config, 1, 32, key="eval")


def test_context_length_reads_a_models_config_and_may_not_know():
    assert context_length(LLAMA) == 64
    assert context_length(gpt2(positions=24)) == 24
    assert context_length(PretrainedConfig()) is None
    check_context(PretrainedConfig(), 10_000, 10_000)  # nothing to check against


@pytest.mark.parametrize("model", [LLAMA, gpt2()], ids=["llama", "gpt2"])
def test_a_prompt_too_long_for_the_model_is_one_line_before_decoding(model):
    positions = context_length(model)
    prompt = "0123456789" * 7
    with pytest.raises(UserError) as err:
        sample(["ab", prompt[: positions - NEW + 1]], model=model)
    assert str(err.value) == (
        f"a prompt of {positions - NEW + 1} tokens + rollout.max_new_tokens ({NEW}) = {positions + 1} tokens exceed the "
        f"model's {positions} positions; set rollout.max_prompt_length (at most {positions - NEW}) to keep each prompt's last tokens"
    )
    sample(["ab", prompt[: positions - NEW]], model=model)  # the longest that fits
    with pytest.raises(
        UserError, match=r"^rollout\.max_prompt_length \(60\) \+ rollout\.max_new_tokens \(6\) = 66 tokens exceed"
    ):
        sample([prompt], model=model, max_prompt_length=60)  # a limit that does not fit either
    with pytest.raises(UserError, match=rf"; rollout\.max_new_tokens must be below {positions}$"):
        Sampler(TOKENIZER, prompt_column="prompt", group_size=G, max_new_tokens=positions).sample(
            model, [{"prompt": "ab"}]
        )


def test_gpt2_samples_prompts_longer_than_its_positions_once_cut():
    model = gpt2(positions=32)
    prompts = ["0123456789" * 4, "abc"]  # 40 tokens: past GPT-2's 32 positions
    rollout = sample(prompts, model=model, max_prompt_length=20, backend="hf")
    assert rollout.input_ids.shape[1] <= 20 + NEW <= 32
    assert rollout.prompts == per_row([prompts[0][-20:], "abc"])
    assert rollout.truncated_prompts == 1
    with torch.no_grad():  # the training forward pass over prompt + completion fits as well
        model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask, position_ids=rollout.position_ids)
