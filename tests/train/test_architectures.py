"""Any Hugging Face causal LM trains, exactly: a matrix of tiny models of the common
architectures, each built from its `transformers` config class, saved with `save_pretrained`
and loaded through `from_pretrained` as a user's model is.

For each: every forward layout a step can take (every row in full or a group's prompt once;
with and without activation checkpointing; full logits or the head chunk by chunk) gives the
plain forward's log-probs and gradients to float rounding, the layouts `decide_layouts` keeps
are the ones that ran, `auto` samples with the fast loop where it knows the architecture and
with `generate` otherwise, and GRPO steps run."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import grpo
from grpo.infra import attention
from grpo.rollout import Sampler
from grpo.tasks.tiny import char_tokenizer
from grpo.train.models import activation_checkpointing, enable_checkpointing
from grpo.train.layouts import (
    LAYOUTS,
    PACKED,
    PADDED,
    SHARED,
    chunkable_head,
    completion_logprobs,
    decide_layouts,
)
from tests.algo.test_chunked_head import batch_of
from tests.helpers import BACKWARD, assert_close_scaled, scale_of

pytestmark = pytest.mark.numerics  # compares kernels: `make test` runs it with AVX2 kernels too

TOKENIZER = char_tokenizer("0123456789abc ")
SPECIAL = dict(vocab_size=len(TOKENIZER), pad_token_id=0, bos_token_id=1, eos_token_id=2)
LLAMA_LIKE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
WINDOW = 4  # shorter than the batches below: the sliding-window layers cut what they attend to

# name -> (model_type, config arguments, the sampler `auto` takes)
ARCHITECTURES = {
    "gpt2": ("gpt2", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64), "hf"),
    # Its attention takes another path when the implementation is named "eager" (IMPLEMENTATION):
    # under grpo's attention by segments, named otherwise, it must still give its own numbers.
    "gpt2_upcast": ("gpt2", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, reorder_and_upcast_attn=True), "hf"),
    "gpt_neox": (  # Pythia: rotary on a quarter of each head, parallel attention and MLP
        "gpt_neox",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25),
        "hf",
    ),
    "opt": (  # dropout 0.1 in its config, kept as floats by its layers
        "opt",
        dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32),
        "hf",
    ),
    "phi3": ("phi3", LLAMA_LIKE, "hf"),
    "gemma3": ("gemma3_text", dict(LLAMA_LIKE, head_dim=8, sliding_window=WINDOW), "hf"),
    "mistral": ("mistral", dict(LLAMA_LIKE, sliding_window=WINDOW), "hf"),  # the window outgrown: not fast
    "qwen2": ("qwen2", LLAMA_LIKE, "fast"),
    "qwen3": ("qwen3", dict(LLAMA_LIKE, head_dim=8), "fast"),
    "llama": ("llama", LLAMA_LIKE, "fast"),
    "llama_tied": ("llama", dict(LLAMA_LIKE, tie_word_embeddings=True), "fast"),
    "falcon": ("falcon", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4), "hf"),
    "bloom": ("bloom", dict(hidden_size=32, n_layer=2, n_head=4), "hf"),
}
# Where a group's prompt cannot run once under checkpointing: a sliding-window cache is not one
# whose layers a checkpointed forward can run through twice, so every row runs in full there.
NOT_SHARED_CHECKPOINTED = {"gemma3", "mistral"}
# Loaded with this attention implementation rather than transformers' default.
IMPLEMENTATION = {"gpt2_upcast": "eager"}
# Where the packed layout is not taken: its mask does not cut a sliding window (gemma3,
# mistral), and Bloom builds its ALiBi biases from a 2-D attention mask, not a 4-D one.
NOT_PACKED = {"gemma3", "mistral", "bloom"}
# Packed, but through the mask rather than by segments (grpo.infra.attention): Falcon's decoder
# layer does not hand its keywords on to its attention, so the plan never arrives.
NOT_SEGMENTED = {"falcon"}


def build(name: str) -> torch.nn.Module:
    """A tiny random model of the architecture, its weights large enough that its distributions
    are peaked (a wrong cache row or position changes its log-probs by far more than rounding)."""
    model_type, arguments, _ = ARCHITECTURES[name]
    config = AutoConfig.for_model(model_type, **arguments, **SPECIAL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each architecture saved as a Hugging Face directory (model and tokenizer)."""
    root = tmp_path_factory.mktemp("architectures")
    for name in ARCHITECTURES:
        build(name).save_pretrained(root / name)
        TOKENIZER.save_pretrained(root / name)
    return root


def load(saved, name: str):
    return AutoModelForCausalLM.from_pretrained(saved / name, attn_implementation=IMPLEMENTATION.get(name)).eval()


def passes(model) -> list[tuple[int, int]]:
    """A list that fills with the (rows, columns) of each pass over the model's embeddings."""
    shapes = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    return shapes


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_layout_gives_the_plain_forward_s_log_probs_and_gradients(saved, name, monkeypatch):
    monkeypatch.setattr(attention, "SEGMENTED_FROM", 0)  # the packed passes attend by segments, short as they are
    model = load(saved, name)
    batch = batch_of(len(TOKENIZER), prompts=2, group_size=3, p_len=5, t_len=6)  # 11 columns > WINDOW
    mask = batch.loss_mask.bool()

    def forward(layout: str, chunk: bool, checkpointed: bool):
        model.zero_grad(set_to_none=True)
        with activation_checkpointing(model, checkpointed):
            logprobs = completion_logprobs(model, batch, 0.9, chunked_head=chunk, layout=layout)[0]
        (logprobs * batch.loss_mask).sum().backward()
        return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, plain_grads = forward(PADDED, chunk=False, checkpointed=False)
    assert enable_checkpointing(model)
    decided = decide_layouts(model, True)
    assert decided.checkpointing is True  # checkpointing kept
    taken = PACKED if name not in NOT_PACKED else SHARED
    assert (decided.plain, decided.checkpointed) == (taken, taken)  # both modes
    assert getattr(model, attention._ENABLED, False) == (taken == PACKED and name not in NOT_SEGMENTED)
    assert chunkable_head(model) is not None  # its probe pass, before the passes are counted

    shapes = passes(model)
    for layout in LAYOUTS if taken == PACKED else (SHARED, PADDED):
        for chunk in (False, True):
            for checkpointed in (False, True):
                shapes.clear()
                logprobs, grads = forward(layout, chunk, checkpointed)
                label = f"{name}: {layout} chunked={chunk} checkpointed={checkpointed}"
                assert_close_scaled(logprobs[mask], plain[mask], msg=label)
                assert grads.keys() == plain_grads.keys(), label
                # each to the whole model's gradient scale: some parameters' cancel to rounding
                assert_close_scaled(grads, plain_grads, BACKWARD, scale=scale_of(*plain_grads.values()), msg=label)
                if layout == PACKED:  # one pass over the real tokens: fewer slots than the rows in full
                    assert len(shapes) == 1 and shapes[0][0] * shapes[0][1] < 6 * 11, label
                    continue
                shared = layout == SHARED and not (checkpointed and name in NOT_SHARED_CHECKPOINTED)
                assert shapes == ([(2, 5), (6, 5)] if shared else [(6, 11)]), label  # the passes that ran


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_auto_samples_with_the_fast_loop_where_it_can_and_with_generate_otherwise(saved, name):
    model = load(saved, name)
    rows = [{"prompt": p} for p in ["a", "bc1", "cab 7"]]

    def sample(backend):
        sampler = Sampler(
            TOKENIZER,
            prompt_column="prompt",
            group_size=2,
            backend=backend,
            max_new_tokens=6,
            temperature=0.9,
            draw="generate",
        )
        torch.manual_seed(3)
        return sampler, sampler.sample(model, rows)

    sampler, rollout = sample("auto")
    assert sampler.decoder_name(model, 5) == ARCHITECTURES[name][2]
    assert rollout.completion_ids.shape == (6, 6)
    assert rollout.completion_mask.sum() > 0
    if ARCHITECTURES[name][2] == "fast":  # with rollout.draw: generate, generate's tokens, token for token
        assert torch.equal(rollout.completion_ids, sample("hf")[1].completion_ids)


def distinct(completions, **columns) -> list[float]:
    """A reward that tells the completions of a group apart: their number of distinct characters."""
    return [float(len(set(c))) for c in completions]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_grpo_trains_each_architecture_at_the_defaults(saved, name, prompts_file, tmp_path):
    """A few GRPO steps at the defaults (checkpointing, shared prompts, chunked head, auto):
    they run, and each step moves the weights (a finite loss, a gradient)."""
    result = grpo.train(
        {
            "model": str(saved / name),
            "output_dir": str(tmp_path / "run"),
            "data": {"path": prompts_file},
            "rewards": [{"function": "tests.train.test_architectures:distinct"}],
            "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6, "min_new_tokens": 6},
            "train": {"steps": 2, "lr": 1e-3},
        },
        progress=False,
    )
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        assert torch.isfinite(torch.tensor([m["loss"], m["grad_norm"]])).all() and m["grad_norm"] > 0
    assert type(AutoModelForCausalLM.from_pretrained(result.final_dir)).__name__ == type(load(saved, name)).__name__


def test_a_layout_that_gives_other_numbers_or_fails_is_not_taken(monkeypatch, saved):
    """decide_layouts tries the packed and the shared-prompt layouts once: where one gives other
    log-probs (a planted cache read for the wrong rows, packed slots read for the wrong rows) or
    cannot run, the next is taken, and every row runs in full where neither serves."""
    from grpo.train import layouts

    shared, packed = layouts._shared_prompt_positions, layouts.packed_positions

    def wrong_rows(model, batch, first, group, read, **kwargs):
        return shared(model, batch, first, group.flip(0), read, **kwargs)

    def wrong_slots(model, batch, share_prompts, read, **kwargs):
        return packed(model, batch, share_prompts, read, **kwargs).flip(0)

    def fails(*args, **kwargs):
        raise RuntimeError("a layout this model's code cannot run")

    batch = batch_of(len(TOKENIZER), prompts=2, group_size=3, p_len=5, t_len=6)
    mask = batch.loss_mask.bool()
    for planted_shared, planted_packed, taken in [
        (shared, wrong_slots, SHARED),
        (shared, fails, SHARED),
        (wrong_rows, wrong_slots, PADDED),
        (fails, fails, PADDED),
    ]:
        model = load(saved, "llama")
        with torch.no_grad():
            plain = completion_logprobs(model, batch, 1.0, layout=PADDED)[0]
        monkeypatch.setattr(layouts, "_shared_prompt_positions", planted_shared)
        monkeypatch.setattr(layouts, "packed_positions", planted_packed)
        assert enable_checkpointing(model)
        decided = decide_layouts(model, True)
        assert decided.checkpointing is True and (decided.plain, decided.checkpointed) == (taken, taken)
        shapes = passes(model)
        for checkpointed in (False, True):
            with activation_checkpointing(model, checkpointed):
                logprobs = completion_logprobs(model, batch, 1.0, layout=decided.layout(checkpointed))[0]
            assert_close_scaled(logprobs.detach()[mask], plain[mask])
        assert shapes == ([(6, 11)] * 2 if taken == PADDED else [(2, 5), (6, 5)] * 2)  # the passes that ran
        monkeypatch.undo()


def test_a_model_that_computes_otherwise_in_training_mode_trains_without_checkpointing(saved, capsys):
    """A layer that behaves otherwise in training mode (a dropout of its own, not one grpo can
    switch off): checkpointing, which runs the policy's forward in training mode, is not taken."""
    model = load(saved, "qwen2")
    layer = model.model.layers[0]
    layer.register_forward_hook(lambda m, args, out: out + 0.5 if m.training else out)
    assert enable_checkpointing(model)
    decided = decide_layouts(model, True)
    assert decided.checkpointing is False
    assert "train.gradient_checkpointing: Qwen2ForCausalLM computes other log-probs" in capsys.readouterr().err
    assert not layer.gradient_checkpointing  # off in the model: its forward in training mode is never taken
    assert (decided.plain, decided.checkpointed) == (PACKED, PADDED)
