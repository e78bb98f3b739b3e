"""rollout.draw: fast draws each token from the distribution `generate`'s draw uses
(other tokens, the same probabilities), one uniform per row, independently of which rows
have finished; it is the fast loop's only, and refused elsewhere in one line."""

import pytest
import torch

import grpo
from grpo.config import config_from_dict
from grpo.errors import UserError
from grpo.rollout import Sampler, fast
from grpo.train.layouts import policy_logprobs
from grpo.train.preflight import check_sampler
from tests.helpers import assert_close_scaled
from tests.rollout.test_fast import EOS, ROWS, TOKENIZER, model_of


def within(counts: torch.Tensor, probs: torch.Tensor, n: int, sigmas: float = 5.0) -> bool:
    """Each count within `sigmas` binomial standard deviations of n * p."""
    expected = n * probs
    sd = (n * probs * (1 - probs)).sqrt().clamp_min(1.0)
    return bool(((counts - expected).abs() <= sigmas * sd).all())


def test_each_token_is_drawn_with_its_probability_and_never_one_of_probability_zero():
    # Unnormalised rows (the draw divides by each row's own total), zeros inside and at the end.
    weights = torch.tensor([3.0, 0.0, 1.0, 0.5, 0.0, 6.0, 0.0, 0.0])
    n = 40_000
    scale = torch.rand(n, 1, generator=torch.Generator().manual_seed(1)) * 5 + 0.1
    probs = weights * scale
    g = torch.Generator().manual_seed(2)
    tokens = fast.draws._inverse_cdf_draw(probs, torch.arange(n), [(0, n, g)])
    counts = torch.bincount(tokens, minlength=len(weights)).double()
    assert counts[weights == 0].sum() == 0
    assert within(counts, (weights / weights.sum()).double(), n), counts.tolist()


def plain_lookup(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The plain inverse CDF: one float64 running sum over the whole vocabulary."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)


@pytest.mark.slow
def test_the_two_level_lookup_is_the_plain_inverse_cdf(monkeypatch):
    """The blocked lookup finds the token one running sum over the vocabulary finds, for the
    same uniforms (up to the rounding of the two sums): on random distributions, and where a float32 sum would lose the tail (a
    token of probability 1 then 150,000 of 1e-9: 1 + 1e-9 is 1 in float32)."""
    vocab = 150_001
    peaked = torch.full((1, vocab), 1e-9)
    peaked[0, 0] = 1.0
    spread = torch.softmax(torch.randn(6, vocab, generator=torch.Generator().manual_seed(4)) * 4, -1)
    for probs in (peaked.expand(400, vocab), spread.repeat(60, 1)):
        n = probs.shape[0]
        u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
        if probs is not spread:  # most uniforms in the tail's share, 1.5e-4 of the mass
            u = 1 - u * 3e-4
        monkeypatch.setattr(torch, "rand", lambda *a, **k: u)
        got = fast.draws._inverse_cdf_draw(probs, torch.arange(n), [(0, n, None)])
        monkeypatch.undo()
        # Equal, but where u * total lies within the two sums' float64 rounding of a boundary
        # (the running sum's error grows with the vocabulary, ~1e-11 here, 1% of a 1e-9 token).
        off = (got - plain_lookup(probs, u)).abs()
        assert int(off.max()) <= 1 and float((off > 0).double().mean()) <= 0.02
        assert len(set(got.tolist())) > 20  # many distinct tokens drawn, in the tail too


def test_rows_draw_their_own_uniform_whichever_rows_have_finished():
    n, vocab = 12, 1000
    probs = torch.softmax(torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 2, -1)
    full_g = torch.Generator().manual_seed(5)
    everyone = fast.draws._inverse_cdf_draw(probs, torch.arange(n), [(0, n, full_g)])
    assert len(set(everyone.tolist())) > n // 2  # rows do not share one uniform
    for rows in ([0], [n - 1], [2, 3, 4, 9], [1, 5, 6, 7, 11]):
        g = torch.Generator().manual_seed(5)
        rows = torch.tensor(rows)
        got = fast.draws._inverse_cdf_draw(probs[rows], rows, [(0, n, g)])
        assert torch.equal(got, everyone[rows])
        assert torch.equal(g.get_state(), full_g.get_state())  # one uniform per row, finished or not


def test_each_prompt_draws_from_its_own_generator():
    n, vocab = 8, 500
    probs = torch.softmax(torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 2, -1)
    segments = [(0, 3, torch.Generator().manual_seed(7)), (3, 8, torch.Generator().manual_seed(8))]
    together = fast.draws._inverse_cdf_draw(probs, torch.arange(n), segments)
    second = fast.draws._inverse_cdf_draw(probs[3:], torch.arange(5), [(0, 5, torch.Generator().manual_seed(8))])
    assert torch.equal(together[3:], second)


def test_bad_distributions_are_refused_as_multinomial_refuses_them():
    with pytest.raises(RuntimeError, match="nan"):
        fast.draws._inverse_cdf_draw(torch.full((2, 5), float("nan")), torch.arange(2), [(0, 2, None)])
    with pytest.raises(RuntimeError, match="sum"):
        fast.draws._inverse_cdf_draw(torch.zeros(2, 5), torch.arange(2), [(0, 2, None)])


def sampler(draw, **options):
    return Sampler(
        TOKENIZER, prompt_column="prompt", backend="fast", max_new_tokens=options.pop("max_new_tokens", 12),
        draw=draw, **options,
    )  # fmt: skip


def test_the_fast_loop_draws_from_the_models_distribution():
    """The first token of 4,000 completions of one prompt, against the model's softmax at the
    temperature; and the sampler's log-probs are those of the tokens it drew."""
    model = model_of()
    n, temperature = 4000, 1.3
    s = sampler("fast", group_size=n, max_new_tokens=1, temperature=temperature)
    rollout = s.sample(model, [ROWS[2]], generator=torch.Generator().manual_seed(4))
    first = rollout.completion_ids[:, 0]
    prompt = TOKENIZER(ROWS[2]["prompt"], return_tensors="pt")
    with torch.no_grad():
        probs = torch.softmax(model(**prompt).logits[0, -1] / temperature, -1).double()
    counts = torch.bincount(first, minlength=len(probs)).double()
    assert within(counts, probs, n), (counts.tolist(), (n * probs).tolist())
    assert_close_scaled(rollout.sampled_logprobs[:, 0], probs.log()[first].float())


@pytest.mark.numerics
@pytest.mark.parametrize("bias", [False, True])
def test_the_few_rows_layout_is_f_linear(bias):
    weight = torch.randn(3000, 48)
    b = torch.randn(3000) if bias else None
    for shape in (
        (1, 48),
        (2, 48),
        (5, 48),
        (fast.forward.FEW_ROWS - 1, 48),
        (3, 1, 48),
        (2, 3, 48),
        (fast.forward.FEW_ROWS, 48),
        (20, 48),
    ):
        x = torch.randn(shape)
        got = fast.forward._linear(x, weight, b, few_rows_layout=True)
        assert got.shape == (*shape[:-1], 3000) and got.is_contiguous()
        assert_close_scaled(got, torch.nn.functional.linear(x, weight, b))
        assert torch.equal(
            fast.forward._linear(x, weight, b, few_rows_layout=False), torch.nn.functional.linear(x, weight, b)
        )


@pytest.mark.numerics
def test_the_log_probs_are_the_policys_with_few_rows(monkeypatch):
    """Eight rows (under FEW_ROWS after the prefill), the matmuls in their few-rows layout: the
    sampler's log-probs of the tokens it drew are the ones the loss computes."""
    model = model_of(eos_bias=0.5)
    calls, linear = [], fast.forward._linear
    monkeypatch.setattr(
        fast.forward, "_linear", lambda x, *a: calls.append((x.numel() // x.shape[-1], a[-1])) or linear(x, *a)
    )
    rollout = sampler("fast", group_size=2, temperature=0.8).sample(
        model, ROWS, generator=torch.Generator().manual_seed(3)
    )
    assert calls and all(layout for _, layout in calls)  # every matmul of the loop is offered the layout
    assert sum(rows < fast.forward.FEW_ROWS for rows, _ in calls) > len(calls) // 2  # and most take it
    with torch.no_grad():
        scored = policy_logprobs(model, rollout, 0.8)
    valid = rollout.completion_mask.bool()
    assert_close_scaled(rollout.sampled_logprobs[valid], scored[valid])
    assert (rollout.completion_ids == EOS).any() and valid.sum() > 3 * len(rollout.completions)


def test_the_option_changes_the_draw_not_its_reproducibility():
    model = model_of()
    a, b, generated = (
        sampler(draw, group_size=4, temperature=1.2).sample(model, ROWS, generator=torch.Generator().manual_seed(9))
        for draw in ("fast", "fast", "generate")
    )
    assert a.completions == b.completions  # the same seed, the same tokens
    assert a.completions != generated.completions  # another draw than generate's
    assert len(set(a.completions)) > len(ROWS)


def test_only_the_fast_loop_draws_this_way(tmp_path, tiny_model):
    config = {"model": tiny_model, "output_dir": str(tmp_path / "run"), "data": {"path": "x.jsonl"}}
    config["rewards"] = [{"function": "tests.train.rewards_for_tests:sevens"}]
    for sampler_name in ("hf", "vllm"):
        with pytest.raises(UserError, match="rollout.draw: fast is the fast loop's draw"):
            check_sampler(config_from_dict({**config, "rollout": {"draw": "fast", "sampler": sampler_name}}))
    # generate's bits: generate draws them itself, vLLM cannot.
    with pytest.raises(UserError, match="rollout.draw: generate is the fast loop's draw; rollout.sampler: vllm"):
        check_sampler(config_from_dict({**config, "rollout": {"draw": "generate", "sampler": "vllm"}}))
    c = config_from_dict({**config, "rollout": {"draw": "generate", "sampler": "hf"}})
    check_sampler(c)
    assert c.rollout.draw == "generate"
    for sampler_name in ("hf", "vllm", "fast", "auto"):  # the default: each sampler's own
        assert config_from_dict({**config, "rollout": {"sampler": sampler_name}}).rollout.draw == "auto"
    with pytest.raises(UserError, match="rollout.draw"):
        config_from_dict({**config, "rollout": {"draw": "uniform"}})
    # auto falls back to generate for a model the fast loop cannot decode: refused there, in one line.
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(TOKENIZER), n_embd=32, n_layer=1, n_head=2)).eval()
    auto = Sampler(TOKENIZER, prompt_column="prompt", group_size=2, max_new_tokens=4, draw="fast")
    with pytest.raises(UserError, match="set rollout.draw: auto"):
        auto.sample(gpt2, ROWS)
    # ... and draws generate's own way by default.
    assert Sampler(TOKENIZER, prompt_column="prompt", group_size=2, max_new_tokens=4).sample(gpt2, ROWS)


@pytest.mark.learning
def test_grpo_learns_with_the_fast_draw(make_config):
    from tests.train.test_learning import gain

    config = make_config(rollout={"draw": "fast"}, train={"steps": 40, "lr": 1e-3, "sample_every": 10})
    result = grpo.train(config, progress=False)
    assert gain(result.metrics) >= 0.25, [round(m["reward/mean"], 3) for m in result.metrics]
