"""Log-probs through the LM head chunk by chunk (train.chunked_head) equal the plain path's:
full logits, then token_logprobs. Values and gradients (with respect to the hidden states,
the head's weight and bias, and every parameter of a model: tied and untied embeddings,
LoRA, shared prompt passes), under temperature and the repetition penalty; and no tensor of
(N, T, V) size is ever made. Models whose logits are not their head's output run the plain
path."""

import functools

import pytest
import torch
from torch.nn import functional as F
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import grpo
import grpo.algo.logprobs as logprobs_module
import grpo.train.layouts as layouts
from grpo.algo import entropy, head_logprobs, token_logprobs
from grpo.rollout import Rollout
from grpo.train.models import apply_lora
from grpo.train.layouts import chunkable_head, completion_logprobs
from tests.algo.test_logprobs import LargestTensor
from tests.helpers import BACKWARD, assert_close_scaled, scale_of

pytestmark = pytest.mark.numerics  # compares kernels: `make test` runs it with AVX2 kernels too

# ---- the function: hidden states and a head -------------------------------------------------


def plain(hidden, weight, ids, bias=None, vocab_tile=None, **scoring):
    """What the chunked function replaces: the whole (N, T, V) logits, then the log-probs."""
    logits = F.linear(hidden, weight, bias)
    return token_logprobs(logits, ids, **scoring), entropy(logits.detach(), ids=ids, **scoring)


@pytest.mark.parametrize("chunk_rows", [1, 3, None])  # one row per chunk, ragged chunks, one chunk
@pytest.mark.parametrize("temperature,penalty", [(1.0, 1.0), (0.7, 1.0), (1.0, 1.6), (1.3, 0.6)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("vocab_tile", [logprobs_module.VOCAB_TILE, 4])  # the whole vocabulary; tiles of 4, 4, 3
def test_values_and_gradients_equal_the_full_logits_path(chunk_rows, temperature, penalty, bias, vocab_tile):
    g = torch.Generator().manual_seed(chunk_rows or 0)
    n, t_len, hidden_size, vocab = 3, 5, 8, 11  # a small vocabulary: tokens repeat, the penalty bites
    hidden = torch.randn(n, t_len, hidden_size, generator=g).requires_grad_(True)
    weight = torch.randn(vocab, hidden_size, generator=g).requires_grad_(True)
    b = torch.randn(vocab, generator=g).requires_grad_(True) if bias else None
    ids = torch.randint(0, vocab, (n, t_len), generator=g)
    context = torch.randint(-1, vocab, (n, 4), generator=g)  # -1 = padding
    weights = torch.randn(n, t_len, generator=g)
    scoring = dict(temperature=temperature, repetition_penalty=penalty, context=context)
    width = vocab + 1 if penalty != 1.0 else min(vocab, vocab_tile)  # the scratch a chunk's row takes
    chunk_elements = chunk_rows * width if chunk_rows else 1 << 24
    scoring["vocab_tile"] = vocab_tile

    got, got_entropy = head_logprobs(
        hidden, weight, ids, bias=b, chunk_elements=chunk_elements, with_entropy=True, **scoring
    )
    want, want_entropy = plain(hidden, weight, ids, b, **scoring)
    assert_close_scaled(got, want)
    assert_close_scaled(got_entropy, want_entropy, scale=scale_of(want))  # lse - E[x]: the scores' spread
    leaves = [hidden, weight] + ([b] if bias else [])
    grads_got = torch.autograd.grad((got * weights).sum(), leaves)
    grads_want = torch.autograd.grad((want * weights).sum(), leaves)
    for name, x, y in zip(("hidden", "weight", "bias"), grads_got, grads_want):
        assert_close_scaled(x, y, msg=lambda m, name=name: f"gradient to the {name}: {m}")
    # Without with_entropy there is none; the log-probs are the same.
    alone, none = head_logprobs(hidden, weight, ids, bias=b, chunk_elements=chunk_elements, **scoring)
    assert none is None and torch.equal(alone, got)
    # Only the masked positions (ragged rows: a completion's padding, an empty row): their
    # numbers and gradients are the plain path's; the others are 0 and pass no gradient.
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    part, part_entropy = head_logprobs(
        hidden, weight, ids, bias=b, chunk_elements=chunk_elements, with_entropy=True, mask=mask, **scoring
    )
    assert_close_scaled(part[mask], want[mask])
    assert_close_scaled(part_entropy[mask], want_entropy[mask], scale=scale_of(want))
    assert not part[~mask].any() and not part_entropy[~mask].any()
    grads_part = torch.autograd.grad((part * weights).sum(), leaves)
    grads_plain = torch.autograd.grad((plain(hidden, weight, ids, b, **scoring)[0] * weights * mask).sum(), leaves)
    for name, x, y in zip(("hidden", "weight", "bias"), grads_part, grads_plain):
        assert_close_scaled(x, y, msg=lambda m, name=name: f"masked, gradient to the {name}: {m}")


def test_every_row_is_computed_once_in_chunks_of_the_given_size(monkeypatch):
    """The chunks tile the rows: each row's logits are computed once in the forward and once in
    the backward, never more than `chunk_elements / V` rows at a time."""
    n, t_len, hidden_size, vocab = 2, 7, 4, 5
    hidden = torch.randn(n, t_len, hidden_size).requires_grad_(True)
    weight = torch.randn(vocab, hidden_size).requires_grad_(True)
    ids = torch.randint(0, vocab, (n, t_len))
    rows_seen = []
    head_logits = logprobs_module._head_logits

    def recorded(h, w, b, out=None):
        rows_seen.append(h.shape[0])
        return head_logits(h, w, b, out)

    monkeypatch.setattr(logprobs_module, "_head_logits", recorded)
    out, _ = head_logprobs(hidden, weight, ids, chunk_elements=3 * vocab + 2)  # 3 rows at a time
    assert rows_seen == [3, 3, 3, 3, 2]  # 14 rows
    out.sum().backward()
    assert rows_seen == [3, 3, 3, 3, 2] * 2
    rows_seen.clear()  # with a mask, its positions only: 5 + 2 of 14
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    out, _ = head_logprobs(hidden, weight, ids, chunk_elements=3 * vocab + 2, mask=mask)
    out.sum().backward()
    assert rows_seen == [3, 3, 1] * 2


def test_tiles_of_the_vocabulary_are_each_computed_once_per_chunk_and_the_same_numbers(monkeypatch):
    """In float32 a chunk's logits come a tile of the vocabulary at a time, each tile once in
    the forward and once in the backward, the log-sum-exp and the entropy carried across tiles
    (the largest score in a later tile than the first: the running maximum rises)."""
    g = torch.Generator().manual_seed(1)
    n, t_len, hidden_size, vocab = 2, 7, 4, 10
    hidden = (4 * torch.randn(n, t_len, hidden_size, generator=g)).requires_grad_(True)
    weight = torch.randn(vocab, hidden_size, generator=g)
    weight[8:] *= 3  # the last tile's scores the largest in many rows
    weight.requires_grad_(True)
    ids = torch.randint(0, vocab, (n, t_len), generator=g)
    seen = []
    head_logits = logprobs_module._head_logits

    def recorded(h, w, b, out=None):
        seen.append((h.shape[0], w.shape[0]))
        return head_logits(h, w, b, out)

    monkeypatch.setattr(logprobs_module, "_head_logits", recorded)
    out, ent = head_logprobs(hidden, weight, ids, chunk_elements=8 * 4, vocab_tile=4, with_entropy=True)
    tiles = [(8, 4), (8, 4), (8, 2), (6, 4), (6, 4), (6, 2)]  # 14 rows in chunks of 8, 10 columns in tiles of 4
    assert seen == tiles
    out.sum().backward()
    assert seen == tiles * 2
    monkeypatch.undo()
    whole, whole_entropy = head_logprobs(hidden, weight, ids, with_entropy=True, vocab_tile=vocab)
    assert_close_scaled(out, whole)
    assert_close_scaled(ent, whole_entropy, scale=scale_of(whole))


def test_under_autocast_the_logits_are_computed_in_its_dtype_as_the_heads_own_forward():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 6, 16, generator=g).requires_grad_(True)
    weight = torch.randn(50, 16, generator=g).requires_grad_(True)
    ids = torch.randint(0, 50, (2, 6), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = head_logprobs(hidden, weight, ids, temperature=0.9, chunk_elements=4 * 50)
        want, _ = plain(hidden, weight, ids, temperature=0.9)
    exact, _ = head_logprobs(hidden, weight, ids, temperature=0.9)
    assert got.dtype == torch.float32
    assert_close_scaled(got, want)  # the same bf16 logits in both: float32 rounding apart
    assert (got - exact).abs().max() > 1e-4  # and bf16 they were
    grads_got = torch.autograd.grad(got.sum(), (hidden, weight))
    grads_want = torch.autograd.grad(want.sum(), (hidden, weight))
    for x, y in zip(grads_got, grads_want):
        assert x.dtype == torch.float32
        assert_close_scaled(x, y, 4, dtype=torch.bfloat16)  # bf16 matmuls, summed in another order


@pytest.mark.parametrize("entropy_too", [False, True])
def test_bf16_logits_without_a_backward_are_reduced_tile_by_tile_to_the_whole_vocabularys_numbers(
    monkeypatch, entropy_too
):
    """A pass no backward follows (a reference's), bf16 logits on a CPU: each tile of the
    vocabulary computed in bf16 and cast into the float32 buffer, the log-sum-exp carried
    across tiles: the whole-vocabulary path's log-probs and entropy to float32 rounding. With a
    gradient to come, the whole vocabulary at once, as before."""
    g = torch.Generator().manual_seed(2)
    n, t_len, hidden_size, vocab = 2, 7, 16, 40
    hidden = 3 * torch.randn(n, t_len, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g)
    weight[30:] *= 2  # a later tile holds the largest scores: the running maximum rises
    ids = torch.randint(0, vocab, (n, t_len), generator=g)
    seen = []
    head_logits = logprobs_module._head_logits

    def recorded(h, w, b, out=None):
        seen.append((w.shape[0], out is not None))
        return head_logits(h, w, b, out)

    monkeypatch.setattr(logprobs_module, "_head_logits", recorded)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, got_entropy = head_logprobs(hidden, weight, ids, vocab_tile=16, with_entropy=entropy_too)
    assert seen == [(16, True), (16, True), (8, True)]  # tiles, into the buffer
    seen.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        whole, whole_entropy = head_logprobs(hidden, weight, ids, vocab_tile=vocab, with_entropy=entropy_too)
    assert seen == [(vocab, False)]
    assert_close_scaled(got, whole)
    if entropy_too:
        assert_close_scaled(got_entropy, whole_entropy, scale=scale_of(whole))  # lse - E[x]: cancels
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a gradient to come: untiled
        trained, _ = head_logprobs(hidden, weight.clone().requires_grad_(True), ids, vocab_tile=16)
    assert seen == [(vocab, False)]
    torch.testing.assert_close(trained.detach(), whole, rtol=0, atol=0)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="disagree"):
        head_logprobs(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="does not take hidden states of size 4"):
        head_logprobs(torch.zeros(2, 3, 4), torch.zeros(5, 6), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        head_logprobs(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="needs the context"):
        head_logprobs(
            torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long), repetition_penalty=1.2
        )


# ---- models: the passes ---------------------------------------------------------------------


def tiny_lm(kind="qwen2", vocab=40, tied=False, hidden=32, **extra):
    """A 2-layer causal LM with weights large enough for peaked distributions."""
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "gemma2": (Gemma2Config, Gemma2ForCausalLM),
        "cohere": (CohereConfig, CohereForCausalLM),
    }[kind]
    config = config_class(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=64,
        initializer_range=0.3,
        tie_word_embeddings=tied,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    torch.manual_seed(0)
    return model_class(config).eval()


def batch_of(vocab, prompts=2, group_size=3, p_len=4, t_len=6, seed=0) -> Rollout:
    """G completions of each of `prompts` left-padded prompts (each its own length), some
    ending early (right padding inside the completions)."""
    g = torch.Generator().manual_seed(seed)
    rows, masks, completion_masks = [], [], []
    for i in range(prompts):
        length = p_len - i % p_len  # p_len, p_len - 1, ...
        prompt = torch.randint(3, vocab, (length,), generator=g)
        for _ in range(group_size):
            ends = int(torch.randint(1, t_len + 1, (1,), generator=g))
            completion = torch.randint(3, vocab, (t_len,), generator=g)
            completion[ends:] = 0  # padding after the end
            rows.append(torch.cat([torch.zeros(p_len - length, dtype=torch.long), prompt, completion]))
            masks.append(torch.cat([torch.zeros(p_len - length), torch.ones(length + ends), torch.zeros(t_len - ends)]))
            completion_masks.append(torch.cat([torch.ones(ends), torch.zeros(t_len - ends)]))
    n = prompts * group_size
    return Rollout(
        input_ids=torch.stack(rows),
        attention_mask=torch.stack(masks).long(),
        completion_mask=torch.stack(completion_masks),
        prompts=[""] * n,
        completions=[""] * n,
        rows=[{}] * n,
        group_size=group_size,
    )


def with_bias_head(model):
    """The model with an LM head that has a bias (a few architectures' heads do)."""
    head = model.lm_head
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        model.lm_head.weight.copy_(head.weight)
        model.lm_head.bias.copy_(torch.randn(head.out_features))
    return model


def lora_of(model):
    """LoRA on every linear layer but the head, its B matrices moved off zero so that every
    adapter weight gets a gradient."""
    model = apply_lora(model, r=4, alpha=8.0, target_modules="all-linear")
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
    return model


MODELS = {
    "untied": lambda: tiny_lm("llama"),
    "tied": lambda: tiny_lm("qwen2", tied=True),
    "bias head": lambda: with_bias_head(tiny_lm("llama")),
    "lora, tied": lambda: lora_of(tiny_lm("qwen2", tied=True)),
}


def logprobs_and_grads(model, batch, chunked, share_prompts, weights, **scoring):
    model.zero_grad(set_to_none=True)
    logprobs, ent = completion_logprobs(
        model, batch, share_prompts=share_prompts, chunked_head=chunked, with_entropy=True, **scoring
    )
    ((logprobs * weights) * batch.completion_mask).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return logprobs.detach(), ent, grads


@pytest.mark.parametrize("chunk_rows", [3, None])  # ragged chunks; one chunk (the default size)
@pytest.mark.parametrize("share_prompts", [True, False])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_models_logprobs_and_every_parameters_gradient_equal_the_plain_path(
    name, share_prompts, chunk_rows, monkeypatch
):
    if chunk_rows:
        monkeypatch.setattr(
            layouts, "head_logprobs", functools.partial(head_logprobs, chunk_elements=chunk_rows * 41)
        )  # V + 1
    model = MODELS[name]()
    head = chunkable_head(model)
    assert head is not None  # the chunked path runs
    if "tied" in name and "untied" not in name:
        assert head.weight is model.get_input_embeddings().weight
    vocab = head.out_features
    batch = batch_of(vocab)
    assert (batch.completion_mask == 0).any()
    weights = torch.randn(batch.completion_mask.shape, generator=torch.Generator().manual_seed(3))
    scoring = dict(temperature=0.7, repetition_penalty=1.3)
    got, got_entropy, got_grads = logprobs_and_grads(model, batch, True, share_prompts, weights, **scoring)
    want, want_entropy, want_grads = logprobs_and_grads(model, batch, False, share_prompts, weights, **scoring)
    mask = batch.completion_mask.bool()
    assert_close_scaled(got[mask], want[mask])
    assert_close_scaled(got_entropy[mask], want_entropy[mask], scale=scale_of(want[mask]))
    assert got_grads.keys() == want_grads.keys() and got_grads
    if "lora" in name:
        assert all("lora" in key for key in got_grads)  # only the adapter trains
    for key, expected in want_grads.items():
        assert float(expected.abs().max()) > 0, key  # every parameter is reached
        assert_close_scaled(got_grads[key], expected, BACKWARD, msg=lambda m, key=key: f"{key}: {m}")


def test_the_reference_passes_use_the_chunked_head_and_give_the_plain_numbers():
    """The frozen copy and the LoRA reference (adapter off) in inference mode, as the step runs them."""
    from grpo.train.layouts import no_grad_pass
    from grpo.train.networks import AdapterOff, FrozenCopy

    model = tiny_lm("qwen2", tied=True)
    batch = batch_of(40)
    for reference in (FrozenCopy(model), AdapterOff(lora_of(tiny_lm("qwen2", tied=True)))):
        net = getattr(reference, "model", None) or reference.policy
        assert chunkable_head(net) is not None
        got = no_grad_pass(lambda b: reference.logprobs(b, 0.8, 1.2), batch, 4)  # two micro-batches
        reference.chunked_head = False
        want = no_grad_pass(lambda b: reference.logprobs(b, 0.8, 1.2), batch, 4)
        mask = batch.completion_mask.bool()  # the chunked head computes the completion tokens only
        assert (~mask).any() and not got[~mask].any()
        assert_close_scaled(got[mask], want[mask])


def test_no_pass_makes_a_tensor_of_vocabulary_size_times_positions(monkeypatch):
    """Memory: through the whole forward and backward of a model, the LM head module only ever
    sees an empty slice, and no tensor (of any op, of any dtype) is as large as the (N, T, V)
    logits; the plain path does make them (the probe works)."""
    vocab, hidden = 3000, 16
    model = tiny_lm("qwen2", vocab=vocab, hidden=hidden, tied=True)
    batch = batch_of(vocab, prompts=2, group_size=4, t_len=12)  # N * T = 96 positions > H
    n, t_len = batch.completion_mask.shape
    rows = 4
    monkeypatch.setattr(layouts, "head_logprobs", functools.partial(head_logprobs, chunk_elements=rows * (vocab + 1)))
    head_inputs = []  # what the head module computed on (after any pre-hook)
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: head_inputs.append(args[0].shape))

    class Largest(LargestTensor):  # every dtype, not only float32
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
            return out

    chunkable_head(model)  # the one-off probe (two tokens) runs outside the measurement
    for share_prompts in (True, False):
        head_inputs.clear()
        with Largest() as seen:
            logprobs, _ = completion_logprobs(model, batch, 1.0, 1.3, share_prompts=share_prompts, with_entropy=True)
            logprobs.sum().backward()
        assert head_inputs and all(shape[-2] == 0 for shape in head_inputs)  # the head computed nothing itself
        # The largest tensors are the head's weight and its gradient (V x H) and one chunk's scores.
        assert seen.largest <= max(vocab * hidden, rows * (vocab + 1)), seen.largest
        assert seen.largest < n * t_len * vocab // 4
    with Largest() as naive:
        logprobs, _ = completion_logprobs(model, batch, 1.0, 1.3, chunked_head=False)
        logprobs.sum().backward()
    assert naive.largest >= n * t_len * vocab


# ---- models whose logits are not their head's output ----------------------------------------


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("gemma2", dict(final_logit_softcapping=3.0)),  # cap * tanh(logits / cap)
        ("cohere", dict(logit_scale=0.5)),  # logits * logit_scale
    ],
)
def test_a_model_that_changes_its_heads_output_runs_the_plain_path(kind, extra):
    model = tiny_lm(kind, **extra)
    assert chunkable_head(model) is None
    batch = batch_of(40)
    with torch.no_grad():
        got, _ = completion_logprobs(model, batch, 0.9, chunked_head=True)
        want, _ = completion_logprobs(model, batch, 0.9, chunked_head=False)
        assert torch.equal(got, want)
        # What the check prevents: the head's output alone gives other numbers.
        head = model.get_output_embeddings()
        wrong, _ = head_logprobs(
            layouts.completion_hidden(model, batch), head.weight, batch.completion_ids, temperature=0.9
        )
    assert not torch.allclose(wrong, want, atol=1e-3)


def test_a_head_that_is_not_a_plain_linear_layer_runs_the_plain_path():
    model = apply_lora(tiny_lm("llama"), r=4, alpha=8.0, target_modules=["q_proj", "lm_head"])  # LoRA on the head
    assert chunkable_head(model) is None
    assert chunkable_head(tiny_lm("llama")) is not None


def test_a_model_that_runs_its_head_twice_per_pass_runs_the_plain_path():
    """Which call's input would be the hidden states is ambiguous: the probe says no, and
    reading the head's input directly is a one-line error."""
    from grpo.errors import UserError

    class Twice(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def forward(self, **kwargs):
            self.inner(**kwargs)
            return self.inner(**kwargs)

    model = Twice(tiny_lm("llama"))
    assert chunkable_head(model) is None
    with pytest.raises(UserError, match="ran its LM head 2 times in one forward pass"):
        layouts.completion_hidden(model, batch_of(40), share_prompts=False)


# ---- whole runs -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_a_run_is_the_same_with_the_chunked_head_and_the_full_logits(make_config, tmp_path, lora):
    """Reference, old-policy and update passes and the entropy metric, over steps that move
    the policy: temperature, repetition penalty, two epochs of two minibatches in micro-batches."""

    def run(name, chunked):
        config = make_config(
            output_dir=str(tmp_path / name),
            rollout={"temperature": 0.8, "repetition_penalty": 1.3},
            train={
                "steps": 2,
                "lr": 1e-2,
                "epochs": 2,
                "minibatches": 2,
                "micro_batch_size": 5,
                "chunked_head": chunked,
            },
            lora={"r": 4 if lora else 0, "alpha": 8.0},
        )
        return grpo.train(config, progress=False).metrics

    chunked, full = run("chunked", True), run("full", False)
    for ours, reference in zip(chunked, full, strict=True):
        for key in ("reward/mean", "loss", "kl", "entropy", "grad_norm", "clip_fraction"):
            assert ours[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), key
