"""A planted file in a run's checkpoints runs nothing and is refused in one line: state.pt,
rank-NNNNN.pt, the shards' metadata (a dotted name, a class a checkpoint never holds) and a
shard's plain entry; a weights file in a model directory. Each payload would create a marker
file: the marker must not exist. The manifest is rewritten with each planted file, as an
attacker would, so that the loader itself is what refuses it."""

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from grpo.errors import UserError
from grpo.infra import checkpoint as ckpt
from grpo.infra.checkpoint import (
    load_latest_checkpoint,
    load_shards,
    read_shards_metadata,
    save_checkpoint,
    save_sharded_checkpoint,
)

DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"


class Payload:
    """What a malicious file would hold: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def dotted_payload(marker) -> bytes:
    """A protocol-4 pickle that reaches os.system through an allowed module's attribute:
    find_class(DCP_FILESYSTEM, "os.system"), then a call."""

    def text(s: str) -> bytes:
        data = s.encode()
        return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE

    # PROTO 4, STACK_GLOBAL, TUPLE1, REDUCE, STOP
    return b"\x80\x04" + text(DCP_FILESYSTEM) + text("os.system") + b"\x93" + text(f"touch {marker}") + b"\x85R."


def class_payload() -> bytes:
    """A class of torch.distributed.checkpoint that its metadata never holds, built by a call."""

    class Writer:
        def __reduce__(self):
            from torch.distributed.checkpoint import FileSystemWriter

            return (FileSystemWriter, ("elsewhere",))

    return pickle.dumps(Writer(), protocol=4)


def one_line(message: str) -> str:
    assert "\n" not in message.strip(), message
    return message


def sharded_state(extra=0.5) -> dict:
    """A state dict as the sharded checkpoint holds one: tensors (two dtypes) and plain entries
    (an optimizer's hyperparameters)."""
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "h": torch.ones(4, dtype=torch.bfloat16)},
        "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"], "foreach": None}]},
        "extra": extra,
    }


def empty_like(state: dict) -> dict:
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "optimizer": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": [], "foreach": True}]},
        "extra": None,
    }


def save_shards(path: Path, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):  # no process group: torch says it saves as one process
        dcp.save(state, checkpoint_id=str(path))


def test_the_metadata_torch_writes_is_read_and_its_shards_load(tmp_path):
    """The allow-list holds exactly what torch's own metadata needs (a tensor in each dtype,
    plain entries, the path): a real checkpoint round-trips, plain entries included."""
    state = sharded_state()
    save_shards(tmp_path / "shards", state)
    metadata = read_shards_metadata(tmp_path / "shards")
    assert set(metadata.state_dict_metadata) >= {"model.w", "model.h", "extra"}
    loaded = empty_like(state)
    with pytest.warns(UserWarning):
        load_shards(loaded, str(tmp_path / "shards"))
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert loaded["model"]["h"].dtype is torch.bfloat16 and torch.equal(loaded["model"]["h"], state["model"]["h"])
    assert loaded["optimizer"] == state["optimizer"] and loaded["extra"] == 0.5


@pytest.mark.parametrize("kind", ["dotted", "payload", "class"])
def test_planted_metadata_runs_nothing_and_is_refused_in_one_line(tmp_path, kind):
    marker = tmp_path / "pwned"
    save_shards(tmp_path / "shards", sharded_state())
    planted = {
        "dotted": lambda: dotted_payload(marker),
        "payload": lambda: pickle.dumps({"w": Payload(marker)}, protocol=4),
        "class": class_payload,
    }[kind]()
    (tmp_path / "shards" / ".metadata").write_bytes(planted)
    named = {
        "dotted": f"{DCP_FILESYSTEM}.os.system",
        "payload": "posix.system" if os.name == "posix" else "nt.system",
        "class": f"{DCP_FILESYSTEM}.FileSystemWriter",
    }[kind]
    with pytest.raises(UserError) as read:
        read_shards_metadata(tmp_path / "shards")
    assert one_line(str(read.value)) == (
        f"{tmp_path / 'shards' / '.metadata'} names {named}, which a checkpoint never holds"
    )
    with pytest.raises(UserError) as loading:  # through torch.distributed.checkpoint's own load
        load_shards(empty_like(sharded_state()), str(tmp_path / "shards"))
    assert str(loading.value) == str(read.value)
    with pytest.raises(UserError) as reader:  # and its reader, alone
        ckpt.safe_shards_reader(str(tmp_path / "shards")).read_metadata()
    assert str(reader.value) == str(read.value)
    assert not marker.exists()


def test_metadata_naming_a_file_outside_its_folder_or_an_odd_name_is_refused_in_one_line(tmp_path):
    save_shards(tmp_path / "shards", sharded_state())
    metadata = read_shards_metadata(tmp_path / "shards")
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../elsewhere.distcp"
    (tmp_path / "shards" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError, match=r"names a shard outside its folder \('\.\./elsewhere\.distcp'\)$"):
        read_shards_metadata(tmp_path / "shards")
    odd = dotted_payload("x").replace(b"\x8c\x09os.system", b"\x8c\x0aos\nsystem\x1b")
    (tmp_path / "shards" / ".metadata").write_bytes(odd)
    with pytest.raises(UserError) as refused:
        read_shards_metadata(tmp_path / "shards")
    assert one_line(str(refused.value)).endswith(
        f"names '{DCP_FILESYSTEM}.os\\nsystem\\x1b', which a checkpoint never holds"
    )


def test_a_planted_plain_entry_in_a_shard_runs_nothing_and_is_refused_in_one_line(tmp_path):
    """torch's own planner reads a shard's non-tensor entries with weights_only=False."""
    marker = tmp_path / "pwned"
    save_shards(tmp_path / "shards", sharded_state(extra=Payload(marker)))
    with pytest.raises(UserError) as refused, pytest.warns(UserWarning):
        load_shards(empty_like(sharded_state()), str(tmp_path / "shards"))
    assert not marker.exists()
    assert one_line(str(refused.value)) == (
        f"{tmp_path / 'shards'}: the entry extra names posix.system, which a checkpoint never holds"
    )


# ---- whole checkpoints: --resume skips a refused newest checkpoint for an older one --------------


class Stub:
    """Process 0 of two, writing alone (torch.distributed.checkpoint without a process group)."""

    rank, world_size, is_main = 0, 2, True

    def barrier(self):
        pass


def plant(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace a file of a checkpoint, with the manifest's checksum rewritten to match."""
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / ckpt.MANIFEST).read_text())
    manifest["files"][name] = ckpt._sha256(checkpoint / name)
    (checkpoint / ckpt.MANIFEST).write_text(json.dumps(manifest))


def saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def two_process_checkpoints(out: Path) -> list[Path]:
    """Steps 1 and 2 as two processes write them (process 1's file written as its own would be)."""
    paths = []
    for step in (1, 2):
        with pytest.warns(UserWarning):
            path = save_sharded_checkpoint(
                Stub(), out, step, {"step": step}, {"rng": torch.ones(2)}, sharded_state(), keep=5
            )
        plant(path, "rank-00001.pt", saved({"rng": torch.zeros(2)}))
        paths.append(path)
    return paths


@pytest.mark.parametrize("name", ["state.pt", "rank-00001.pt", "shards/.metadata"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_refused_file_of_a_sharded_checkpoint_falls_back_to_an_older_one_in_every_process(
    tmp_path, capsys, name, rank
):
    marker = tmp_path / "pwned"
    _, newest = two_process_checkpoints(tmp_path / "run")
    planted = pickle.dumps(Payload(marker), protocol=4) if name.startswith("shards") else saved(Payload(marker))
    plant(newest, name, planted)
    state = load_latest_checkpoint(tmp_path / "run", world_size=2, rank=rank)
    assert not marker.exists()
    assert state["step"] == 1 and torch.equal(state["local"]["rng"], torch.full((2,), float(rank == 0)))
    warnings = capsys.readouterr().err.strip().splitlines()
    if rank == 0:  # process 0 says it, in one line
        assert len(warnings) == 1
        assert f"{name} names posix.system, which a checkpoint never holds" in warnings[0]
    else:
        assert warnings == []


def test_a_refused_state_pt_falls_back_to_an_older_one_and_alone_is_refused_in_one_line(tmp_path, capsys):
    marker = tmp_path / "pwned"
    out = tmp_path / "run"
    older = save_checkpoint(out, 1, {"step": 1, "w": torch.ones(2)}, keep=5)
    newest = save_checkpoint(out, 2, {"step": 2, "w": torch.ones(2)}, keep=5)
    plant(newest, "state.pt", saved({"step": 2, "w": Payload(marker)}))
    state = load_latest_checkpoint(out)
    assert not marker.exists() and state["step"] == 1
    (warning,) = capsys.readouterr().err.strip().splitlines()
    assert "step-000002 is damaged (cannot be read (state.pt names posix.system" in warning
    import shutil

    shutil.rmtree(older)
    with pytest.raises(UserError) as refused:
        load_latest_checkpoint(out)
    assert not marker.exists()
    assert "state.pt names posix.system, which a checkpoint never holds" in one_line(str(refused.value))


def test_garbage_in_a_checkpoint_is_said_to_be_garbage_not_named():
    with pytest.raises(UserError, match=r"^x is not a checkpoint \(Unsupported operand"):
        ckpt._weights_only(io.BytesIO(b"\x80\x02\xc8" + bytes(64)), "x")


# ---- model directories ------------------------------------------------------------------------


def test_a_planted_pickled_weights_file_in_a_model_directory_runs_nothing(tmp_path):
    """transformers reads pytorch_model.bin with torch.load(weights_only=True): the policy's,
    the reward model's and the value model's loaders refuse a planted one in one line."""
    from safetensors.torch import load_file

    from grpo.infra.hf import load_causal_lm
    from grpo.rewards.model import RewardModel
    from grpo.tasks.tiny import save_tiny_model
    from grpo.train.networks import load_value_model

    marker = tmp_path / "pwned"
    model = save_tiny_model(tmp_path / "model", "ab", hidden_size=8, layers=1, heads=2)
    weights = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(saved({**weights, "x": Payload(marker)}))
    for load in (
        lambda: load_causal_lm(str(model), "float32"),
        lambda: RewardModel.from_pretrained(str(model)),
        lambda: load_value_model(str(model), "float32"),
    ):
        with pytest.raises(UserError) as refused:
            load()
        assert "its pickled weights file names posix.system" in one_line(str(refused.value))
        assert not marker.exists()
