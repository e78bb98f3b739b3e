"""QLoRA (lora.quantize): the base's linear layers in 4 bits through bitsandbytes, on a CPU.

Only the adapter trains; the reference is the 4-bit base with the adapter off; samplers and
final/ get the adapter merged into the dequantized weights, never into 4 bits. On a CPU a
4-bit layer computes in float32 from its dequantized weight (compute_dtype_4bit), so the
policy's log-probs are those of the same weights dequantized into float32 Linear layers with
the same adapter, to float32 rounding: within FORWARD epsilons of their scale (tests/helpers.py),
where nf4's own rounding of the weights moves them by more.
"""

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

import grpo
from grpo.config import config_from_dict
from grpo.errors import UserError
from grpo.rollout.weights import weights_bytes
from grpo.train.layouts import policy_logprobs
from grpo.train.models import apply_lora, is_quantized, load_4bit, save_dequantized, trainable_parameters
from grpo.train.networks import AdapterOff
from grpo.train.preflight import preflight
from tests.helpers import FORWARD, assert_close_scaled, gap, logprob_scale
from tests.train.test_engine import engine_for, train_step
from tests.train.test_learning import gain
from tests.train.test_models import rollout
from tests.train.test_resume import FAILS_IN_STEP_3, results, straight_and_resumed

pytest.importorskip("bitsandbytes")
QLORA = {"r": 4, "alpha": 16, "quantize": "nf4"}


def four_bit_layers(model) -> list:
    from bitsandbytes.nn import Linear4bit

    return [(name, m) for name, m in model.named_modules() if isinstance(m, Linear4bit)]


def trained_adapter(policy, seed=0):
    """`policy` with its adapter's B drawn away from 0, as after training (B = 0 is the base)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    return policy


def dequantized_twin(path, policy):
    """The policy's weights in float32 Linear layers (each 4-bit weight dequantized) with the
    same adapter: the model a 4-bit layer stands for."""
    from bitsandbytes.functional import dequantize_4bit

    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, layer in four_bit_layers(policy.get_base_model()):
            weight = dequantize_4bit(layer.weight.data, layer.weight.quant_state)
            plain.get_submodule(name.removesuffix(".base_layer")).weight.copy_(weight)
    twin = apply_lora(plain, 4, 16, "all-linear")
    adapter = {k: v for k, v in policy.state_dict().items() if "lora_" in k}
    assert adapter and not twin.load_state_dict(adapter, strict=False).unexpected_keys
    return twin


def test_a_4bit_policy_computes_what_its_dequantized_weights_do(tiny_model):
    """nf4 + LoRA against the same weights dequantized into float32 Linear layers with the same
    adapter: equal to float32 rounding, passes without a gradient included (a CPU with AVX-512
    BF16 would repack the layers at the first such pass and round their scales to bf16), while
    the unquantized model's log-probs are further off than that."""
    policy = trained_adapter(apply_lora(load_4bit(tiny_model, "float32", "nf4", None, "cpu"), **adapter_of(QLORA)))
    layers = four_bit_layers(policy.get_base_model())
    assert layers and all(m.weight.quant_state.quant_type == "nf4" for _, m in layers)
    assert {p.dtype for p in trainable_parameters(policy)} == {torch.float32}
    twin = dequantized_twin(tiny_model, policy)  # before any pass
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    batch = rollout(plain, ["a", "bc1", "cab 7"])
    mask = batch.completion_mask.bool()
    with torch.no_grad():
        first = policy_logprobs(policy, batch, 1.0)  # the first pass without a gradient
        again = policy_logprobs(policy, batch, 1.0)
        want = policy_logprobs(twin, batch, 1.0)
        unquantized = policy_logprobs(trained_adapter(apply_lora(plain, **adapter_of(QLORA))), batch, 1.0)
    scale = logprob_scale(want[mask])
    assert_close_scaled(first[mask], want[mask], FORWARD, scale=scale)
    assert torch.equal(again, first)
    assert gap(unquantized[mask], want[mask], scale=scale) > FORWARD  # nf4 rounded the weights


def adapter_of(lora: dict) -> dict:
    return {"r": lora["r"], "alpha": lora["alpha"], "target_modules": "all-linear"}


def test_fp4_loads_too_and_rounds_otherwise_than_nf4(tiny_model):
    nf4 = load_4bit(tiny_model, "float32", "nf4", None, "cpu")
    fp4 = load_4bit(tiny_model, "float32", "fp4", None, "cpu")
    assert is_quantized(fp4) and {m.weight.quant_state.quant_type for _, m in four_bit_layers(fp4)} == {"fp4"}
    batch = rollout(AutoModelForCausalLM.from_pretrained(tiny_model), ["a", "bc1"])
    with torch.no_grad():
        assert not torch.equal(policy_logprobs(fp4, batch, 1.0), policy_logprobs(nf4, batch, 1.0))


def test_the_reference_is_the_4bit_base_with_the_adapter_off_and_only_the_adapter_trains(make_config, tiny_model):
    e, c, stream = engine_for(make_config(lora=QLORA, train={"lr": 1e-2}))
    assert isinstance(e.reference, AdapterOff) and is_quantized(e.policy)
    # The layout probes run the 4-bit layers as any other: packed and checkpointed, as LoRA's.
    assert e.decisions.checkpointing and e.decisions.layout == e.decisions.no_grad_layout == "packed"
    names = [n for n, p in e.policy.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    before = {n: t.clone() for n, t in e.policy.state_dict().items()}
    train_step(e, stream.take(c.rollout.prompts_per_step))
    after = e.policy.state_dict()
    moved = {n for n, t in before.items() if not torch.equal(after[n], t)}
    assert any("lora_B" in n for n in moved) and all("lora_" in n for n in moved)  # the base unmoved

    trained_adapter(e.policy)
    batch = rollout(AutoModelForCausalLM.from_pretrained(tiny_model), ["a", "bc1", "cab 7"])
    mask = batch.completion_mask.bool()
    reference = e.reference.logprobs(batch, 1.0)
    with torch.no_grad():
        base_alone = policy_logprobs(load_4bit(tiny_model, "float32", "nf4", None, "cpu"), batch, 1.0)
        adapted = policy_logprobs(e.policy, batch, 1.0)
    scale = logprob_scale(base_alone[mask])
    assert_close_scaled(reference[mask], base_alone[mask], FORWARD, scale=scale)
    assert gap(adapted[mask], base_alone[mask], scale=scale) > 100 * FORWARD  # the adapter on moves them


def test_samplers_and_final_get_the_adapter_merged_into_the_dequantized_weights(tiny_model, tmp_path):
    """`policy_weights` (what vLLM and a generator process load) and final/'s model: plain
    float32 weights, no adapter and no quantization config, computing the policy's log-probs."""
    policy = trained_adapter(apply_lora(load_4bit(tiny_model, "float32", "nf4", None, "cpu"), **adapter_of(QLORA)))
    save_dequantized(policy, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not four_bit_layers(plain) and not hasattr(plain.config, "quantization_config")
    assert {p.dtype for p in plain.parameters()} == {torch.float32}
    assert not any("lora" in k for k in plain.state_dict())
    assert weights_bytes(policy) == sum(p.numel() * p.element_size() for p in plain.parameters())
    batch = rollout(AutoModelForCausalLM.from_pretrained(tiny_model), ["a", "bc1", "cab 7"])
    mask = batch.completion_mask.bool()
    with torch.no_grad():
        want, got = policy_logprobs(policy, batch, 1.0), policy_logprobs(plain, batch, 1.0)
    assert_close_scaled(got[mask], want[mask], FORWARD, scale=logprob_scale(want[mask]))


def test_the_dequantized_save_holds_one_tensor_at_a_time(tiny_model, tmp_path, monkeypatch):
    """final/'s merge is written as it is computed: when `policy_weights` makes a tensor, none
    it made before is still alive (a whole dequantized copy beside the 4-bit model would hold
    them all)."""
    import weakref

    import grpo.rollout.weights as weights

    policy = trained_adapter(apply_lora(load_4bit(tiny_model, "float32", "nf4", None, "cpu"), **adapter_of(QLORA)))
    made, alive = [], []
    real = weights.policy_weights

    def watched(p):
        for name, tensor in real(p):
            alive.append(sum(ref() is not None for ref in made))
            made.append(weakref.ref(tensor))
            yield name, tensor
            del tensor

    monkeypatch.setattr(weights, "policy_weights", watched)
    save_dequantized(policy, tmp_path)
    assert len(made) > 10 and max(alive) <= 1, alive


def test_a_4bit_load_reads_its_weights_without_keeping_the_file_mapped(tiny_model, tmp_path):
    """The 4-bit base is the one transformers' own load makes, and no file of the checkpoint
    stays mapped (its pages, all the full-precision weights, would stay resident)."""
    import shutil
    from pathlib import Path

    from transformers import BitsAndBytesConfig

    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs Linux's /proc/self/maps")
    folder = str(shutil.copytree(tiny_model, tmp_path / "model"))  # a file no other test has mapped
    model = load_4bit(folder, "float32", "nf4", None, "cpu")
    checkpoint = str(Path(folder).resolve() / "model.safetensors")
    assert Path(checkpoint).is_file() and checkpoint not in maps.read_text()
    assert model.name_or_path == folder and model.generation_config is not None
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=True,
    )
    usual = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=config, device_map={"": "cpu"}
    )
    got, want = model.state_dict(), usual.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want if isinstance(want[k], torch.Tensor))


def test_a_short_qlora_run_composes_with_the_memory_savers_and_saves_a_plain_model(make_config):
    """nf4 + LoRA with 8-bit AdamW and the step in the backward: it runs, its checkpoint
    restores, and final/ is a plain float32 model (the adapter merged, dequantized)."""
    train = {"steps": 2, "sample_every": 0, "optimizer": "adamw_8bit", "optimizer_in_backward": True}
    result = grpo.train(make_config(lora=QLORA, train={**train, "max_grad_norm": 0}), progress=False)
    assert len(result.metrics) == 2 and all(m["kl"] is not None for m in result.metrics)
    final = AutoModelForCausalLM.from_pretrained(result.final_dir)
    assert not hasattr(final.config, "quantization_config") and not four_bit_layers(final)
    assert {p.dtype for p in final.parameters()} == {torch.float32}


@pytest.mark.resume
def test_a_qlora_run_resumed_is_the_run_never_interrupted(make_config, tmp_path, monkeypatch):
    """Stopped by a failing reward in step 3 (the checkpoint of step 2 saved, the 4-bit base's
    quantization state with it), resumed: the same metrics and final/ as a straight run."""

    def config(name):
        return make_config(
            output_dir=str(tmp_path / name),
            lora=QLORA,
            rewards=FAILS_IN_STEP_3,
            train={"steps": 4, "checkpoint_minutes": 0, "lr": 1e-2},
        )

    straight_and_resumed(config, monkeypatch)
    assert results(tmp_path / "resumed") == results(tmp_path / "straight")
    got, want = (
        AutoModelForCausalLM.from_pretrained(tmp_path / n / "final").state_dict() for n in ("resumed", "straight")
    )
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


MINIMAL = {"model": "m", "data": {"path": "p.jsonl"}, "rewards": [{"function": "exact_answer"}], "lora": QLORA}


def test_iterations_are_refused_only_where_a_reference_is_reset():
    """The reference's reset between iterations is the merge into 4 bits: refused with a
    reference (tests/test_refusals.py), not without one (beta 0 resets nothing)."""
    config_from_dict({**MINIMAL, "train": {"iterations": 2}, "loss": {"beta": 0.0}})
    with pytest.raises(UserError, match=r"^lora.quantize: "):
        config_from_dict({**MINIMAL, "train": {"iterations": 2}})


def test_lora_quantize_needs_bitsandbytes_and_accelerate(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "accelerate" else find_spec(name))
    c = config_from_dict(MINIMAL)
    with pytest.raises(UserError, match=r"^lora.quantize: nf4 needs accelerate, not installed here: pip install"):
        preflight(c, 1, torch.device("cpu"))


@pytest.mark.learning
def test_qlora_learns_the_sevens_reward(make_config):
    """nf4 + LoRA, as the LoRA run of tests/train/test_combinations.py (r 16, alpha 64, lr
    1e-2, 40 steps): the reward rises from the base's (step 1 samples before any update) to
    twice it and more, within a few steps, as LoRA's on the fp32 base does; final/ is a plain
    model."""
    config = make_config(
        train={"steps": 40, "lr": 1e-2, "sample_every": 0}, lora={"r": 16, "alpha": 64, "quantize": "nf4"}
    )
    result = grpo.train(config, progress=False)
    m = result.metrics
    rewards = [round(x["reward/mean"], 3) for x in m]
    assert sum(rewards[-5:]) / 5 >= max(0.15, 2 * rewards[0]) and gain(m) > 0, rewards
    final = AutoModelForCausalLM.from_pretrained(result.final_dir)
    assert not any("lora" in k for k in final.state_dict()) and not four_bit_layers(final)
