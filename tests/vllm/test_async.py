"""Asynchronous rollouts with `rollout.sampler: vllm`: the engine runs in the generator process
(none is built in the trainer's), synced to the weights each batch carries, and the run learns."""

import pytest

import grpo
from grpo.vllm import decoder as vllm_decoder
from tests.train.test_learning import gain
from tests.vllm.test_training import qwen2, vllm_config  # noqa: F401 (qwen2: the fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.learning]


def test_async_k1_with_vllm_learns_with_the_engine_in_the_generator(make_config, qwen2):  # noqa: F811
    built = vllm_decoder.BUILT["engines"]
    config = vllm_config(make_config, qwen2)
    config["rollout"]["async"] = {"max_staleness": 1}
    result = grpo.train(config, progress=False)
    m = result.metrics
    assert vllm_decoder.BUILT["engines"] == built  # the trainer built none: the generator holds it
    assert [x["async/staleness"] for x in m] == [0] + [1] * (len(m) - 1)
    assert result.summary["async"]["dropped"] == 0
    assert gain(m) >= 0.25, [round(x["reward/mean"], 3) for x in m]
