"""train.device and the --device of the other commands: resolved once, checked before any model loads."""

import subprocess
import sys

import pytest
import torch
import yaml

from grpo.cli import main
from grpo.errors import UserError
from grpo.infra.devices import attention_for, autocast_dtype, resolve_device
from grpo.infra.hf import load_causal_lm, load_tokenizer
from grpo.infra.memory import peak_memory_mb
from grpo.rollout import fast
from grpo.rollout.sampler import Sampler

NO_CUDA = not torch.cuda.is_available()


def test_auto_and_cpu_resolve_to_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_cuda_takes_the_gpu_of_the_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert resolve_device("auto") == torch.device("cuda", 2)
    assert resolve_device("cuda") == torch.device("cuda", 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)  # an explicit index wins
    with pytest.raises(UserError, match=r"train.device: cuda:7 asked for \(GPU 7\), but torch sees 4 GPU"):
        resolve_device("cuda:7")


@pytest.mark.parametrize(
    "name,message",
    [
        ("cuda", "train.device: cuda asked for, but torch sees no CUDA device"),
        ("cuda:0", "train.device: cuda:0 asked for, but torch sees no CUDA device"),
        ("tpu", "train.device: unknown device 'tpu'"),
    ],
)
def test_a_device_that_cannot_be_had_is_one_line(monkeypatch, name, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=message) as err:
        resolve_device(name)
    assert "\n" not in str(err.value)


def test_gpu_defaults_do_not_leak_onto_the_cpu_and_back(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert autocast_dtype("auto", cpu) is None and autocast_dtype("auto", gpu) is torch.bfloat16
    assert autocast_dtype("off", gpu) is None and autocast_dtype("bfloat16", cpu) is torch.bfloat16
    assert attention_for("auto", 64, cpu) == "eager" and attention_for("auto", 1024, cpu) is None
    assert attention_for("auto", 64, gpu) is None  # the model's default: SDPA
    assert attention_for("sdpa", 64, cpu) == "sdpa"


def test_peak_memory_on_the_cpu_is_the_process_rss():
    before = peak_memory_mb("cpu")
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    block += 1
    assert peak_memory_mb("cpu") >= before and peak_memory_mb(torch.device("cpu")) > 64


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_child_process_peak_is_its_own_not_its_parents():
    # A process started by this one inherits this one's peak as its ru_maxrss; its own peak
    # (what a demo or benchmark run reports) must not.
    block = torch.ones(512 << 20, dtype=torch.uint8)  # this process peaks above 512 MiB
    block += 1
    code = (
        "import resource; from grpo.infra.memory import peak_rss_mb; "
        "print(peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    own, inherited = map(
        float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    )
    assert inherited > 512  # the hazard: ru_maxrss carries the parent's peak over
    assert own < 200  # a bare interpreter: tens of MiB


@pytest.mark.skipif(not NO_CUDA, reason="checks the machine without CUDA")
def test_train_with_cuda_on_a_cpu_machine_fails_before_loading_a_model(tmp_path, capsys, make_config):
    config = make_config(train={"device": "cuda"})
    config["model"] = str(tmp_path / "not-loaded")  # loading it would fail with another message
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    code = main(["train", str(path), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert err.splitlines() == [err] and "train.device: cuda asked for, but torch sees no CUDA device" in err


def test_a_misspelt_device_fails_in_the_config(tmp_path, capsys, make_config):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(make_config(train={"device": "gpu"})))
    assert main(["train", str(path), "--quiet"]) != 0
    assert "train.device: expected auto, cpu, cuda or cuda:N, got 'gpu'" in capsys.readouterr().err


@pytest.mark.skipif(not NO_CUDA, reason="checks the machine without CUDA")
@pytest.mark.parametrize(
    "argv",
    [
        ["sft", "--output", "{tmp}/sft", "--device", "cuda"],
        ["rm", "train", "--model", "{model}", "--data", "{tmp}/none.jsonl", "--output", "{tmp}/rm", "--device", "cuda"],
        ["rm", "eval", "--model", "{model}", "--data", "{tmp}/none.jsonl", "--device", "cuda"],
    ],
)
def test_the_other_commands_take_the_same_device_setting(tmp_path, capsys, tiny_model, argv):
    argv = [a.format(tmp=tmp_path, model=tiny_model) for a in argv]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "--device: cuda asked for, but torch sees no CUDA device" in err


def test_train_help_documents_the_device(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "train.device" in out and "LOCAL_RANK" in out


def test_the_fast_sampler_decodes_with_a_cache_in_the_compute_dtype(monkeypatch, tiny_model):
    """On a GPU the KV cache holds the compute dtype (bf16); on a CPU float32. The GPU path,
    run here on the CPU: the same prompts decode (attention's dtypes agree) and the cache is bf16."""
    tokenizer = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model, "float32")
    sampler = Sampler(
        tokenizer,
        prompt_column="prompt",
        group_size=2,
        max_new_tokens=6,
        min_new_tokens=6,
        backend="fast",
        autocast=torch.bfloat16,
    )
    rows = [{"prompt": "ab"}, {"prompt": "c"}]
    dtypes = []
    real = fast.forward._Cache.__init__

    def spy(self, w, rows_, length):
        real(self, w, rows_, length)
        dtypes.append(self.keys.dtype)

    monkeypatch.setattr(fast.forward._Cache, "__init__", spy)
    torch.manual_seed(0)
    on_cpu = sampler.sample(model, rows)
    monkeypatch.setattr(fast.forward, "cache_dtype", lambda w: w.embed.dtype)  # what a GPU gets
    torch.manual_seed(0)
    as_on_gpu = sampler.sample(model, rows)
    assert dtypes == [torch.float32, torch.bfloat16]
    assert as_on_gpu.completion_ids.shape == on_cpu.completion_ids.shape == (4, 6)
