"""tests/vllm run where vLLM is installed (.venv-vllm); tests/conftest.py keeps them out of .venv.

vLLM reads its environment when it builds an engine: in this process (the weights are handed
over in memory), a small CPU KV cache, no OpenMP thread binding, one thread (the CI machine
and the development machines share a few cores)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import pytest  # noqa: E402 (after the environment vLLM reads)


@pytest.fixture
def built_engines(monkeypatch):
    """The engines this process builds meanwhile (`grpo.vllm.decoder.local_engine`), in order,
    each with `closed` set once it is shut down."""
    from grpo.vllm import decoder

    build, built = decoder.local_engine, []

    def recorded(*args, **kwargs):
        engine = build(*args, **kwargs)
        close = engine.close

        def closed():
            close()
            engine.closed = True

        engine.close, engine.closed = closed, False
        built.append(engine)
        return engine

    monkeypatch.setattr(decoder, "local_engine", recorded)
    return built


@pytest.fixture(scope="session")
def tool_lm(tmp_path_factory):
    """The tool model (tests/rollout/tool_models.py), wider for vLLM's attention: its tokenizer and
    model, built once a worker for the tool and agent tests."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.rollout.tool_models import save_tool_model

    directory = save_tool_model(tmp_path_factory.mktemp("vllm_tool_model"), hidden_size=128, heads=2)
    return AutoTokenizer.from_pretrained(directory), AutoModelForCausalLM.from_pretrained(directory).eval()
