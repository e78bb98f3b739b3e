"""The fast decoding loop computes what `generate` computes: same logits, same tokens, same
random stream, for every option a run can set."""

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import grpo
from grpo.errors import UserError
from grpo.rollout import Sampler, fast
from grpo.tasks.tiny import char_tokenizer
from grpo.train.layouts import policy_logprobs
from tests.helpers import assert_close_scaled

TOKENIZER = char_tokenizer("0123456789abc ")
EOS = TOKENIZER.eos_token_id
# Prompts of different lengths, so the batch is left-padded.
ROWS = [{"prompt": p} for p in ["a", "bc1", "cab 7", "9"]]
# Every sampling option a run can set, alone and together, and chunked sampling.
OPTIONS = [
    {},
    {"temperature": 0.7, "top_k": 5},
    {"top_p": 0.8, "min_new_tokens": 3},
    {"batch_size": 6},
    {"min_p": 0.3, "temperature": 1.5},
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.6, "batch_size": 6},
    {"temperature": 1.4, "top_k": 4, "top_p": 0.9, "min_p": 0.2, "repetition_penalty": 1.5, "min_new_tokens": 3},
]
OPTION_IDS = [
    "plain",
    "temperature-top-k",
    "top-p-min-new",
    "chunks",
    "min-p",
    "repetition",
    "repetition-below-1",
    "all",
]


def model_of(kind="llama", kv_heads=4, init=0.3, eos_bias=0.0):
    """A 2-layer model whose weights are large enough that its distributions are peaked:
    tokens drawn from a slightly wrong distribution would differ."""
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[kind]
    config = config_class(
        vocab_size=len(TOKENIZER),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        initializer_range=init,
        tie_word_embeddings=False,
        pad_token_id=TOKENIZER.pad_token_id,
        bos_token_id=TOKENIZER.bos_token_id,
        eos_token_id=EOS,
    )
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:  # norms start at 1: make each one matter (and differ from the others)
                weight.copy_(1 + 0.3 * torch.randn_like(weight))
        model.lm_head.weight[EOS] += eos_bias * model.model.norm.weight  # favours EOS from every state
    return model


def drawn_from(stream, seed, draw):
    """`draw(generator)` from a stream seeded with `seed`: the global one (generator None),
    or with stream "generator" a torch.Generator of its own, the global stream left as it
    was. Returns what it drew and a draw from the stream after."""
    if stream == "global":
        torch.manual_seed(seed)
        return draw(None), torch.rand(3)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(12345)
    out = draw(generator)
    after = torch.rand(3)
    torch.manual_seed(12345)
    assert torch.equal(after, torch.rand(3))  # the global stream did not move
    return out, torch.rand(3, generator=generator)


def generate_drawn(backend: str, **options) -> Sampler:
    """A sampler of 4 completions a row, 12 new tokens unless `options` say otherwise, drawing
    generate's tokens (rollout.draw: generate, which generate honours too)."""
    options = {"max_new_tokens": 12, "draw": "generate", **options}
    return Sampler(TOKENIZER, prompt_column="prompt", group_size=4, backend=backend, **options)


def sample_both(model, seed=1, stream="global", **options):
    """Sample ROWS with each backend from the same seed, the fast loop drawing generate's bits
    (rollout.draw: generate, which generate honours too); also one draw from the stream after."""
    out = {}
    for backend in ("hf", "fast"):
        sampler = generate_drawn(backend, **options)
        assert sampler.decoder_name(model, 5) == backend
        out[backend] = drawn_from(stream, seed, lambda g: sampler.sample(model, ROWS, generator=g))
    return out


@pytest.mark.parametrize("kind,kv_heads", [("llama", 4), ("llama", 2), ("qwen2", 2), ("qwen3", 2)])
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("stream", ["global", "generator"])
def test_fast_draws_the_same_tokens_as_generate(kind, kv_heads, options, stream):
    out = sample_both(model_of(kind, kv_heads), stream=stream, **options)
    (hf, hf_after), (ours, ours_after) = out["hf"], out["fast"]
    assert torch.equal(ours.input_ids, hf.input_ids)
    assert torch.equal(ours.completion_mask, hf.completion_mask)
    assert ours.completions == hf.completions
    assert torch.equal(ours_after, hf_after)  # the random stream was consumed identically
    # The test means something: the samples are not all alike.
    assert len(set(ours.completions)) > len(ROWS)


def test_the_fast_draw_packs_its_weights_and_generates_draw_never_does(monkeypatch):
    """On a CPU in float32 the fast draw's decoder holds its stacked q/k/v and gate/up weights
    oneDNN-packed (its few-row matmuls stream them faster); generate's draw keeps the plain
    ones, and a decode that asks for generate's draw with packed weights in hand draws with
    plain ones all the same."""
    if not fast.forward.packs(torch.float32, torch.device("cpu")):
        pytest.skip("this torch has no oneDNN packed inner product")
    model = model_of()
    assert not fast.fuse_weights(model, torch.float32, pack=True).packed  # its matrices stay in the cache: not packed
    monkeypatch.setattr(fast.forward, "PACK_FROM", 0)  # packed here all the same
    fast_decoder = Sampler(TOKENIZER, prompt_column="prompt", group_size=3, max_new_tokens=6, backend="fast").decoder(
        model, 8
    )
    fast_decoder.prepare(model, 0)
    assert fast_decoder.weights.packed
    generate_decoder = generate_drawn("fast").decoder(model, 8)
    generate_decoder.prepare(model, 0)
    assert not generate_decoder.weights.packed
    TOKENIZER.padding_side = "left"
    enc = TOKENIZER(["a", "bc1"], padding=True, return_tensors="pt")
    counts = torch.tensor([3, 3])

    linear, seen = fast.forward._linear, []

    def recording(x, weight, *args):
        seen.append(isinstance(weight, fast.forward._Packed))
        return linear(x, weight, *args)

    monkeypatch.setattr(fast.forward, "_linear", recording)

    def decoded(weights, params):
        seen.clear()
        generator = torch.Generator().manual_seed(5)
        ids = fast.decode(
            model, enc["input_ids"], enc["attention_mask"], counts, params, weights=weights, generators=[generator]
        )[0]
        return ids, set(seen)

    assert True in decoded(fast_decoder.weights, fast_decoder.params)[1]  # q/k/v and gate/up through the packed weights
    got, used = decoded(fast_decoder.weights, generate_decoder.params)  # packed weights, generate's draw
    assert used == {False}
    assert torch.equal(got, decoded(generate_decoder.weights, generate_decoder.params)[0])


def test_single_matrices_are_packed_in_order_as_far_as_the_room_goes(monkeypatch):
    """The head first, then every layer's down projection, then every output projection, each
    kind whole or not at all, each where its copies fit in what the kinds before left of the
    room; none where the weights are not the fast draw's, and none twice."""
    if not fast.forward.packs(torch.float32, torch.device("cpu")):
        pytest.skip("this torch has no oneDNN packed inner product")
    monkeypatch.setattr(fast.forward, "PACK_FROM", 0)
    model = model_of()
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    head = size(model.lm_head.weight)
    down = sum(size(layer.mlp.down_proj.weight) for layer in model.model.layers)
    out = sum(size(layer.self_attn.o_proj.weight) for layer in model.model.layers)

    def packed(room, pack=True):
        w = fast.fuse_weights(model, torch.float32, pack=pack)
        kinds = fast.pack_single_matrices(w, room)
        layers = [
            (isinstance(layer.down, fast.forward._Packed), isinstance(layer.out, fast.forward._Packed))
            for layer in w.layers
        ]
        assert len(set(layers)) == 1  # every layer alike
        assert layers[0] == ("down" in kinds, "out" in kinds)
        assert isinstance(w.head, fast.forward._Packed) == ("head" in kinds)
        return kinds, w

    assert packed(head - 1)[0] == []
    assert packed(head)[0] == ["head"]
    assert out < down
    assert packed(head + down - 1)[0] == ["head", "out"]  # the down projections do not fit; the outputs do
    assert packed(head + down + out - 1)[0] == ["head", "down"]
    assert packed(head + down + out)[0] == ["head", "down", "out"]
    assert packed(1 << 30, pack=False)[0] == []  # generate's draw: plain weights
    kinds, w = packed(1 << 30)
    assert fast.pack_single_matrices(w, 1 << 30) == []  # already packed


def test_the_fast_decoder_packs_single_matrices_only_within_its_spare_memory(monkeypatch):
    """FastDecoder packs the head (and more) at a version's first decode only where the copy fits
    in spare_bytes less the call's own sampling memory (`fast.sampling_bytes`); with no spare
    memory nothing more is packed; the tokens drawn either way are the fast draw's, and
    `exact_logprobs` still holds (float32 weights)."""
    if not fast.forward.packs(torch.float32, torch.device("cpu")):
        pytest.skip("this torch has no oneDNN packed inner product")
    monkeypatch.setattr(fast.forward, "PACK_FROM", 0)
    model = model_of()
    TOKENIZER.padding_side = "left"
    enc = TOKENIZER(["a", "bc1"], padding=True, return_tensors="pt")
    counts = torch.tensor([3, 3])
    head = model.lm_head.weight.numel() * 4

    def decoder(spare):
        sampler = Sampler(TOKENIZER, prompt_column="prompt", group_size=3, max_new_tokens=6, backend="fast")
        sampler.decoder_options = {"fast": {"spare_bytes": spare}}
        made = sampler.decoder(model, 8)
        made.prepare(model, 0)
        own = fast.sampling_bytes(made.weights, 2, enc["input_ids"].shape[1], 6, 6)  # prompts too short to share
        ids, _ = made.decode(enc["input_ids"], enc["attention_mask"], counts, [torch.Generator().manual_seed(3)])
        return made, own, ids

    made, own, ids = decoder(0)
    assert not isinstance(made.weights.head, fast.forward._Packed)
    assert own > 0
    made, _, _ = decoder(own + head - 1)  # the head's copy does not fit beside the sampling's own
    assert not isinstance(made.weights.head, fast.forward._Packed)
    made, _, packed_ids = decoder(own + head)
    assert isinstance(made.weights.head, fast.forward._Packed)
    assert made.exact_logprobs()
    assert packed_ids.shape == ids.shape
    made.prepare(model, 1)  # a new version: built plain again, sized at its first decode
    assert not isinstance(made.weights.head, fast.forward._Packed)
    made.decode(enc["input_ids"], enc["attention_mask"], counts, [torch.Generator().manual_seed(3)])
    assert isinstance(made.weights.head, fast.forward._Packed)


def test_fast_stops_when_every_row_has_ended_as_generate_does():
    out = sample_both(model_of(eos_bias=4.0))
    (hf, hf_after), (ours, ours_after) = out["hf"], out["fast"]
    assert hf.completion_mask.shape[1] < 12  # every row ended early
    assert (hf.completion_mask.sum(1) < hf.completion_mask.shape[1]).any()  # at different lengths
    assert torch.equal(ours.input_ids, hf.input_ids)
    assert torch.equal(ours.completion_mask, hf.completion_mask)
    assert torch.equal(ours_after, hf_after)


@pytest.mark.numerics
@pytest.mark.parametrize("pack", [False, True, "singles"])
@pytest.mark.parametrize("kind,kv_heads", [("llama", 2), ("qwen2", 2), ("qwen3", 2)])
def test_fast_logits_equal_the_models_own(kind, kv_heads, pack, monkeypatch):
    """Prefill and several decoding steps against the model's forward over the whole sequence;
    with `pack`, the stacked matmuls through oneDNN's packed weights (the fast draw's layout on
    a CPU; packed here whatever their size); "singles": the head, down and output projections
    packed too (`pack_single_matrices`, given room for them)."""
    monkeypatch.setattr(fast.forward, "PACK_FROM", 0)
    model = model_of(kind, kv_heads)
    TOKENIZER.padding_side = "left"
    enc = TOKENIZER(["a", "bc1", "cab 7"], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]  # (3, 5), left-padded
    extra = torch.randint(4, len(TOKENIZER), (3, 4))
    full_ids = torch.cat([ids, extra], 1)
    full_mask = torch.cat([mask, torch.ones_like(extra)], 1)
    positions = (full_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions).logits  # (3, 9, V)
        w = fast.fuse_weights(model, torch.float32, pack=bool(pack))
        packs = fast.forward.packs(torch.float32, torch.device("cpu"))
        assert w.packed == (bool(pack) and packs)
        if pack == "singles":
            assert fast.pack_single_matrices(w, 1 << 30) == (["head", "down", "out"] if packs else [])
            assert isinstance(w.head, fast.forward._Packed) == packs
        total = full_ids.shape[1]
        cos, sin = model.model.rotary_emb(w.embed[:1], torch.arange(total)[None])
        cos, sin = cos[0], sin[0]
        cache = fast.forward._Cache(w, 3, total)
        p = ids.shape[1]
        valid = full_mask.bool()
        causal = torch.ones(p, p, dtype=torch.bool).tril()
        prefill_mask = (causal & (valid[:, None, :p] | torch.eye(p, dtype=torch.bool)))[:, None]
        got = [
            fast.forward._forward(
                w, ids, cos[positions[:, :p]][:, None], sin[positions[:, :p]][:, None], cache, 0, prefill_mask
            )
        ]
        for t in range(extra.shape[1]):
            at = p + t
            pos = positions[:, at]
            got.append(
                fast.forward._forward(
                    w,
                    full_ids[:, at : at + 1],
                    cos[pos][:, None, None],
                    sin[pos][:, None, None],
                    cache,
                    at,
                    valid[:, None, None, : at + 1],
                )
            )
    assert_close_scaled(torch.stack(got, 1), expected[:, p - 1 :])


@pytest.mark.numerics
@pytest.mark.parametrize("kind,kv_heads", [("llama", 4), ("llama", 2), ("qwen2", 2), ("qwen3", 1)])
def test_rows_reading_their_prompts_one_copy_get_the_models_own_logits(kind, kv_heads):
    """A shared cache (`_Cache.share`: each prompt's keys and values once, its rows' own after
    them) against the model's forward over each row's whole sequence: prompts of 3, 1 and 2
    rows (left-padded, grouped-query heads or not), each row going on with its own tokens;
    halfway, rows leave (`keep`), all of the second prompt's among them, so that its prompt
    leaves the prefix and the others' are renumbered."""
    model = model_of(kind, kv_heads)
    TOKENIZER.padding_side = "left"
    enc = TOKENIZER(["a", "bc1", "cab 7"], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]  # (3, 5), left-padded
    counts = torch.tensor([3, 1, 2])
    torch.manual_seed(1)
    extra = torch.randint(4, len(TOKENIZER), (6, 4))  # each row's own tokens
    full_ids = torch.cat([ids.repeat_interleave(counts, 0), extra], 1)
    full_mask = torch.cat([mask.repeat_interleave(counts, 0), torch.ones_like(extra)], 1)
    positions = (full_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions).logits  # (6, 9, V)
        w = fast.fuse_weights(model, torch.float32)
        p = ids.shape[1]
        cos, sin = model.model.rotary_emb(w.embed[:1], torch.arange(full_ids.shape[1])[None])
        cos, sin = cos[0], sin[0]
        cache = fast.forward._Cache(w, 3, p)
        valid = mask.bool()
        causal = torch.ones(p, p, dtype=torch.bool).tril()
        prefill_mask = (causal & (valid[:, None, :] | torch.eye(p, dtype=torch.bool)))[:, None]
        first = fast.forward._forward(
            w,
            ids,
            cos[positions[[0, 3, 4], :p]][:, None],
            sin[positions[[0, 3, 4], :p]][:, None],
            cache,
            0,
            prefill_mask,
        )
        assert_close_scaled(first, expected[[0, 3, 4], p - 1])
        cache.share(counts, p, extra.shape[1])
        rows = torch.arange(6)
        for t in range(extra.shape[1]):
            if t == 2:  # rows 1 and 3 (the second prompt's only row) leave
                rows = torch.tensor([0, 2, 4, 5])
                cache.keep(torch.tensor([0, 2, 4, 5]), p + t)
                assert cache.prefix.keys.shape[1] == 2 and cache.prefix.owner.tolist() == [0, 0, 1, 1]
            at = p + t
            pos = positions[rows, at]
            got = fast.forward._forward(
                w,
                full_ids[rows, at : at + 1],
                cos[pos][:, None, None],
                sin[pos][:, None, None],
                cache,
                at,
                full_mask.bool()[rows, None, None, : at + 1],
            )
            assert_close_scaled(got, expected[rows, at])


@pytest.mark.numerics
@pytest.mark.parametrize("options", OPTIONS[:3] + OPTIONS[5:6], ids=OPTION_IDS[:3] + OPTION_IDS[5:6])
def test_the_fast_draw_reads_each_prompt_once_and_draws_what_a_copy_a_row_draws(options, monkeypatch):
    """The fast draw's rows read their prompt's keys and values from one copy (`shares_prompts`)
    and draw the same tokens, with the same log-probs to float rounding, as with a copy of
    the prompt's cache a row; rows finishing early leave the loop meanwhile. Generate's draw
    never shares (its tokens are generate's bit for bit)."""
    model = model_of(eos_bias=1.5)
    shared = []
    share = fast.forward._Cache.share
    monkeypatch.setattr(fast.forward._Cache, "share", lambda self, *a: shared.append(a) or share(self, *a))

    def draw(shares):
        monkeypatch.setattr(fast.decoding, "SHARE_FROM", 1 if shares else 1 << 60)
        sampler = Sampler(TOKENIZER, prompt_column="prompt", group_size=4, max_new_tokens=12, backend="fast", **options)
        return sampler.sample(model, ROWS, generator=torch.Generator().manual_seed(5))

    alone = draw(False)
    assert not shared
    together = draw(True)
    assert len(shared) == 1
    assert torch.equal(together.completion_ids, alone.completion_ids)
    assert (together.completion_mask.sum(1) < 12).any()  # some rows finished early
    assert_close_scaled(together.sampled_logprobs, alone.sampled_logprobs)
    monkeypatch.undo()
    # By sizes: the copies beyond a prompt's first row hold SHARE_FROM bytes a layer or more.
    w = fast.fuse_weights(model_of(kv_heads=2), torch.float32)
    fast_draw = Sampler(TOKENIZER, prompt_column="prompt", group_size=4, max_new_tokens=12, backend="fast").params
    per_position = 2 * 2 * 16 * 4  # keys and values, 2 heads of 16, float32
    at = -(-fast.decoding.SHARE_FROM // (6 * per_position))  # positions for 6 copies to reach it
    assert fast_draw.fast_draw and fast.shares_prompts(w, fast_draw, torch.tensor([4, 4]), at)
    assert not fast.shares_prompts(w, fast_draw, torch.tensor([4, 4]), at - 1)
    assert not fast.shares_prompts(w, fast_draw, torch.tensor([4, 3, 0]), at)  # 5 copies
    assert not fast.shares_prompts(w, fast_draw, torch.tensor([1, 1]), 1 << 30)  # a row a prompt: nothing to share
    assert not fast.shares_prompts(
        w, fast_draw, torch.tensor([4, 4]), at, keep=True
    )  # a kept cache holds each row's all
    assert not fast.shares_prompts(w, generate_drawn("fast").params, torch.tensor([4, 4]), at)


@pytest.mark.numerics
def test_bf16_decoding_stays_close_to_float32():
    model = model_of()
    ids = TOKENIZER(["cab 7"], return_tensors="pt")["input_ids"]
    w32, w16 = fast.fuse_weights(model, torch.float32), fast.fuse_weights(model, torch.bfloat16)
    assert w16.layers[0].qkv.dtype == torch.bfloat16
    cos, sin = model.model.rotary_emb(w32.embed[:1], torch.arange(ids.shape[1])[None])
    logits = {}
    for name, w in (("32", w32), ("16", w16)):
        cache = fast.forward._Cache(w, 1, ids.shape[1])
        logits[name] = fast.forward._forward(w, ids, cos[:, None], sin[:, None], cache, 0, None).float()
    assert not torch.equal(logits["32"], logits["16"])
    torch.testing.assert_close(logits["16"].softmax(-1), logits["32"].softmax(-1), atol=0.03, rtol=0)


def test_unsupported_models_fall_back_to_generate_or_say_why():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(TOKENIZER), n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert "gpt2" in fast.supported(gpt2, 20)
    auto = Sampler(TOKENIZER, prompt_column="prompt", group_size=2, max_new_tokens=4)
    assert auto.decoder_name(gpt2, 5) == "hf"
    assert auto.sample(gpt2, ROWS[:2]).completion_mask.shape == (4, 4)
    forced = Sampler(TOKENIZER, prompt_column="prompt", group_size=2, max_new_tokens=4, backend="fast")
    with pytest.raises(UserError, match="fast cannot decode this model: model type 'gpt2'"):
        forced.sample(gpt2, ROWS[:2])
    with pytest.raises(UserError, match="unknown backend"):
        Sampler(TOKENIZER, prompt_column="prompt", group_size=2, max_new_tokens=4, backend="sglang")


def test_a_run_is_the_same_with_either_sampler(make_config, tmp_path):
    """Whole steps: the same samples, rewards, losses and KL with the fast loop as with generate."""
    runs = {
        backend: grpo.train(
            make_config(
                output_dir=str(tmp_path / backend),
                rollout={"sampler": backend, "draw": "generate"},
                train={"steps": 3, "lr": 1e-3},
            ),
            progress=False,
        ).metrics
        for backend in ("hf", "fast")
    }
    for hf, ours in zip(runs["hf"], runs["fast"], strict=True):
        for key in ("reward/mean", "loss", "kl", "entropy", "grad_norm"):
            assert ours[key] == pytest.approx(hf[key], rel=1e-5, abs=1e-7), key


def test_a_models_own_sampling_defaults_do_not_leak_into_generate():
    """A hub chat model's generation_config.json may set a repetition penalty or min_p; both
    loops sample with the run's own options only (those the loss scores)."""
    model = model_of()
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.no_repeat_ngram_size = 2
    model.generation_config.min_p = 0.5
    out = sample_both(model, temperature=1.5)
    assert torch.equal(out["fast"][0].input_ids, out["hf"][0].input_ids)


@pytest.mark.numerics
@pytest.mark.parametrize("backend", ["fast", "hf"])
@pytest.mark.parametrize("penalty", [1.8, 0.6])
def test_the_loss_scores_the_distribution_each_token_was_drawn_from(backend, penalty, monkeypatch):
    """With a repetition penalty, the log-prob the loss computes for each sampled token (one
    forward pass over prompt + completion, grpo.train.models.policy_logprobs) is log softmax of
    the scores the sampler drew that token from: the fast loop's `process`, generate's scores."""
    model = model_of(eos_bias=1.0)  # rows end at different steps
    steps = []  # (N, V) processed scores (or their log-softmax) per decoding step
    if backend == "fast":  # the unfinished rows' probabilities at each draw (finished rows get ones, masked out below)
        monkeypatch.setattr(fast.decoding, "_draw", recording_draws(steps, fill=1.0, log=True))
    else:
        generate = model.generate

        def recording(**kwargs):
            out = generate(**kwargs, output_scores=True, return_dict_in_generate=True)
            steps.extend(out.scores)
            return out.sequences

        monkeypatch.setattr(model, "generate", recording)
    sampler = generate_drawn(backend, temperature=0.8, repetition_penalty=penalty)
    torch.manual_seed(1)
    rollout = sampler.sample(model, ROWS)
    drawn = torch.stack(steps, 1).log_softmax(-1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)  # (N, T)
    with torch.no_grad():
        scored = policy_logprobs(model, rollout, 0.8, penalty)  # (N, T)
        unpenalized = policy_logprobs(model, rollout, 0.8)
    valid = rollout.completion_mask.bool()
    assert_close_scaled(scored[valid], drawn[valid])  # the logits agree to float rounding
    assert (unpenalized[valid] - drawn[valid]).abs().max() > 0.1  # the penalty matters here


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_seeded_prompts_draw_the_same_completions_whatever_is_sampled_beside_them(backend):
    """rollout.seed_per_prompt: a prompt's G completions depend on its seed only, not on the
    other prompts of the call, their order, or how the rows are chunked; the global stream
    is left alone."""
    model = model_of(eos_bias=1.0)  # rows end at different steps
    seeds = [11, 22, 33, 44]

    def sample(rows, row_seeds, batch_size=0):
        sampler = Sampler(
            TOKENIZER,
            prompt_column="prompt",
            group_size=3,
            max_new_tokens=10,
            backend=backend,
            draw="generate",
            batch_size=batch_size,
            temperature=1.3,
        )
        torch.manual_seed(123)
        rollout = sampler.sample(model, rows, row_seeds)
        after = torch.rand(2)
        torch.manual_seed(123)
        assert torch.equal(after, torch.rand(2))  # the global stream did not move
        return [rollout.completions[i : i + 3] for i in range(0, len(rollout), 3)]

    together = sample(ROWS, seeds)
    assert together == sample(ROWS, seeds, batch_size=4)  # chunks of whole prompts (4 rounds down to 3)
    assert together[::-1] == sample(ROWS[::-1], seeds[::-1])
    for i in range(len(ROWS)):
        assert sample([ROWS[i]], [seeds[i]]) == [together[i]]
    assert together != sample(ROWS, [s + 1 for s in seeds])  # the seed is what decides
    assert any(len(set(group)) > 1 for group in together)  # a group's completions differ from each other


# eos_bias per model (test_fast_draws_the_same_tokens_as_generate's four) under which, at 24
# new tokens, most completions end within a few tokens and a few run to (or near) the limit.
SPREAD = {("llama", 4): 0.0, ("llama", 2): 0.5, ("qwen2", 2): -0.5, ("qwen3", 2): 1.0}


def recording_draws(into: list, fill: float, log: bool = False):
    """fast.draws._draw that also appends each draw's distributions (or their log) to `into`, at their
    rows of the whole batch (n, V); finished rows get `fill`."""
    draw = fast.draws._draw

    def recording(probs, rows, segments, *rest):
        full = probs.new_full((segments[-1][1], probs.shape[1]), fill).index_copy_(0, rows, probs)
        into.append(full.log() if log else full)
        return draw(probs, rows, segments, *rest)

    return recording


def sample_compacting(model, backend="fast", compact_at=None, seeds=None, stream="global", **options):
    """Sample ROWS (G = 4, up to 24 new tokens) with fast.decoding.COMPACT_AT = `compact_at` (None: every row decoded to the end).
    Returns the rollout, the probabilities of each full-batch draw (N, V) per step (fast only),
    and a draw from the stream after (the global one, or with stream "generator" the sample's own)."""
    draws = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast.decoding, "COMPACT_AT", compact_at)
        mp.setattr(fast.decoding, "_draw", recording_draws(draws, fill=0.0))
        sampler = Sampler(
            TOKENIZER,
            prompt_column="prompt",
            group_size=4,
            max_new_tokens=24,
            backend=backend,
            **{"draw": "generate", **options},
        )
        rollout, after = drawn_from(stream, 1, lambda g: sampler.sample(model, ROWS, seeds, generator=g))
    return rollout, draws, after


def assert_same_samples(got, expected, compare_draws=True):
    (rollout, draws, after), (expected_rollout, expected_draws, expected_after) = got, expected
    assert torch.equal(rollout.input_ids, expected_rollout.input_ids)
    assert torch.equal(rollout.completion_mask, expected_rollout.completion_mask)
    assert torch.equal(after, expected_after)  # the random stream was consumed identically
    if compare_draws:  # each row's distribution while it decodes, to float rounding (finished rows' are stale)
        assert len(draws) == len(expected_draws)
        for step, (probs, expected_probs) in enumerate(zip(draws, expected_draws)):
            live = rollout.completion_mask[:, step].bool()  # one call (no batch_size): rows are in order
            torch.testing.assert_close(probs[live], expected_probs[live], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind,kv_heads", list(SPREAD))
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("stream", ["global", "generator"])
def test_finished_rows_leave_the_loop_and_the_tokens_stay_the_same(kind, kv_heads, options, stream):
    """Completions ending at very different lengths: the loop that drops finished rows (the
    cache copied at every finish, at the default fraction, never) draws the tokens generate
    and the loop that decodes every row to the end draw, and consumes the same random numbers
    (the global stream's, or a generator's)."""
    options = {**options, "stream": stream}
    model = model_of(kind, kv_heads, eos_bias=SPREAD[kind, kv_heads])
    hf = sample_compacting(model, "hf", **options)
    every_row = sample_compacting(model, compact_at=None, **options)
    assert_same_samples(every_row, hf, compare_draws=False)
    lengths = hf[0].completion_mask.sum(1)
    assert lengths.max() >= 3 * lengths.min()  # rows end at very different lengths
    assert (lengths <= lengths.max() / 2).sum() >= len(lengths) // 4
    assert len(set(hf[0].completions)) > len(ROWS)
    for compact_at in (0.0, fast.decoding.COMPACT_AT, 1.0):
        assert_same_samples(
            sample_compacting(model, compact_at=compact_at, **options),
            every_row,
            compare_draws="batch_size" not in options,
        )


@pytest.mark.parametrize("seeds,stream", [(None, "global"), (None, "generator"), ([11, 22, 33, 44], "global")])
def test_the_full_batch_draw_off_the_cpu_draws_the_same_tokens(seeds, stream, monkeypatch):
    """The path GPUs take (fast.decoding.SKIP_FINISHED_DRAWS off: one multinomial over every row, the
    finished rows from their last distribution), run on the CPU: generate's tokens, with rows
    leaving the loop at the default fraction."""
    model = model_of("qwen2", 2, eos_bias=SPREAD["qwen2", 2])
    hf = sample_compacting(model, "hf", seeds=seeds, stream=stream)
    monkeypatch.setattr(fast.decoding, "SKIP_FINISHED_DRAWS", False)
    ours = sample_compacting(model, compact_at=fast.decoding.COMPACT_AT, seeds=seeds, stream=stream)
    assert_same_samples(ours, hf, compare_draws=False)
    lengths = hf[0].completion_mask.sum(1)
    assert lengths.max() >= 3 * lengths.min()  # rows finish at very different steps


@pytest.mark.parametrize("compact_at", [0.0, 0.25, 1.0])
def test_seeded_prompts_draw_the_same_tokens_when_finished_rows_leave(compact_at):
    """rollout.seed_per_prompt: each prompt's generator still draws over all its rows, finished
    ones included, in one call and in chunks of whole prompts."""
    model = model_of("qwen3", 2, eos_bias=1.0)
    seeds = [11, 22, 33, 44]
    for options in ({"temperature": 1.3}, {"batch_size": 8, "repetition_penalty": 1.5}):
        hf = sample_compacting(model, "hf", seeds=seeds, **options)
        every_row = sample_compacting(model, compact_at=None, seeds=seeds, **options)
        dropping = sample_compacting(model, compact_at=compact_at, seeds=seeds, **options)
        assert_same_samples(every_row, hf, compare_draws=False)
        assert_same_samples(dropping, every_row, compare_draws="batch_size" not in options)
        lengths = hf[0].completion_mask.sum(1)
        assert lengths.max() >= 3 * lengths.min() and (lengths <= lengths.max() / 2).sum() >= len(lengths) // 4


@pytest.mark.parametrize("compact_at", [None, 0.0, 0.25, 1.0])
def test_the_layers_and_the_lm_head_see_fewer_rows_as_rows_finish(compact_at, monkeypatch):
    """The rows each decoding step's forward runs through the layers (the cache's rows) and
    through the LM head: after a row's EOS the head never sees it; the cache drops it at the
    next copy, which comes once finished rows make up COMPACT_AT of the cache's rows."""
    model = model_of("qwen2", 2, eos_bias=1.0)  # 8 of 16 rows end at once, the rest one by one
    calls = []  # (rows through the layers, rows through the head) per forward
    forward = fast.forward._forward

    def counting(w, ids, *args, heads=None, **options):
        calls.append((ids.shape[0], ids.shape[0] if heads is None else len(heads)))
        return forward(w, ids, *args, heads=heads, **options)

    monkeypatch.setattr(fast.decoding, "_forward", counting)
    rollout, _, _ = sample_compacting(model, compact_at=compact_at)
    lengths = rollout.completion_mask.sum(1).long()
    n, steps = rollout.completion_mask.shape
    assert calls[0] == (len(ROWS), len(ROWS))  # the prefill: once per distinct prompt
    decoding = calls[1:]
    assert len(decoding) == steps - 1
    # Decoding call k computes the logits of step k: the rows still decoding then.
    running = [int((lengths > k).sum()) for k in range(1, steps)]
    assert running[0] <= n / 2 and running[-1] <= n / 4  # most rows finished well before the last step
    layers, head = zip(*decoding)
    if compact_at is None:
        assert layers == head == (n,) * (steps - 1)
        return
    assert list(head) == running
    if compact_at == 0.0:
        assert list(layers) == running
    elif compact_at == 1.0:
        assert layers == (n,) * (steps - 1)
    else:
        assert all(held - live < compact_at * held for held, live in zip(layers, running))
        assert list(layers) == sorted(layers, reverse=True) and layers[-1] < n / 2
        assert len(set(layers)) < len(set(running))  # fewer copies than steps where rows finish


def test_the_vectorised_exponential_draws_exponential_s_numbers_and_consumes_as_much():
    """fast.draws._exponential against Tensor.exponential_ (the draw inside torch.multinomial), bit
    for bit over 4M numbers, and the stream left in the same place; a skip of k numbers leaves
    it where k exponential draws do."""
    for seed in (0, 1234):
        g, expected_g = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        got = fast.draws._exponential((32, 131072), g)
        expected = torch.empty(32, 131072).exponential_(generator=expected_g)
        assert torch.equal(got, expected)
        fast.draws._skip(1000, g)
        torch.empty(1000).exponential_(generator=expected_g)
        assert torch.equal(g.get_state(), expected_g.get_state())


@pytest.mark.parametrize("seeded", [False, "one", True])
def test_a_draw_over_the_unfinished_rows_is_multinomials_over_every_row(seeded):
    """fast.draws._draw given the unfinished rows only: the tokens torch.multinomial draws for them
    over the whole batch, and the stream (global, one generator's, or each prompt's
    generator) left where multinomial leaves it, for every pattern of finished rows, with
    runs of both kinds."""
    n, vocab = 12, 1000
    counts = [3, 5, 4]
    probs = torch.softmax(torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3, -1)
    patterns = [list(range(n)), [0], [n - 1], [2, 3, 4, 9], [1, 5, 6, 7, 11], [4]]
    patterns += [
        torch.randperm(n, generator=torch.Generator().manual_seed(s))[: 1 + s % n].sort().values.tolist()
        for s in range(8)
    ]
    for rows in patterns:
        rows = torch.tensor(rows)
        if seeded == "one":
            g, expected_g = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
            got = fast.draws._draw(probs[rows], rows, [(0, n, g)])
            expected = torch.multinomial(probs, 1, generator=expected_g).squeeze(1)[rows]
            assert torch.equal(g.get_state(), expected_g.get_state())
        elif seeded:
            gens, expected_gens = ([torch.Generator().manual_seed(7 + i) for i in range(3)] for _ in range(2))
            starts = [0, 3, 8, 12]  # counts 3, 5, 4
            got = fast.draws._draw(probs[rows], rows, list(zip(starts, starts[1:], gens)))
            expected = torch.cat(
                [
                    torch.multinomial(part, 1, generator=g).squeeze(1)
                    for part, g in zip(probs.split(counts), expected_gens)
                ]
            )[rows]
            assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens, expected_gens))
        else:
            torch.manual_seed(3)
            got = fast.draws._draw(probs[rows], rows, [(0, n, None)])
            after = torch.rand(2)
            torch.manual_seed(3)
            expected = torch.multinomial(probs, 1).squeeze(1)[rows]
            assert torch.equal(after, torch.rand(2))
        assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="nan"):
        fast.draws._draw(torch.full((2, vocab), float("nan")), torch.tensor([0, 1]), [(0, 2, None)])


@pytest.mark.numerics
@pytest.mark.parametrize("compact_at", [None, 0.0, 0.25])
@pytest.mark.parametrize("kind,kv_heads", [("llama", 4), ("qwen3", 2)])
def test_a_kept_cache_goes_on_as_decoding_the_whole_context_does(kind, kv_heads, compact_at, monkeypatch):
    """`decode(keep=True)` then `extend` with new tokens per row (a multi-turn rollout's next
    turn: the end of its last turn, a tool's message) draws the tokens, and the log-probs to
    float rounding, that `decode` draws on each row's whole context from the same stream;
    rows end the first call at very different lengths (and leave the cache, `compact_at`)."""
    from grpo.rollout.params import SamplingParams
    from grpo.rollout.padding import left_pad

    monkeypatch.setattr(fast.decoding, "COMPACT_AT", compact_at)
    model = model_of(kind, kv_heads, eos_bias=SPREAD[kind, kv_heads])
    weights = fast.fuse_weights(model, torch.float32)
    p = SamplingParams.of(TOKENIZER, max_new_tokens=16, temperature=1.2)
    prompts = [TOKENIZER(row["prompt"], add_special_tokens=False)["input_ids"] for row in ROWS]
    ids, mask = left_pad(prompts, p.pad_token_id, "cpu")
    counts = torch.full((len(prompts),), 3)
    first, _, kept = fast.decode(model, ids, mask, counts, p, weights=weights, keep=True)
    lengths = [row.index(EOS) + 1 if EOS in row else len(row) for row in first.tolist()]
    assert max(lengths) >= 3 * min(lengths)  # rows leave the first call at very different lengths
    # Each row goes on with the end of its turn and a few new tokens of its own.
    rows = [prompt for prompt in prompts for _ in range(3)]
    contexts = [r + t[:n] for r, t, n in zip(rows, first.tolist(), lengths)]
    extra = [TOKENIZER(" 12"[: 1 + i % 3] + "ab", add_special_tokens=False)["input_ids"] for i in range(len(rows))]
    blocks = [(c + e)[int(cached) :] for c, e, cached in zip(contexts, extra, kept.cached)]
    assert all(len(block) > len(e) for block, e in zip(blocks, extra))  # the EOS (or more) runs again
    ones = torch.ones(len(rows), dtype=torch.long)
    for seeded in (False, True):
        generators = [torch.Generator().manual_seed(7)] if seeded else None
        torch.manual_seed(5)
        tokens, logprobs, again = fast.extend(model, kept, blocks, p, weights, ones, generators)
        whole_ids, whole_mask = left_pad([c + e for c, e in zip(contexts, extra)], p.pad_token_id, "cpu")
        generators = [torch.Generator().manual_seed(7)] if seeded else None
        torch.manual_seed(5)
        expected, expected_logprobs = fast.decode(
            model, whole_ids, whole_mask, ones, p, weights=weights, generators=generators
        )
        assert torch.equal(tokens, expected)
        assert_close_scaled(logprobs, expected_logprobs)
        assert torch.equal(
            again.cached,
            kept.cached
            + torch.tensor([len(b) for b in blocks])
            + torch.tensor(
                [min(row.index(EOS) if EOS in row else len(row), tokens.shape[1] - 1) for row in tokens.tolist()]
            ),
        )
