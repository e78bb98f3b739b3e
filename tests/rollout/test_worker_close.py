"""The generator process closes the generator it built when the trainer stops it, so that an
engine built there (vLLM's) is shut down as the trainer's own is; and after an error too."""

import queue
import signal

import pytest

from grpo.config import config_from_dict
from grpo.rollout import worker
from grpo.rollout.generator import GeneratorSpec, LocalGenerator


@pytest.mark.parametrize("first", [("stop",), ("weights", 1, "/nowhere", None, None)])
def test_the_generator_process_closes_its_generator(make_config, monkeypatch, first):
    """`_serve` run in this process (without its process-group and signal set-up): a stop, and
    a message that fails (weights from a file that is not there), each close the generator."""
    closed = []
    monkeypatch.setattr(worker, "_lead_a_group", lambda: None)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.setattr(LocalGenerator, "close", lambda self: closed.append(self))
    spec = GeneratorSpec.of(config_from_dict(make_config()), autocast=None)
    requests, results = queue.Queue(), queue.Queue()
    requests.put(first)
    worker._serve(spec, requests, results)
    assert len(closed) == 1 and isinstance(closed[0], LocalGenerator)
    if first[0] == "stop":
        assert results.empty()
    else:
        assert results.get_nowait()[0] == "error"
