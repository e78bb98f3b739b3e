"""`grpo plan` (grpo.train.plan): the states it predicts are the built engine's tensors, byte
for byte; its verdict moves with --memory; bad input is one line."""

import json

import pytest
import torch
import yaml

from grpo.cli import main
from grpo.config import config_from_dict
from grpo.rewards import load_rewards
from grpo.train.assembly import build_engine
from grpo.train import plan
from grpo.train.advice import advise
from grpo.train.plan import GiB, MiB, parse_size, predict
from tests.helpers import run_generator, sampled_step


def _bytes(tensors) -> int:
    """The bytes of `tensors`, each storage once."""
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _weights(model) -> list[torch.Tensor]:
    """A model's parameters, and each 4-bit one's quantization state (lora.quantize)."""
    out = list(model.parameters())
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        if state is not None:
            out += [state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]
    return out


def _state_tensors(state) -> list[torch.Tensor]:
    """Every tensor of more than one value in an optimizer's state dict (not the step counts)."""
    if isinstance(state, torch.Tensor):
        return [state] if state.dim() > 0 else []
    if isinstance(state, dict):
        return [t for v in state.values() for t in _state_tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _state_tensors(v)]
    return []


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["train.reference_dtype=bfloat16"],
        ["loss.beta=0"],
        ["train.optimizer_in_backward=true", "train.max_grad_norm=0"],
        ["lora.r=4"],
        ["train.optimizer=adamw_8bit"],
        ["lora.r=4", "lora.quantize=nf4"],
    ],
    ids=["exact", "bf16-reference", "no-reference", "in-backward", "lora", "8-bit", "qlora"],
)
def test_the_states_are_the_built_engines_tensors(make_config, overrides, tiny_model):
    """Each state the planner predicts is what the engine built from the same config holds:
    the policy's weights (a 4-bit base's with their quantization state), the reference's, the gradients (the trained weights' bytes; in the
    backward the largest one's) and, after one step, the optimizer's moments (8-bit ones with
    their block scales and quantization maps)."""
    if "train.optimizer=adamw_8bit" in overrides or "lora.quantize=nf4" in overrides:
        pytest.importorskip("bitsandbytes")
    c = config_from_dict(make_config(rollout={"group_size": 4, "prompts_per_step": 2}), overrides)
    planned = predict(c, device="cpu", runtime=0)["components"]
    torch.manual_seed(c.seed)
    e = build_engine(c, load_rewards([(r.function, r.weight) for r in c.rewards]))
    assert planned["policy weights"] == _bytes(_weights(e.policy))
    assert planned.get("reference", 0) == _bytes(p for n in e.reference.networks for p in n.parameters())
    trained = [p for p in e.policy_params]
    biggest = max(p.numel() * p.element_size() for p in trained)
    in_backward = "train.optimizer_in_backward=true" in overrides
    assert planned["gradients"] == (biggest if in_backward else _bytes(trained))
    rows = [{"prompt": p} for p in ["a", "b"]]
    sampled_step(e, run_generator(c, e), rows)
    moments = _bytes(_state_tensors(e.optimizer.state_dict()))
    assert planned["optimizer moments"] == moments
    assert planned["runtime"] == 0


def test_the_savers_each_hold_less_and_the_verdict_moves_with_memory(make_config, tmp_path, capsys, monkeypatch):
    """A size above the predicted peak fits; one just below it fits with a saver that the
    planner says brings it under (and its prediction under that saver is under the size);
    far below, nothing fits and the verdict says so. Every saver alone holds less."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(make_config()))
    base = advise(str(path), device="cpu")
    peak, runtime = base["peak"], base["components"]["runtime"]
    assert base["savers"] and all(r["peak"] < peak for r in base["savers"]), base["savers"]
    fits = advise(str(path), device="cpu", memory=peak + MiB, runtime=runtime)["verdict"]
    assert fits["fits"] and not fits["with"] and fits["line"].startswith("fits: ")
    below = peak - (peak - min(r["peak"] for r in base["savers"])) // 2
    saved = advise(str(path), device="cpu", memory=below, runtime=runtime)["verdict"]
    assert saved["fits"] and saved["with"] and saved["line"].startswith("fits with ")
    assert predict(config_from_dict(make_config(), saved["set"]), device="cpu", runtime=runtime)["peak"] <= below
    far = advise(str(path), device="cpu", memory=runtime // 2, runtime=runtime)["verdict"]
    assert not far["fits"] and far["line"].startswith("does not fit")
    # The command prints the same verdict, and writes it in --json (the runtime as measured above).
    monkeypatch.setattr(plan, "runtime_bytes", lambda shape: runtime)
    out = tmp_path / "plan.json"
    size = f"{below / MiB:.3f}MiB"
    assert main(["plan", str(path), "--device", "cpu", "--memory", size, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["verdict"]["line"] == printed.strip().splitlines()[-1] and written["verdict"]["fits"]


def test_the_verdict_moves_with_lora_and_its_4bit_base(make_config):
    """QLoRA holds less than LoRA on the same adapter (the base's linear layers in 4 bits, a
    layer dequantized at a time): a size between their peaks fits the QLoRA run as it is and
    not the LoRA one, and a size under QLoRA's own peak does not fit it as it is either."""
    lora, qlora = make_config(lora={"r": 4}), make_config(lora={"r": 4, "quantize": "nf4"})
    low, high = (advise(c, device="cpu", runtime=0) for c in (qlora, lora))
    assert low["peak"] < high["peak"]
    assert low["components"]["policy weights"] < high["components"]["policy weights"]
    assert low["components"]["dequantized weight"] > 0 and "dequantized weight" not in high["components"]
    between = (low["peak"] + high["peak"]) // 2
    assert advise(qlora, device="cpu", runtime=0, memory=between)["verdict"]["line"].startswith("fits: ")
    assert not advise(lora, device="cpu", runtime=0, memory=between)["verdict"]["line"].startswith("fits: ")
    under = advise(qlora, device="cpu", runtime=0, memory=low["peak"] - 1)["verdict"]
    assert not under["line"].startswith("fits: ")


def test_the_libraries_a_run_imports_count_where_it_imports_them(make_config):
    """peft (with bitsandbytes, which it imports) for LoRA, bitsandbytes alone for 8-bit
    moments, neither for full training; the verdict of a size between moves with them."""
    libraries = {"bitsandbytes": 40 * MiB, "peft": 7 * MiB}

    def planned(*overrides, memory=None):
        c = make_config() if not overrides else config_from_dict(make_config(), list(overrides))
        return advise(c, device="cpu", runtime=0, libraries=libraries, memory=memory)

    exact, lora, eight_bit = planned(), planned("lora.r=4"), planned("train.optimizer=adamw_8bit")
    assert "libraries" not in exact["components"]
    assert lora["components"]["libraries"] == 47 * MiB and eight_bit["components"]["libraries"] == 40 * MiB
    between = exact["peak"] + 20 * MiB  # over full training's peak, under 8-bit moments' with bitsandbytes
    assert planned(memory=between)["verdict"]["line"].startswith("fits: ")
    assert not planned("train.optimizer=adamw_8bit", memory=between)["verdict"]["line"].startswith("fits: ")


def test_the_phases_follow_the_settings_that_move_them(make_config):
    """Checkpointing lowers the update's activations, longer completions raise the sampling's
    cache and the update's activations, a colocated vLLM engine on a CPU holds its KV cache
    (and the trainer none), PPO holds a critic."""

    def planned(*overrides, **kwargs):
        return predict(config_from_dict(make_config(), list(overrides)), device="cpu", runtime=0, **kwargs)

    plain = planned()
    acts = plain["activations"]
    assert acts["with checkpointing"] < acts["without checkpointing"]
    assert planned("train.gradient_checkpointing=false")["phases"]["update"] > plain["phases"]["update"]
    longer = planned("rollout.max_new_tokens=64", "rollout.min_new_tokens=0")
    assert longer["components"]["kv cache and logits"] > plain["components"]["kv cache and logits"]
    assert longer["activations"]["tokens"] > acts["tokens"]
    assert planned(completion_tokens=4)["activations"]["tokens"] < acts["tokens"]
    vllm = planned("rollout.sampler=vllm", "rollout.vllm.kv_cache_gb=2")
    assert vllm["components"]["vllm engine"] > 2 * GiB and vllm["components"]["kv cache and logits"] == 0
    ppo = predict(config_from_dict(make_config("ppo")), device="cpu", runtime=0)
    assert ppo["components"]["critic"] > 0 and "critic" not in plain["components"]


@pytest.mark.parametrize(
    "text,size",
    [("24GB", 24 * GiB), ("24G", 24 * GiB), ("1.5GiB", int(1.5 * GiB)), ("512M", 512 * MiB), ("100", 100)],
)
def test_sizes_read_as_powers_of_1024(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "arguments,words",
    [
        (["--memory", "abc"], "argument --memory: 'abc' is not a size"),
        (["--memory", "0GB"], "argument --memory: '0GB' must be more than 0"),
        (["--device", "tpu"], "argument --device: invalid choice"),
    ],
)
def test_bad_flags_are_one_line(make_config, tmp_path, capsys, arguments, words):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(make_config()))
    with pytest.raises(SystemExit) as stop:
        main(["plan", str(path), *arguments])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert words in err, err


@pytest.mark.parametrize(
    "arguments,words",
    [
        (["--set", "rollout.group_size=0"], "rollout.group_size"),
        (["--json", "/no/such/folder/plan.json"], "--json: cannot write"),
        (["--set", "model=/no/such/model"], "model:"),
    ],
)
def test_bad_input_is_one_line(make_config, tmp_path, capsys, arguments, words):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(make_config()))
    assert main(["plan", str(path), *arguments]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpo: error: ") and words in err and "\n" not in err, err


def test_help_and_a_missing_config(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["plan", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "--memory SIZE" in out and "meta device" in out
    assert main(["plan", "/no/such.yaml"]) == 2
    assert capsys.readouterr().err.strip() == "grpo: error: config file not found: /no/such.yaml"


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_layer_saves_what_the_planner_counts(make_config, tiny_model, attention):
    """The activations a decoder layer saves for its backward, a token, as torch's
    saved-tensor hooks count them in a forward of the tiny model (each storage once, the
    weights left out): the planner's count within a tenth (the embedding's and the final
    norm's outputs, shared among the layers, are the rest)."""
    from transformers import AutoModelForCausalLM

    from grpo.train.plan import _layer_values, _scores_bytes, model_shape, settings

    rows, prompt, completion = 8, 16, 8
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=attention)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def keep(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model.model(torch.randint(0, model.config.vocab_size, (rows, prompt + completion)))
    shape = model_shape(tiny_model)
    measured = sum(saved.values()) / (rows * (prompt + completion) * shape.layers)
    c = config_from_dict(make_config(), [f"train.attention={attention}"])
    s = settings(c, "cpu", prompt, completion)
    planned = _layer_values(shape, s) * 4 + _scores_bytes(shape, s)
    assert abs(planned - measured) <= 0.1 * measured, (planned, measured)
