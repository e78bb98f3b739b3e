"""SFT in the packed layout (grpo.train.sft.packed_batch): a batch's sequences end to end,
positions restarting at each, attention kept within each, the labels moved with their tokens.
The loss and every gradient equal the padded batch's to float32 rounding, on a Qwen2 (tied
embeddings, QKV biases), a Llama and a GPT-2 (absolute positions); each of three planted
packing bugs moves them by far more. (`grpo sft --model` packing by default: tests/train/test_sft_data.py.)"""

import pytest
import torch

from grpo.infra import packing
from grpo.train.sft import IGNORE_INDEX, completion_loss, packed_batch
from tests.helpers import BACKWARD, FAR, FORWARD, gap
from tests.train.test_packing import VOCAB, build

pytestmark = pytest.mark.numerics  # compares kernels: `make test` runs it with AVX2 kernels too


def padded_batch(seed: int = 0) -> dict:
    """Right-padded rows of 3 to 11 tokens, labels only on each row's second half (a prompt and
    a completion), as `_pad` makes them."""
    g = torch.Generator().manual_seed(seed)
    lengths = [11, 3, 7, 9, 4, 6]
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.full((len(lengths), width), IGNORE_INDEX)
    attention = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        input_ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        labels[i, n // 2 : n] = input_ids[i, n // 2 : n]
        attention[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    loss = completion_loss(model(**inputs, use_cache=False).logits, batch["labels"])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def worst(model, padded: dict, packed: dict) -> tuple[float, float]:
    """The packed batch's differences from the padded one's loss and gradients (each tensor to
    its own scale), in epsilons of that scale (tests.helpers.gap)."""
    want_loss, want = loss_and_grads(model, padded)
    got_loss, got = loss_and_grads(model, packed)
    return gap(got_loss, want_loss), max(gap(got[n], want[n]) for n in want)


def gpt2():
    """A tiny GPT-2: absolute position embeddings, where a position that does not restart shows
    (rotary ones are relative: a sequence shifted as a whole computes the same)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.normal_(0.0, 1.0)
    return model


def model_of(shape: str):
    return gpt2() if shape == "gpt2" else build(shape)


@pytest.mark.parametrize("shape", ["qwen2_tied", "llama", "gpt2"])
def test_the_packed_batch_has_the_padded_batchs_loss_and_gradients(shape):
    model = model_of(shape)
    padded = padded_batch()
    packed = packed_batch(model, padded)
    assert packed is not None
    real = int(padded["attention_mask"].sum())
    assert packed["input_ids"].numel() < padded["input_ids"].numel()  # the padding is gone
    assert int((packed["attention_mask"][:, 0].diagonal(dim1=-2, dim2=-1) == 0).sum()) >= real
    # The same targets: every label but each sequence's first, which the shift never reads.
    assert sorted(packed["labels"][packed["labels"] != IGNORE_INDEX].tolist()) == sorted(
        padded["labels"][:, 1:][padded["labels"][:, 1:] != IGNORE_INDEX].tolist()
    )
    loss_gap, grad_gap = worst(model, padded, packed)
    assert loss_gap <= FORWARD and grad_gap <= BACKWARD, (loss_gap, grad_gap)


def _planted(monkeypatch, bug: str) -> None:
    real_pack = packing.pack_sequences

    def broken(input_ids, attention_mask):
        packed = real_pack(input_ids, attention_mask)
        if bug == "positions":  # positions run on across the bin instead of restarting
            packed.position_ids = torch.arange(packed.position_ids.shape[1]).expand_as(packed.position_ids).clone()
        elif bug == "attention":  # every token sees every earlier slot of its bin
            packed.units = torch.zeros_like(packed.units)
        elif bug == "labels":  # each token's label one slot late
            packed.index = packed.index + 1
        return packed

    monkeypatch.setattr(packing, "pack_sequences", broken)


@pytest.mark.parametrize("bug,shape", [("positions", "gpt2"), ("attention", "llama"), ("labels", "llama")])
def test_each_planted_packing_bug_moves_the_loss_or_gradients_far(monkeypatch, bug, shape):
    model = model_of(shape)
    padded = padded_batch()
    _planted(monkeypatch, bug)
    loss_gap, grad_gap = worst(model, padded, packed_batch(model, padded))
    assert loss_gap > FAR * FORWARD or grad_gap > FAR * BACKWARD, (loss_gap, grad_gap)


def test_rows_that_are_not_right_padded_runs_are_not_packed():
    model = build("llama")
    padded = padded_batch()
    padded["attention_mask"][1, 0] = 0  # a hole at the start of a row
    assert packed_batch(model, padded) is None
