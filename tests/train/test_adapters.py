"""LoRA adapters as files: lora.save (final/ and best/ hold the adapter alone, the merged model,
or both), lora.init_adapter (a run starts from a saved adapter: a run's own, or `grpo sft
--lora-save`'s), and such a run resumed. An adapter is peft's: PeftModel.from_pretrained puts it
on the base, where it gives back the log-probs of the policy that was saved."""

import json

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo
from grpo.config import config_from_dict
from grpo.errors import UserError
from grpo.infra.hf import load_causal_lm, load_tokenizer
from grpo.rollout import Sampler
from grpo.train.checkpointing import Checkpointer
from grpo.train.layouts import policy_logprobs
from grpo.train.models import apply_lora, save_adapter
from tests.helpers import assert_close_scaled, logprob_scale
from tests.train.test_distributed import torchrun
from tests.train.test_engine import engine_for, train_step
from tests.train.test_resume import FAILS_IN_STEP_3, results, straight_and_resumed
from tests.train.test_sft_data import base, data, run  # noqa: F401 (the fine-tuning tests' model and rows)

LORA = {"r": 4, "alpha": 8}
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}


def names(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


def plain(path):
    """A Hugging Face model folder, loaded as any user loads it."""
    return AutoModelForCausalLM.from_pretrained(path).eval()


def on_base(base_path, adapter):
    """The adapter in folder `adapter` on its base, as a peft user loads it."""
    return PeftModel.from_pretrained(plain(base_path), str(adapter)).eval()


def logprobs(model, batch):
    with torch.no_grad():
        return policy_logprobs(model, batch, 1.0)


def assert_same_logprobs(got, want):
    assert_close_scaled(got, want, scale=logprob_scale(got, want))


def moved_adapter(tiny_model, folder, seed=0):
    """An adapter that changes the tiny model (B != 0), saved as peft's files in `folder`."""
    policy = apply_lora(plain(tiny_model), LORA["r"], LORA["alpha"], "all-linear")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    save_adapter(policy, folder)
    return str(folder)


def a_batch(model_dir, model):
    """Completions `model` samples for two prompts (a Rollout, to score log-probs on)."""
    sampler = Sampler(AutoTokenizer.from_pretrained(model_dir), prompt_column="prompt", group_size=2, max_new_tokens=6)
    torch.manual_seed(0)
    return sampler.sample(model, [{"prompt": "ab"}, {"prompt": "cab"}])


def test_a_saved_adapter_is_the_trained_policy_and_a_run_starts_from_it(make_config, tiny_model, tmp_path):
    e, c, stream = engine_for(make_config(lora={**LORA, "save": "adapter"}))
    for _ in range(2):
        train_step(e, stream.take(c.rollout.prompts_per_step))
    batch = e.generator.samplers["train"].sample(e.policy, stream.take(2))
    trained, untouched = logprobs(e.policy, batch), logprobs(plain(tiny_model), batch)
    assert not torch.allclose(trained, untouched)  # the adapter moved the policy

    checkpoints = Checkpointer(e, c, prompts=None, updater=None)
    checkpoints.lora_save = "both"  # best/ as lora.save: both writes it, the policy left training
    checkpoints.save_copy(tmp_path / "best")
    checkpoints.lora_save = c.lora.save
    checkpoints.save_final(tmp_path / "final")
    final = tmp_path / "final"
    assert ADAPTER_FILES <= names(final) and "model.safetensors" not in names(final)
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == tiny_model
    assert load_tokenizer(str(final)).get_vocab() == load_tokenizer(tiny_model).get_vocab()
    assert_same_logprobs(logprobs(on_base(tiny_model, final), batch), trained)
    assert_same_logprobs(logprobs(load_causal_lm(str(final), "float32"), batch), trained)  # as grpo eval loads it
    assert_same_logprobs(logprobs(on_base(tiny_model, tmp_path / "best" / "adapter"), batch), trained)
    assert_same_logprobs(logprobs(plain(tmp_path / "best"), batch), trained)  # merged beside it
    assert_same_logprobs(logprobs(e.policy, batch), trained)  # saving left the policy as it was

    # lora.init_adapter: step 0's policy is the saved one (its alpha, 8, not lora.alpha's
    # default 16), with trainable adapters; the reference is the base.
    started, _, _ = engine_for(make_config(lora={"r": LORA["r"], "init_adapter": str(final)}))
    assert_same_logprobs(logprobs(started.policy, batch), trained)
    assert_same_logprobs(started.reference.logprobs(batch, 1.0), untouched)
    adapters = [p for name, p in started.policy.named_parameters() if "lora_" in name]
    assert adapters and all(p.requires_grad for p in adapters)


def test_an_adapter_that_cannot_start_the_run_is_one_line(make_config, tiny_model, tmp_path):
    adapter = moved_adapter(tiny_model, tmp_path / "adapter")
    for lora, message in [
        ({"r": 8, "init_adapter": adapter}, "lora.r: 8, but lora.init_adapter '.+' is an adapter of rank 4: set"),
        ({"r": 4, "init_adapter": tiny_model}, "lora.init_adapter: '.+' holds no peft adapter"),
        ({"r": 4, "init_adapter": str(tmp_path / "nowhere")}, "lora.init_adapter: no such directory"),
    ]:
        with pytest.raises(UserError, match=f"^{message}") as info:
            engine_for(make_config(lora=lora))
        assert "\n" not in str(info.value)


def test_save_both_writes_the_merged_model_and_its_adapter(make_config, tiny_model):
    result = grpo.train(make_config(lora={**LORA, "save": "both"}, train={"steps": 2}), progress=False)
    merged = plain(result.final_dir)
    assert not any("lora" in k for k in merged.state_dict())  # a plain model, as lora.save: merged writes
    assert ADAPTER_FILES <= names(result.final_dir / "adapter")
    batch = a_batch(tiny_model, merged)
    want = logprobs(merged, batch)
    assert not torch.allclose(want, logprobs(plain(tiny_model), batch))  # it trained
    assert_same_logprobs(logprobs(on_base(tiny_model, result.final_dir / "adapter"), batch), want)


@pytest.mark.parametrize("save", ["adapter", "both"])
def test_grpo_sft_writes_an_adapter_that_grpo_train_starts_from(base, data, tmp_path, capsys, make_config, save):  # noqa: F811
    out = tmp_path / "warm"
    argv = ["sft", "--model", base, "--data", data, "--output", str(out), "--steps", "2", "--lr", "3e-2", "--quiet"]
    status, _, err = run([*argv, "--lora-r", "4", "--lora-save", save], capsys)
    assert status == 0, err
    adapter = out if save == "adapter" else out / "adapter"
    assert ADAPTER_FILES <= names(adapter) and ("config.json" in names(out)) == (save == "both")
    config = make_config(
        model=base,
        data={"path": data},
        lora={"r": 4, "init_adapter": str(adapter), "save": "adapter"},
        train={"steps": 1},
        rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 4, "min_new_tokens": 0},
    )
    e, _, stream = engine_for(config)
    batch = e.generator.samplers["train"].sample(e.policy, stream.take(2))
    warm = logprobs(on_base(base, adapter), batch)
    assert not torch.allclose(warm, logprobs(plain(base), batch))  # sft moved the adapter
    assert_same_logprobs(logprobs(e.policy, batch), warm)  # the run starts where sft ended
    result = grpo.train(config, progress=False)
    assert len(result.metrics) == 1 and ADAPTER_FILES <= names(result.final_dir)


def test_sft_keeps_an_adapter_only_with_lora(base, data, tmp_path, capsys):  # noqa: F811
    argv = ["sft", "--model", base, "--data", data, "--output", str(tmp_path / "o"), "--lora-save", "adapter"]
    status, _, err = run(argv, capsys)
    assert status == 2 and "lora_save adapter keeps an adapter: set lora_r > 0" in err


def test_lora_save_adapter_refuses_iterations_that_merge_it_into_the_base(make_config):
    with pytest.raises(UserError, match="^lora.save: adapter keeps an adapter of the base the run started from"):
        config_from_dict(make_config(lora={**LORA, "save": "adapter"}, train={"iterations": 2}))
    # No reference (beta 0), no reset: the adapter stays one of the base.
    config_from_dict(make_config(lora={**LORA, "save": "adapter"}, train={"iterations": 2}, loss={"beta": 0.0}))


@pytest.mark.resume
def test_a_run_from_an_adapter_resumed_is_the_run_never_interrupted(make_config, tiny_model, tmp_path, monkeypatch):
    """Stopped by a failing reward in step 3 (the checkpoint of step 2 saved), resumed: the
    checkpoint's adapter, not the one the run started from, goes on."""
    start = moved_adapter(tiny_model, tmp_path / "start")

    def config(name):
        return make_config(
            output_dir=str(tmp_path / name),
            lora={"r": LORA["r"], "init_adapter": start, "save": "adapter"},
            rewards=FAILS_IN_STEP_3,
            train={"steps": 4, "checkpoint_minutes": 0},
        )

    straight_and_resumed(config, monkeypatch)
    assert results(tmp_path / "resumed") == results(tmp_path / "straight")
    got, want = (load_file(tmp_path / name / "final" / "adapter_model.safetensors") for name in ("resumed", "straight"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.torchrun
def test_two_processes_save_the_adapter_whole(make_config, tiny_model, tmp_path):
    """Under torchrun (FSDP2 shards the adapter too) final/adapter/ holds every tensor whole:
    on the base it is the merged final/; and a run starts from an adapter there as well."""
    config = make_config(
        output_dir=str(tmp_path / "run"),
        rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6, "min_new_tokens": 6},
        train={"steps": 2, "sample_every": 0},
        lora={"r": LORA["r"], "init_adapter": moved_adapter(tiny_model, tmp_path / "start"), "save": "both"},
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    done = torchrun("-m", "grpo", "train", str(path), "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    final = tmp_path / "run" / "final"
    saved, start = (load_file(d / "adapter_model.safetensors") for d in (final / "adapter", tmp_path / "start"))
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in start.items()}
    merged = plain(final)
    batch = a_batch(tiny_model, merged)
    assert_same_logprobs(logprobs(on_base(tiny_model, final / "adapter"), batch), logprobs(merged, batch))
