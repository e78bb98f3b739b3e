"""A tied weight's two gradients meeting in one tensor (grpo.train.models.tie_gradients_in_place):
the chunked head hands its gradient to the input embedding's backward, which adds its rows in
place. The same gradients bit for bit as torch's own backward, in every layout, chunked head
or not, checkpointed or not, over micro-batches; one (V, H) gradient fewer made in the
backward; a post-accumulate hook sees the whole gradient; left alone where it does not apply."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo.algo.logprobs import head_logprobs
from grpo.train.layouts import PACKED, PADDED, SHARED, completion_logprobs
from grpo.train.models import activation_checkpointing, enable_checkpointing, tie_gradients_in_place
from tests.algo.test_chunked_head import batch_of, tiny_lm

VOCAB = 40


def build(tied=True):
    return tiny_lm("qwen2", vocab=VOCAB, tied=tied)  # pad_token_id 0: the embedding's padding_idx


def gradients(model, batches, layout, chunked, checkpointed):
    """The gradients after the loss-masked log-probs' sums of `batches` (accumulated)."""
    model.zero_grad(set_to_none=True)
    for batch in batches:
        with activation_checkpointing(model, checkpointed):
            logprobs, _ = completion_logprobs(
                model, batch, 0.8, share_prompts=True, chunked_head=chunked, layout=layout
            )
        (logprobs * batch.loss_mask).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", [PACKED, SHARED, PADDED])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_rows_gradient_equals_the_dense_one_bit_for_bit(layout, chunked, checkpointed):
    dense = build()
    if checkpointed:
        enable_checkpointing(dense)
    rows = copy.deepcopy(dense)
    assert tie_gradients_in_place(rows)
    # many repeated tokens (a vocabulary of 40) and padding (id 0, the embedding's padding_idx)
    batches = [batch_of(VOCAB, prompts=3, group_size=3, p_len=5, t_len=7, seed=s) for s in (1, 2)]
    assert (batches[0].input_ids == 0).any()
    want = gradients(dense, batches, layout, chunked, checkpointed)
    got = gradients(rows, batches, layout, chunked, checkpointed)
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name
    assert rows.get_input_embeddings().weight._grpo_tied_gradient.waiting is None


class _VocabSizedTensors(TorchDispatchMode):
    """The storages of the dense (V, H) tensors that ops return, the weight's own left out."""

    def __init__(self, weight):
        super().__init__()
        self.shape, self.storages = tuple(weight.shape), set()
        self.weight = weight.untyped_storage().data_ptr()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and tuple(t.shape) == self.shape:
                self.storages.add(t.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize("install", [False, True])
def test_the_backward_makes_one_vocabulary_sized_gradient_fewer(install):
    model = build()
    if install:
        tie_gradients_in_place(model)
    batch = batch_of(VOCAB, prompts=2, group_size=3, p_len=5, t_len=7, seed=1)
    logprobs, _ = completion_logprobs(model, batch, 1.0, share_prompts=True, chunked_head=True, layout=PACKED)
    loss = (logprobs * batch.loss_mask).sum()
    weight = model.get_input_embeddings().weight
    with _VocabSizedTensors(weight) as seen:
        loss.backward()
    # the head's gradient, into which the embedding's rows are added; without, the embedding's
    # dense gradient too (and their sum)
    made = len(seen.storages - {seen.weight})
    assert made == 1 if install else made >= 2


def test_it_applies_to_a_tied_trained_plain_embedding_only():
    assert not tie_gradients_in_place(build(tied=False))  # untied: its gradient would stay sparse
    frozen = build()
    frozen.get_input_embeddings().weight.requires_grad_(False)
    assert not tie_gradients_in_place(frozen)
    scaled = build()
    scaled.get_input_embeddings().scale_grad_by_freq = True
    assert not tie_gradients_in_place(scaled)
    model = build()
    assert tie_gradients_in_place(model)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    # the reference's copy keeps it; the state dict is the same
    assert list(copy.deepcopy(model).state_dict()) == list(build().state_dict())


def test_a_gradient_that_reaches_the_embedding_alone_is_the_dense_one():
    model = build()
    tie_gradients_in_place(model)
    ids = torch.tensor([[3, 5, 5, 0, 7]])
    model.get_input_embeddings()(ids).square().sum().backward()  # no head in the graph
    plain = build()
    plain.get_input_embeddings()(ids).square().sum().backward()
    assert torch.equal(model.get_input_embeddings().weight.grad, plain.get_input_embeddings().weight.grad)


def test_the_heads_gradient_without_the_embedding_still_reaches_the_weight():
    model, plain = build(), build()
    tie_gradients_in_place(model)
    batch = batch_of(VOCAB, prompts=2, group_size=3, p_len=5, t_len=7, seed=1)
    grads = []
    for m in (model, plain):
        hidden = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(0))  # no embedding in the graph
        logprobs, _ = head_logprobs(hidden, m.get_output_embeddings().weight, batch.input_ids[:2, :4] % VOCAB)
        logprobs.sum().backward()
        grads.append(m.get_output_embeddings().weight.grad)
    assert torch.equal(*grads)
    assert model.get_input_embeddings().weight._grpo_tied_gradient.waiting is None


def test_a_post_accumulate_hook_sees_the_whole_gradient():
    """What train.optimizer_in_backward's step reads: the weight's gradient once, complete."""
    seen = {}
    for install in (False, True):
        model = build()
        if install:
            tie_gradients_in_place(model)
        weight = model.get_input_embeddings().weight
        calls = []
        weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
        batch = batch_of(VOCAB, prompts=2, group_size=3, p_len=5, t_len=7, seed=1)
        logprobs, _ = completion_logprobs(model, batch, 1.0, share_prompts=True, chunked_head=True, layout=PACKED)
        (logprobs * batch.loss_mask).sum().backward()
        assert len(calls) == 1
        seen[install] = calls[0]
    assert torch.equal(seen[True], seen[False])
