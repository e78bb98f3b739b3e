"""Attention by segments in packed passes (grpo.infra.attention): each sequence attends over its
own keys only (a completion also over its shared prompt's), instead of every pair of a bin's
slots through the 4-D mask. The log-probs, entropies and gradients equal the padded layout's to
float32 rounding (the same tolerances as the masked packed pass: tests/train/test_packing.py)
for the policy (single- and multi-turn, a group's prompt packed once or not, checkpointed or
not), SFT's loss and the reward model's scores, on Qwen2, Llama, GPT-2 and OPT; three planted
bugs in the segments each move them by far more, and the probe then leaves the model on the
mask. The tests lower `SEGMENTED_FROM` to 0 so that their short bins go by segments too."""

import dataclasses
import types

import pytest
import torch

from grpo.infra import attention
from grpo.train import packed_layout
from grpo.train.layouts import prompt_groups
from grpo.train.models import enable_checkpointing
from grpo.train.sft import packed_batch
from tests.algo.test_chunked_head import batch_of
from tests.helpers import BACKWARD, FAR, FORWARD, assert_close_scaled
from tests.train.test_packing import BATCHES, SHAPES, VOCAB, build, differences
from tests.train.test_sft_packing import model_of, padded_batch, worst

pytestmark = pytest.mark.numerics  # compares kernels: `make test` runs it with AVX2 kernels too


@pytest.fixture
def always(monkeypatch):
    """Every bin by segments, however short."""
    monkeypatch.setattr(attention, "SEGMENTED_FROM", 0)


def segmented_calls(run) -> int:
    before = attention._segmented_calls[0]
    run()
    return attention._segmented_calls[0] - before


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("turns", list(BATCHES))
@pytest.mark.parametrize("name", list(SHAPES))
def test_segments_give_the_padded_log_probs_entropies_and_gradients(always, name, turns, implementation):
    model = build(name)
    model.set_attn_implementation(implementation)  # what the segments wrap, and what the padded pass runs
    batch = BATCHES[turns]()
    assert enable_checkpointing(model)
    assert attention.enable(model)
    for share in (False, True):
        for checkpointed in (False, True):
            label = f"{name} {turns} share={share} checkpointed={checkpointed}"
            found = []
            calls = segmented_calls(
                lambda: found.append(differences(model, batch, share, chunked=True, checkpointed=checkpointed))
            )
            logprobs, entropy, grads = found[0]
            assert calls >= 2, label  # the packed pass's two layers went by segments (and the recomputation's)
            assert logprobs < FORWARD and entropy < FORWARD and grads < BACKWARD, (label, logprobs, entropy, grads)


def test_the_plan_covers_each_sequence_and_sees_what_the_mask_lets_it_see():
    batch = BATCHES["single-turn"]()
    packed = packed_layout.pack(batch, prompt_groups(batch)[1])
    found = attention.plan(packed.units, packed.branches, smallest=0)
    allowed = packed.attention_mask(torch.float32)[:, 0] == 0  # (B, L, L)
    for b, segments in enumerate(found.bins):
        covered = sum(s.length for s in segments)
        assert covered == found.used[b] == int((packed.units[b] >= 0).sum())
        for s in segments:
            queries = range(s.start, s.start + s.length)
            keys = list(range(s.prompt, s.prompt + s.prompt_length)) + list(queries)
            seen = torch.zeros(s.length, len(keys), dtype=torch.bool)
            for i, q in enumerate(queries):
                for j, k in enumerate(keys):
                    seen[i, j] = allowed[b, q, k]
            want = torch.ones_like(seen).tril(s.prompt_length) if s.mask is not None else torch.ones_like(seen).tril()
            assert torch.equal(seen, want)  # the mask's pairs within the segment's keys, and no others
            if s.mask is not None:
                assert torch.equal(s.mask, want)
            outside = allowed[b, s.start : s.start + s.length].clone()
            outside[:, keys] = False
            assert not outside.any()  # nothing the mask allows lies outside its keys
    length = packed.units.shape[1]
    assert attention.plan(packed.units, packed.branches, heads=4, smallest=4 * length**2) is not None
    assert attention.plan(packed.units, packed.branches, heads=4, smallest=4 * length**2 + 1) is None


def test_a_small_bin_keeps_the_mask_and_a_large_one_goes_by_segments():
    model = build("llama")  # 4 heads
    assert attention.enable(model)
    batch = BATCHES["single-turn"]()
    assert 4 * packed_layout.pack(batch).input_ids.shape[1] ** 2 < attention.SEGMENTED_FROM
    assert segmented_calls(lambda: differences(model, batch, False)) == 0
    large = batch_of(VOCAB, prompts=1, group_size=80, p_len=5, t_len=10, seed=3)  # one prompt, 80 completions
    assert 4 * packed_layout.pack(large, prompt_groups(large)[1]).input_ids.shape[1] ** 2 >= attention.SEGMENTED_FROM
    found = []
    assert segmented_calls(lambda: found.append(differences(model, large, True))) >= 2
    logprobs, entropy, grads = found[0]
    assert logprobs < FORWARD and entropy < FORWARD and grads < BACKWARD, (logprobs, entropy, grads)
    unswitched = build("llama")
    packed = packed_layout.pack(batch)
    assert attention.arguments(unswitched, packed.units, packed.branches) == {}


def _no_prompt(segment):  # a completion that does not see its prompt
    return dataclasses.replace(segment, prompt_length=0, mask=None)


def _upper_left(segment):  # a completion's causal mask aligned to the prompt's first key, not its own
    if segment.mask is None:
        return segment
    return dataclasses.replace(segment, mask=torch.ones_like(segment.mask).tril())


PLANTED = {"no prompt": _no_prompt, "upper-left": _upper_left}


@pytest.mark.parametrize("bug", [*PLANTED, "not causal"])
def test_each_planted_segment_bug_moves_the_log_probs_and_the_probe_refuses_it(always, monkeypatch, bug):
    real_plan = attention.plan

    def planted(units, branches, **kwargs):
        found = real_plan(units, branches, **kwargs)
        if found is None or bug == "not causal":
            return found
        return dataclasses.replace(found, bins=[[PLANTED[bug](s) for s in segments] for segments in found.bins])

    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def not_causal(*args, is_causal=False, **kwargs):
        return real_sdpa(*args, is_causal=False, **kwargs)

    model = build("qwen2_tied")
    assert attention.enable(model)
    monkeypatch.setattr(attention, "plan", planted)
    if bug == "not causal":  # a prompt's (or a sequence's) tokens see its later ones
        monkeypatch.setattr(attention, "F", types.SimpleNamespace(scaled_dot_product_attention=not_causal))
    logprobs, _, grads = differences(model, BATCHES["single-turn"](), True)
    assert logprobs > FAR * FORWARD and grads > FAR * BACKWARD
    assert not attention.enable(build("qwen2_tied"))  # the probe sees it: the model stays on the mask


def test_only_models_that_can_are_switched_and_a_saved_model_names_no_implementation_of_ours(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    mistral = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(
            "mistral",
            vocab_size=40,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=4,
        )
    )
    assert not attention.enable(mistral)  # a sliding window: the segments would not cut it
    model = build("llama")
    was = model.config._attn_implementation  # sdpa, transformers' default
    assert attention.enable(model)
    assert model.config._attn_implementation == f"grpo_segments_{was}"
    model.save_pretrained(tmp_path / "saved")
    assert "grpo" not in (tmp_path / "saved" / "config.json").read_text()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert "grpo" not in again.config._attn_implementation


@pytest.mark.parametrize("shape", ["qwen2_tied", "llama", "gpt2"])
def test_sft_by_segments_has_the_padded_batchs_loss_and_gradients(always, shape):
    model = model_of(shape)
    assert attention.enable(model)
    padded = padded_batch()
    packed = packed_batch(model, padded)
    assert attention.SEGMENTS in packed
    found = []
    assert segmented_calls(lambda: found.append(worst(model, padded, packed))) >= 2
    loss_gap, grad_gap = found[0]
    assert loss_gap <= FORWARD and grad_gap <= BACKWARD, (loss_gap, grad_gap)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "opt"])
def test_the_reward_model_scores_by_segments_as_padded(always, tmp_path, kind):
    from grpo.rewards.model import RewardModel
    from tests.rewards.test_model import _classifier_base, _padded_scores, sevens

    rm = RewardModel.from_base(_classifier_base(tmp_path, kind), seed=0)
    pairs = sevens(6, seed=3)
    prompts = [p["prompt"] for p in pairs]
    completions = [p["chosen"] + p["rejected"] * (i % 3) for i, p in enumerate(pairs)]
    got = []
    calls = segmented_calls(lambda: got.append(rm.scores(prompts, completions)))
    assert rm._packs and getattr(rm.model, attention._ENABLED)
    assert calls >= 2
    assert_close_scaled(got[0], _padded_scores(rm, prompts, completions), FORWARD)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """What torch's `varlen_attn` computes (CUDA only), from its documented arguments, written
    plainly for the CPU: segment i's queries q[cu_q[i]:cu_q[i+1]] over its keys
    k[cu_k[i]:cu_k[i+1]], causal where window_size is (-1, 0), aligned at the end of the keys
    as flash attention aligns a segment with more keys than queries. The maxima must be the
    longest segment's (the kernel sizes its grid by them)."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and len(cu_q) == len(cu_k)
    lengths_q, lengths_k = cu_q.diff().tolist(), cu_k.diff().tolist()
    assert (max_q, max_k) == (max(lengths_q), max(lengths_k))
    assert enable_gqa or q.shape[1] == k.shape[1]
    pieces = []
    for i, (n, m) in enumerate(zip(lengths_q, lengths_k)):
        qi = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)  # (H, n, D)
        ki, vi = (
            t[cu_k[i] : cu_k[i + 1]].transpose(0, 1).repeat_interleave(q.shape[1] // k.shape[1], 0) for t in (k, v)
        )
        mask = None
        if tuple(window_size) == (-1, 0):
            mask = torch.arange(m)[None] <= torch.arange(n)[:, None] + (m - n)
        pieces.append(torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale))
    return torch.cat(pieces, 1).transpose(0, 1)


def _top_left(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):  # a kernel whose causal mask starts at the first key
    out = []
    for i in range(len(cu_q) - 1):
        n = int(cu_q[i + 1] - cu_q[i])
        one = torch.tensor([0, n], dtype=torch.int32)
        out.append(
            reference_varlen(
                q[cu_q[i] : cu_q[i + 1]], k[cu_k[i] : cu_k[i] + n], v[cu_k[i] : cu_k[i] + n], one, one, n, n, **kwargs
            )
        )
    return torch.cat(out)


def _gqa_qkv(found, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (len(found.bins), found.length, 64)
    q = torch.randn(shape[0], 4, *shape[1:], generator=g, requires_grad=True)
    k, v = (torch.randn(shape[0], 2, *shape[1:], generator=g, requires_grad=True) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("turns", list(BATCHES))
def test_one_varlen_call_gives_what_a_call_per_segment_gives(turns, share):
    """The plan laid end to end for one variable-length call (`Varlen`), through a kernel with
    varlen_attn's arguments and semantics: the same output and gradients as a call per segment,
    grouped-query heads not repeated, zeros at unused slots."""
    batch = BATCHES[turns]()
    packed = packed_layout.pack(batch, prompt_groups(batch)[1] if share else None)
    found = attention.plan(packed.units, packed.branches, smallest=0)
    q, k, v = _gqa_qkv(found)
    got = attention._attend_varlen(q, k, v, found, 0.3, reference_varlen)
    grads_got = torch.autograd.grad((got * torch.linspace(-1, 1, got.numel()).view_as(got)).sum(), (q, k, v))
    want = attention._attend(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), found, 0.3)
    grads_want = torch.autograd.grad((want * torch.linspace(-1, 1, want.numel()).view_as(want)).sum(), (q, k, v))
    assert got.shape == want.shape
    assert_close_scaled(got, want, FORWARD)
    for a, b in zip(grads_got, grads_want):
        assert_close_scaled(a, b, BACKWARD)
    for b, used in enumerate(found.used):
        assert not got[b, used:].any()


def test_a_model_through_the_varlen_call_has_the_padded_log_probs_and_gradients(always, monkeypatch):
    """The model's layers handing their segments to the varlen kernel (as on a GPU in half
    precision; here the plain kernel above on the CPU): the padded layout's numbers."""
    monkeypatch.setattr(attention, "_varlen_kernel", lambda query: reference_varlen)
    for name in SHAPES:
        model = build(name)
        assert enable_checkpointing(model) and attention.enable(model)
        for share, checkpointed in ((False, False), (True, True)):
            logprobs, entropy, grads = differences(
                model, BATCHES["multi-turn"](), share, chunked=True, checkpointed=checkpointed
            )
            found = (name, share, logprobs, entropy, grads)
            assert logprobs < FORWARD and entropy < FORWARD and grads < BACKWARD, found


def test_the_varlen_call_is_used_only_where_it_runs_and_gives_the_segments_outputs(monkeypatch):
    """On a CPU (no such kernel in torch) or in float32 a call per segment; a kernel that aligns
    a completion's causal mask at its prompt's first key, or fails, is refused by the check."""
    assert attention._varlen_kernel(torch.zeros(1, 4, 8, 64)) is None
    assert attention._varlen_kernel(torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)) is None
    cpu = torch.device("cpu")
    assert attention._varlen_serves(reference_varlen, cpu, torch.float32)
    assert attention._varlen_serves(reference_varlen, cpu, torch.bfloat16)
    assert not attention._varlen_serves(_top_left, cpu, torch.float32)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available")

    assert not attention._varlen_serves(broken, cpu, torch.bfloat16)


def test_a_planted_varlen_layout_bug_moves_the_outputs(monkeypatch):
    """A completion's keys laid own-first (its prompt after it): the end-aligned causal mask
    then shows it the wrong keys, and the outputs move by far more than rounding."""
    batch = BATCHES["single-turn"]()
    packed = packed_layout.pack(batch, prompt_groups(batch)[1])
    found = attention.plan(packed.units, packed.branches, smallest=0)
    q, k, v = _gqa_qkv(found)
    want = attention._attend(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), found, None)
    real = attention.Varlen.of

    def own_first(plan, device):
        v = real(plan, device)
        kb, ks = v.key_bins.clone(), v.key_slots.clone()
        for i, s in enumerate(s for segments in plan.bins for s in segments):
            a, b = int(v.cu_k[i]), int(v.cu_k[i + 1])
            kb[a:b] = torch.cat([kb[a + s.prompt_length : b], kb[a : a + s.prompt_length]])
            ks[a:b] = torch.cat([ks[a + s.prompt_length : b], ks[a : a + s.prompt_length]])
        return dataclasses.replace(v, key_bins=kb, key_slots=ks)

    monkeypatch.setattr(attention.Varlen, "of", staticmethod(own_first))
    got = attention._attend_varlen(q, k, v, found, None, reference_varlen)
    assert (got - want).abs().max() > 1e-1
    assert not attention._varlen_serves(reference_varlen, torch.device("cpu"), torch.float32)
