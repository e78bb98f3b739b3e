"""Checkpoint files load without running code."""

import io
import os
import pickle

import pytest
import torch

from grpo.infra.checkpoint import _MetadataUnpickler
from grpo.infra.seed import rng_state, seed_everything, set_rng_state


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_sharded_checkpoint_metadata_is_read_without_building_other_objects(tmp_path):
    """torch.distributed.checkpoint pickles its metadata: ours reads only its classes."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    metadata = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                properties=TensorProperties(dtype=torch.bfloat16),
                size=torch.Size([2, 3]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3]))],
            )
        }
    )
    loaded = _MetadataUnpickler(io.BytesIO(pickle.dumps(metadata))).load()
    assert loaded.state_dict_metadata["w"].properties.dtype is torch.bfloat16
    marker = tmp_path / "pwned"
    with pytest.raises(pickle.UnpicklingError, match="names posix.system"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps({"w": Payload(marker)}))).load()
    assert not marker.exists()


def test_random_states_survive_a_weights_only_round_trip():
    import random

    import numpy as np

    seed_everything(5)
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    buffer.seek(0)
    set_rng_state(torch.load(buffer, weights_only=True))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
