"""The fast draw's oneDNN packing is trusted by function, not by presence
(grpo.rollout.fast.forward._packing_serves): where the private ops fail or give other values
than F.linear, the draw samples with plain weights after one warning line; where oneDNN is
switched off (torch.backends.mkldnn.enabled), nothing is packed and nothing is said."""

import pytest
import torch

from grpo.rollout import Sampler, fast
from tests.rollout.test_fast import TOKENIZER, model_of

forward = fast.forward
WARNING = "grpo: warning: rollout.draw: fast: oneDNN's packed matmul does not serve"


@pytest.fixture(autouse=True)
def fresh_probe(monkeypatch):
    """Each test probes afresh (the verdict is cached for the process), and packs the tiny
    model's matrices, which are below the size packing starts at."""
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN packed inner product")
    monkeypatch.setattr(forward, "PACK_FROM", 0)
    forward._packing_serves.cache_clear()
    yield
    forward._packing_serves.cache_clear()


def draw_twice():
    """Two fast-draw decoders built and sampled from (a version each): whether each held packed
    weights, and the tokens the second drew."""
    model = model_of()
    TOKENIZER.padding_side = "left"
    enc = TOKENIZER(["a", "bc1"], padding=True, return_tensors="pt")
    packed = []
    for version in range(2):
        decoder = Sampler(TOKENIZER, prompt_column="prompt", group_size=3, max_new_tokens=6, backend="fast").decoder(
            model, 8
        )
        decoder.prepare(model, version)
        ids, _ = decoder.decode(
            enc["input_ids"], enc["attention_mask"], torch.tensor([3, 3]), [torch.Generator().manual_seed(3)]
        )
        packed.append(decoder.weights.packed)
    return packed, ids


def warnings(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith(WARNING)]


def test_working_ops_pack_without_a_word(capsys):
    packed, _ = draw_twice()
    assert packed == [True, True]
    assert warnings(capsys) == []


def plant(monkeypatch, name, replacement):
    monkeypatch.setattr(torch.ops.mkldnn, name, replacement)


@pytest.mark.parametrize(
    "broken",
    ["raises", "wrong-values", "reorder-raises"],
)
def test_a_broken_packed_op_falls_back_to_plain_weights_with_one_warning(broken, monkeypatch, capsys):
    plain = draw_twice()[1]  # what the plain layout draws is compared below
    capsys.readouterr()
    forward._packing_serves.cache_clear()
    real = torch.ops.mkldnn._linear_pointwise

    def raising(*args):
        raise RuntimeError("could not create a primitive descriptor\nsecond line")

    def wrong(*args):
        return real(*args) * (1 + 1e-3)  # close, and still not F.linear's values

    if broken == "reorder-raises":
        plant(monkeypatch, "_reorder_linear_weight", raising)
    else:
        plant(monkeypatch, "_linear_pointwise", raising if broken == "raises" else wrong)
    packed, ids = draw_twice()
    assert packed == [False, False]  # the draw still samples, with plain weights
    assert ids.shape == plain.shape
    (line,) = warnings(capsys)  # once for the process, not once a decoder
    assert line.endswith("sampling with plain weights")
    if broken != "wrong-values":
        assert "could not create a primitive descriptor)" in line  # the op's first line only


def test_mkldnn_switched_off_packs_nothing_and_probes_nothing(monkeypatch, capsys):
    def never(*args):
        raise AssertionError("no oneDNN op is called while oneDNN is switched off")

    plant(monkeypatch, "_linear_pointwise", never)
    plant(monkeypatch, "_reorder_linear_weight", never)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # a user's `torch.backends.mkldnn.enabled = False`
    assert not forward.packs(torch.float32, torch.device("cpu"))
    packed, _ = draw_twice()
    assert packed == [False, False]
    assert warnings(capsys) == []


def test_the_probe_leaves_the_runs_random_stream_alone():
    torch.manual_seed(7)
    assert forward.packs(torch.float32, torch.device("cpu"))  # the probe runs here
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3))
