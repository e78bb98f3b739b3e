import functools
import importlib
import json
import os
import random
from pathlib import Path

import pytest
import torch
from _pytest.mark.expression import Expression
from hypothesis import HealthCheck, settings

from grpo.errors import first_line
from grpo.rewards.model import RewardModel
from grpo.tasks.tiny import save_tiny_model

# Property tests draw shapes and seeds; tensors come from a seeded torch generator.
settings.register_profile("default", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")

# Tiny models: per-op overhead, not arithmetic; and robust when another process holds a core
# (two threads spin-wait for each other's core). The environment says it to every child a test
# starts too (commands, torchrun workers, benchmarks' children), which would otherwise take
# torch's default of a thread per core beside the other xdist worker.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

ALPHABET = "0123456789abc "

# ---- the tiers: `make check` (daily work) leaves out what these mark; `make test` runs everything ----

TIERS = {
    "learning": "a training run that must learn (the reward rises)",
    "torchrun": "several training processes (torchrun, gloo)",
    "resume": "a run stopped or killed, then resumed",
    "slow": "whole commands, demos or runs in other processes, seconds each",
}


def pytest_configure(config):
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {what}; `make check` leaves it out")


# ---- the vllm-marked tests: `make test` runs tests/vllm in .venv-vllm and the rest in .venv ----

VLLM_TESTS = Path(__file__).parent / "vllm"


def _in_vllm_tests(path: Path) -> bool:
    return path == VLLM_TESTS or VLLM_TESTS in path.parents


def _keeps_vllm_tests(config) -> bool | None:
    """What -m says of a test marked vllm (and nothing else): True kept, False deselected, None
    when there is no -m (every test is kept)."""
    expression = config.getoption("markexpr")
    if not expression:
        return None
    return Expression.compile(expression).evaluate(lambda name, **kwargs: name == "vllm" and not kwargs)


@functools.cache
def _vllm_import_error() -> str | None:
    try:
        importlib.import_module("vllm").LLM  # vllm imports lazily: LLM pulls in what the tests use
    except Exception as err:  # ImportError, or the RuntimeError of a mismatched torchvision
        return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
    return None


def _require_vllm(what: str) -> None:
    """Stop the run in one line when vLLM does not import: a vllm test that cannot run fails the
    run, it is never skipped (a skipped test would pass CI without testing the engine)."""
    error = _vllm_import_error()
    if error:
        raise pytest.UsageError(
            f"{what} needs vLLM, which does not import here ({error}). Run tests/vllm in .venv-vllm "
            "(`make test-vllm`; a PyPI torchvision, torchaudio or torchcodec next to the CPU torch breaks the import: "
            "pip uninstall -y torchvision torchaudio torchcodec), or deselect it: -m 'not vllm'"
        )


# ---- tests needing an extra that .venv lacks, as the vllm ones: `make test` runs tests/NAME, marked
# NAME, in .venv-NAME, and the rest in .venv. The marker -> the module its tests import.

OWN_ENVIRONMENTS = {"openenv": "openenv.core.env_server", "verifiers": "verifiers.v1"}


def _own(path: Path) -> str | None:
    """The marker whose directory (tests/NAME) holds `path`, if any."""
    for name in OWN_ENVIRONMENTS:
        directory = Path(__file__).parent / name
        if path == directory or directory in path.parents:
            return name
    return None


def _keeps(config, marker: str) -> bool | None:
    """What -m says of a test marked `marker` (and nothing else), as `_keeps_vllm_tests`."""
    expression = config.getoption("markexpr")
    if not expression:
        return None
    return Expression.compile(expression).evaluate(lambda name, **kwargs: name == marker and not kwargs)


def _require(marker: str, what: str) -> None:
    """Stop the run in one line when the extra does not import: such a test fails, never skips."""
    try:
        importlib.import_module(OWN_ENVIRONMENTS[marker])
    except Exception as err:
        raise pytest.UsageError(
            f"{what} needs {marker}, which does not import here ({type(err).__name__}: {first_line(err)}). Run "
            f"tests/{marker} in .venv-{marker} (`make install-{marker}`), or deselect it: -m 'not {marker}'"
        ) from None


def pytest_ignore_collect(collection_path, config):
    """Where -m deselects the vllm tests, tests/vllm is not even imported: its modules may import
    vllm at the top, which .venv does not have (and so for each of OWN_ENVIRONMENTS)."""
    if _in_vllm_tests(collection_path) and _keeps_vllm_tests(config) is False:
        return True
    own = _own(collection_path)
    if own is not None and _keeps(config, own) is False:
        return True
    return None


def pytest_pycollect_makemodule(module_path, parent):
    """A module of tests/vllm named on the command line (no directory walk to stop at)."""
    if _in_vllm_tests(module_path) and _keeps_vllm_tests(parent.config) is not False:
        _require_vllm(str(module_path.relative_to(VLLM_TESTS.parent.parent)))
    own = _own(module_path)
    if own is not None and _keeps(parent.config, own) is not False:
        _require(own, str(module_path.relative_to(VLLM_TESTS.parent.parent)))


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    """The vllm marker and tests/vllm go together. `make test` runs that directory alone in
    .venv-vllm, with -m vllm: a vllm test elsewhere would be deselected in .venv and never
    collected in .venv-vllm, and an unmarked test in it never collected in .venv and deselected in
    .venv-vllm."""
    for item in items:
        marked, inside = item.get_closest_marker("vllm") is not None, _in_vllm_tests(item.path)
        if marked != inside:
            where = "is marked vllm but does not live in tests/vllm" if marked else "lives in tests/vllm unmarked"
            raise pytest.UsageError(f"{item.nodeid} {where}: no `make test` environment would run it")
        for name in OWN_ENVIRONMENTS:
            if (item.get_closest_marker(name) is not None) != (_own(item.path) == name):
                raise pytest.UsageError(f"{item.nodeid}: marked {name} outside tests/{name}, or unmarked in it")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama with a character tokenizer, saved as a Hugging Face directory."""
    return str(save_tiny_model(tmp_path_factory.mktemp("model"), ALPHABET, hidden_size=64, layers=2, heads=4))


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """A tiny model that calls TRL's documentation tools (tests/rollout/tool_models.py). Under
    pytest-xdist it is trained once a run, by the first worker that asks, in the folder above
    the workers' own (the run's); the others wait for it and read it."""
    import fcntl

    from tests.rollout.tool_models import save_tool_model

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return str(save_tool_model(tmp_path_factory.mktemp("tool_model")))
    shared = tmp_path_factory.getbasetemp().parent
    with open(shared / "tool_model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        built = shared / "tool_model.built"
        if not built.exists():
            built.write_text(str(save_tool_model(shared / "tool_model")))
    return built.read_text()


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": p, "tag": i}) + "\n"
            for i, p in enumerate(["a", "b", "c", "ab", "ba", "cab", "abc", "cc"])
        )
    )
    return str(path)


@pytest.fixture
def make_config(tiny_model, prompts_file, tmp_path):
    """A small, fast config; keyword arguments are --set style overrides."""

    def make(algorithm="grpo", **sections):
        config = {
            "algorithm": algorithm,
            "model": tiny_model,
            "seed": 0,
            "output_dir": str(tmp_path / "run"),
            "data": {"path": prompts_file},
            "rewards": [{"function": "tests.train.rewards_for_tests:sevens"}],
            "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 8, "min_new_tokens": 8},
            "train": {"steps": 4, "lr": 1e-3, "sample_every": 2},
            "loss": {"beta": 0.04},
        }
        if algorithm == "ppo":
            config["rollout"].update(group_size=1, prompts_per_step=8)
        for section, values in sections.items():
            if isinstance(values, dict):
                config.setdefault(section, {}).update(values)
            else:
                config[section] = values
        return config

    return make


CHARS = "0123456789abc "


def sevens_pairs(n, seed):
    """Comparisons whose chosen completion has more '7's in its first 8 characters."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        k = rng.randint(1, 8)
        chosen = [rng.choice(CHARS.replace("7", "")) for _ in range(8)]
        for i in rng.sample(range(8), k):
            chosen[i] = "7"
        rejected = [rng.choice(CHARS.replace("7", "")) for _ in range(8)]
        for i in rng.sample(range(8), rng.randint(0, k - 1)):
            rejected[i] = "7"
        pairs.append(
            {"prompt": rng.choice(["a", "b", "c", "ab"]), "chosen": "".join(chosen), "rejected": "".join(rejected)}
        )
    return pairs


@pytest.fixture(scope="session")
def sevens_rm(tiny_model, tmp_path_factory):
    """A reward model trained (from the tiny base) to prefer completions with more 7s."""
    directory = tmp_path_factory.mktemp("rm")
    rm = RewardModel.from_base(tiny_model, seed=0)
    rm.fit(sevens_pairs(400, seed=1), lr=1e-3, epochs=2, batch_size=16, progress=False)
    assert rm.evaluate(sevens_pairs(100, seed=2))["accuracy"] >= 0.9
    rm.save(directory / "model")
    history = directory / "history.jsonl"
    history.write_text("".join(json.dumps(p) + "\n" for p in sevens_pairs(40, seed=3)))
    return str(directory / "model"), str(history)
