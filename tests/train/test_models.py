"""Sharing each prompt's pass among its G completions computes what one pass per row does."""

import pytest
import torch

from grpo.rollout import Sampler
from grpo.tasks.tiny import char_tokenizer
from grpo.train.layouts import completion_logits, prompt_groups
from tests.helpers import BACKWARD, assert_close_scaled, gap
from tests.rollout.test_fast import model_of

pytestmark = pytest.mark.numerics  # compares kernels: `make test` runs it with AVX2 kernels too

TOKENIZER = char_tokenizer("0123456789abc ")


def rollout(model, prompts, group_size=3, max_new_tokens=6, eos_bias=0.0):
    sampler = Sampler(TOKENIZER, prompt_column="prompt", group_size=group_size, max_new_tokens=max_new_tokens)
    torch.manual_seed(0)
    return sampler.sample(model, [{"prompt": p} for p in prompts])


@pytest.mark.parametrize("kind,kv_heads", [("llama", 4), ("llama", 2), ("qwen2", 2)])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_shared_prompt_pass_equals_full_rows_in_logits_and_gradients(kind, kv_heads, attention):
    model = model_of(kind, kv_heads, eos_bias=1.5)  # some rows end early: padding inside the completions
    model.set_attn_implementation(attention)
    batch = rollout(model, ["a", "bc1", "cab 7"])  # left-padded prompts of three lengths
    assert (batch.completion_mask == 0).any()
    first, group = prompt_groups(batch)
    assert first.tolist() == [0, 3, 6] and group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    weights = torch.randn(*batch.completion_mask.shape, len(TOKENIZER))
    results = {}
    for shared in (False, True):
        model.zero_grad()
        logits = completion_logits(model, batch, share_prompts=shared)
        ((logits * weights).sum(-1) * batch.completion_mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[shared] = (logits.detach(), grads)
    mask = batch.completion_mask.bool()
    assert_close_scaled(results[True][0][mask], results[False][0][mask])
    shared_grads, full_grads = results[True][1], results[False][1]
    # The same sums in another order: equal up to float32 rounding, relative to the gradient's size.
    assert_close_scaled(shared_grads, full_grads, BACKWARD)


def test_groups_split_by_a_micro_batch_and_lone_rows():
    model = model_of()
    batch = rollout(model, ["a", "bc1"], group_size=4)
    part = batch.select(torch.tensor([2, 3, 4]))  # the end of one group, the start of the next
    first, group = prompt_groups(part)
    assert first.tolist() == [0, 2] and group.tolist() == [0, 0, 1]
    with torch.no_grad():
        assert_close_scaled(completion_logits(model, part), completion_logits(model, part, share_prompts=False))
    assert prompt_groups(batch.select(torch.tensor([3, 4]))) is None  # nothing to share


def test_bf16_reference_copy_gives_what_autocast_gives_from_float32():
    """train.autocast: the reference's linear weights are stored in bf16, which is what autocast
    rounds them to before each matmul: the same log-probs, half the memory."""
    from grpo.train.models import autocast
    from grpo.train.layouts import policy_logprobs
    from grpo.train.networks import FrozenCopy

    model = model_of(eos_bias=1.5)
    batch = rollout(model, ["a", "bc1", "cab 7"])
    plain, stored = FrozenCopy(model), FrozenCopy(model, torch.bfloat16)
    assert stored.model.lm_head.weight.dtype == torch.bfloat16
    assert stored.model.model.embed_tokens.weight.dtype == torch.float32
    assert stored.model.model.norm.weight.dtype == torch.float32
    with autocast(model, torch.bfloat16):
        expected, got = plain.logprobs(batch, 1.0), stored.logprobs(batch, 1.0)
    assert torch.equal(got, expected)
    with torch.no_grad():
        exact = policy_logprobs(model, batch, 1.0)
    assert not torch.equal(got, exact)  # bf16 did change the numbers


def test_a_run_is_the_same_with_plain_passes_and_either_attention(make_config, tmp_path, monkeypatch):
    """Whole steps: shared prompt passes + eager attention (the defaults) against one pass per
    row with SDPA: the same rewards, losses, KL and gradient norms."""
    import grpo
    import grpo.train.layouts as layouts

    def run(name, attention):
        config = make_config(output_dir=str(tmp_path / name), train={"steps": 3, "lr": 1e-3, "attention": attention})
        return grpo.train(config, progress=False).metrics

    fast = run("fast", "eager")
    monkeypatch.setattr(layouts, "prompt_groups", lambda batch: None)  # no prompt is shared: every row in full
    plain = run("plain", "sdpa")
    for ours, reference in zip(fast, plain, strict=True):
        for key in ("reward/mean", "loss", "kl", "entropy", "grad_norm"):
            assert ours[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), key


def test_a_model_without_a_selectable_cache_runs_every_row_in_full():
    """Models whose forward returns no (selectable) KV cache fall back to one pass per row."""
    from types import SimpleNamespace

    model = model_of()
    batch = rollout(model, ["a", "bc1"])
    calls = []

    def no_cache(**kwargs):
        calls.append(kwargs["input_ids"].shape)
        return SimpleNamespace(logits=model(**kwargs).logits)  # the cache is dropped

    with torch.no_grad():
        got = completion_logits(no_cache, batch)
        expected = completion_logits(model, batch, share_prompts=False)
    torch.testing.assert_close(got, expected)
    assert calls[-1] == batch.input_ids.shape  # the last pass ran every full row


@pytest.mark.parametrize("kind,kv_heads", [("llama", 2), ("qwen2", 2)])
def test_shared_prompt_pass_under_checkpointing_equals_full_rows(kind, kv_heads, monkeypatch):
    """train.gradient_checkpointing with the prompts shared: both passes checkpointed, the
    prompt's writing its keys and values into a set-once cache, the completions' reading them
    through a read-only one. The logits and the gradients are those of full rows without
    checkpointing; and the caches really were used (not dropped, as transformers drops a
    cache under checkpointing by default)."""
    from grpo.train.models import enable_checkpointing

    model = model_of(kind, kv_heads, eos_bias=1.5)
    batch = rollout(model, ["a", "bc1", "cab 7"])
    weights = torch.randn(*batch.completion_mask.shape, len(TOKENIZER))
    mask = batch.completion_mask.bool()

    def run(shared: bool, checkpointing: bool):
        model.zero_grad()
        model.train(checkpointing)
        logits = completion_logits(model, batch, share_prompts=shared)
        ((logits * weights).sum(-1) * batch.completion_mask).sum().backward()
        model.eval()
        return logits.detach()[mask], torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    import grpo.train.shared_prompt as shared_prompt

    turned = []  # each cache turned for a checkpointed pass
    real = shared_prompt._turn
    monkeypatch.setattr(
        shared_prompt, "_turn", lambda cache, kind: turned.append((kind, real(cache, kind))) or turned[-1][1]
    )
    reference = run(shared=False, checkpointing=False)
    assert enable_checkpointing(model)
    for shared in (False, True):
        logits, grads = run(shared, checkpointing=True)
        assert_close_scaled(logits, reference[0])
        assert gap(grads, reference[1]) < BACKWARD, shared
    assert turned == [("set", True), ("read", True)]  # the shared path ran under checkpointing, not the full rows
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    assert layers and not any("_can_checkpoint_with_cache" in vars(layer) for layer in layers)  # switch undone
