"""The packed layout (grpo.train.packed_layout): the real tokens of a micro-batch end to end, no
padding. Its log-probs, entropies and gradients equal the padded layout's to float32
rounding (tests/helpers.py: FORWARD and BACKWARD epsilons of the values' scale), single-turn and
multi-turn (a tool's tokens attended to, out of the loss), with and without a group's prompt
packed once, on a Qwen2 (tied embeddings, QKV biases) and a Llama; and each of three planted
packing bugs moves them by far more than that."""

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from grpo.rollout import Rollout
from grpo.train import layouts, packed_layout
from grpo.train.layouts import PACKED, PADDED, completion_logprobs, prompt_groups
from grpo.train.models import activation_checkpointing, enable_checkpointing
from tests.algo.test_chunked_head import batch_of
from tests.helpers import BACKWARD, FAR, FORWARD, assert_close_scaled, gap

pytestmark = pytest.mark.numerics  # compares kernels: `make test` runs it with AVX2 kernels too

VOCAB = 40
SHAPES = {
    "qwen2_tied": (
        "qwen2",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        True,
    ),
    "llama": (
        "llama",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        False,
    ),
}


def build(name: str):
    model_type, arguments, tied = SHAPES[name]
    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=tied, **arguments
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # peaked distributions: a wrong position or key moves a log-prob by far more than rounding
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model


def multi_turn(batch: Rollout) -> Rollout:
    """The batch as a multi-turn rollout: in each completion of 4 tokens or more, its second and
    third tokens are a tool's answer (attended to, out of the loss)."""
    loss_mask = batch.completion_mask.clone()
    long = batch.completion_mask.sum(1) >= 4
    loss_mask[long, 1:3] = 0
    return dataclasses.replace(batch, loss_mask=loss_mask)


BATCHES = {
    "single-turn": lambda: batch_of(VOCAB, prompts=3, group_size=3, p_len=5, t_len=7, seed=1),
    "multi-turn": lambda: multi_turn(batch_of(VOCAB, prompts=3, group_size=3, p_len=5, t_len=7, seed=1)),
}


def passes(model, batch, layout, share, chunked=True, checkpointed=False):
    """Log-probs, entropies and the gradient of the loss-masked log-probs' sum."""
    model.zero_grad(set_to_none=True)
    with activation_checkpointing(model, checkpointed):
        logprobs, entropy = completion_logprobs(
            model, batch, 0.8, share_prompts=share, chunked_head=chunked, with_entropy=True, layout=layout
        )
    (logprobs * batch.loss_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logprobs.detach(), entropy, grads


def differences(model, batch, share, **kwargs) -> tuple[float, float, float]:
    """The largest differences of the packed layout from the padded one, over the loss mask, in
    epsilons of the values' scale (tests.helpers.gap): log-probs, entropies, and the gradients
    (each tensor to its own scale)."""
    mask = batch.loss_mask.bool()
    want = passes(model, batch, PADDED, share=False)
    got = passes(model, batch, PACKED, share, **kwargs)
    grads = max(gap(got[2][k], g) for k, g in want[2].items())
    return gap(got[0][mask], want[0][mask]), gap(got[1][mask], want[1][mask]), grads


@pytest.mark.parametrize("turns", list(BATCHES))
@pytest.mark.parametrize("name", list(SHAPES))
def test_packed_passes_give_the_padded_log_probs_entropies_and_gradients(name, turns):
    model = build(name)
    batch = BATCHES[turns]()
    assert enable_checkpointing(model)
    for share in (False, True):
        for chunked in (False, True):
            for checkpointed in (False, True):
                label = f"{name} {turns} share={share} chunked={chunked} checkpointed={checkpointed}"
                logprobs, entropy, grads = differences(model, batch, share, chunked=chunked, checkpointed=checkpointed)
                assert logprobs < FORWARD and entropy < FORWARD and grads < BACKWARD, (label, logprobs, entropy, grads)


def test_the_packed_slots_hold_each_row_s_tokens_at_its_positions():
    """What the model sees: per row, its prompt's real tokens and its completion's, positions
    counting from 0 within each sequence (a completion continuing its prompt), each output
    read from the slot that holds the token before it, and no padding but a bin's tail."""
    batch = batch_of(VOCAB, prompts=3, group_size=3, p_len=5, t_len=7, seed=1)
    p_len = batch.input_ids.shape[1] - batch.completion_mask.shape[1]
    lengths = batch.completion_mask.sum(1).long().tolist()
    for share in (False, True):
        groups = prompt_groups(batch)[1] if share else None
        packed = packed_layout.pack(batch, groups)
        flat_ids, flat_positions = packed.input_ids.flatten(), packed.position_ids.flatten()
        prompt_tokens = batch.attention_mask[:, :p_len].sum().item() // (3 if share else 1)
        assert packed.tokens == prompt_tokens + sum(lengths)  # each prompt once where shared
        assert packed.input_ids.numel() < batch.input_ids.numel()
        for i, c in enumerate(lengths):
            p = int(batch.attention_mask[i, :p_len].sum())
            before = torch.cat([batch.input_ids[i, p_len - 1 : p_len], batch.completion_ids[i, : c - 1]])
            slots = packed.index[i, :c]
            assert torch.equal(flat_ids[slots], before)  # the token before each completion token
            assert flat_positions[slots].tolist() == list(range(p - 1, p - 1 + c))
        real = packed.units.flatten() >= 0
        assert int(real.sum()) == packed.tokens


def test_no_token_sees_another_sequence():
    batch = batch_of(VOCAB, prompts=2, group_size=2, p_len=4, t_len=5, seed=2)
    packed = packed_layout.pack(batch, prompt_groups(batch)[1])
    allowed = packed.attention_mask(torch.float32)[:, 0] == 0  # (B, L, L)
    units, branches = packed.units, packed.branches
    for b in range(allowed.shape[0]):
        for q in range(allowed.shape[1]):
            for k in range(allowed.shape[2]):
                if units[b, q] < 0:
                    continue  # a bin's unused tail
                sees = bool(allowed[b, q, k])
                same_sequence = units[b, k] == units[b, q] and branches[b, k] in (0, branches[b, q])
                assert sees == bool(k <= q and same_sequence), (b, q, k)


def _planted_positions(batch, groups=None):
    packed = REAL_PACK(batch, groups)  # positions that do not restart: one count through each bin
    steps = torch.arange(packed.position_ids.shape[1]).expand_as(packed.position_ids)
    return dataclasses.replace(packed, position_ids=steps.contiguous())


def _planted_attention(batch, groups=None):
    packed = REAL_PACK(batch, groups)  # attention across sequences: every slot of a bin one unit
    return dataclasses.replace(packed, units=torch.zeros_like(packed.units), branches=torch.zeros_like(packed.branches))


def _planted_slots(batch, groups=None):
    packed = REAL_PACK(batch, groups)  # each row's outputs read from the next row's slots
    return dataclasses.replace(packed, index=packed.index.roll(1, 0))


REAL_PACK = packed_layout.pack


@pytest.mark.parametrize("planted", [_planted_positions, _planted_attention, _planted_slots])
def test_each_planted_packing_bug_moves_the_log_probs(monkeypatch, planted):
    model = build("qwen2_tied")
    batch = BATCHES["single-turn"]()
    monkeypatch.setattr(packed_layout, "pack", planted)
    logprobs, _, grads = differences(model, batch, share=True)
    assert logprobs > FAR * FORWARD and grads > FAR * BACKWARD


def test_decide_layouts_takes_the_packed_layout_where_it_serves_and_not_where_a_bug_breaks_it(monkeypatch):
    model = build("llama")
    decided = layouts.decide_layouts(model, False)
    assert decided.checkpointing is False and decided.plain == PACKED
    model = build("llama")
    monkeypatch.setattr(packed_layout, "pack", _planted_slots)
    assert layouts.decide_layouts(model, False).plain != PACKED


def test_the_critic_s_packed_values_and_gradients_are_its_padded_ones():
    """PPO's value model: packed (a group's prompt once) and padded passes give the same values
    and gradients; `backbone_packs` takes the packed one for a Llama backbone, not for a
    planted packing bug."""
    from transformers import AutoModel

    from grpo.train.networks import ValueModel, backbone_packs

    backbone = build("llama").model  # the backbone without its head, as AutoModel loads it
    assert isinstance(backbone, type(AutoModel.from_config(backbone.config)))
    batch = BATCHES["multi-turn"]()
    critic = ValueModel(backbone, 32)
    with torch.no_grad():
        critic.head.weight.normal_()

    def values_and_grads(packed: bool):
        critic.packed = packed
        critic.zero_grad(set_to_none=True)
        values = critic(batch)
        (values * batch.loss_mask).sum().backward()
        return values.detach(), {n: p.grad.clone() for n, p in critic.named_parameters()}

    (want, want_grads), (got, got_grads) = values_and_grads(False), values_and_grads(True)
    mask = batch.loss_mask.bool()
    assert_close_scaled(got[mask], want[mask], FORWARD)
    for name, grad in want_grads.items():
        assert_close_scaled(got_grads[name], grad, BACKWARD, msg=name)
    assert backbone_packs(backbone)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(packed_layout, "pack", _planted_positions)
        assert not backbone_packs(backbone)
