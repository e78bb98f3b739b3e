"""Resumable checkpoints: everything a run needs to continue exactly where it stopped.

Safe to write: written to a temporary directory beside the others, synced and renamed into
place, so that a run killed while saving keeps the previous checkpoint; a failed write (a
full disk: NoSpace) removes what it wrote, and older ones are pruned only after. Safe to
read: tensors and plain data only, loaded with `torch.load(weights_only=True)`, the shards'
metadata with `_MetadataUnpickler` (an exact list of the classes it holds) and their plain
entries by `load_shards`' planner, so a planted file runs no code on `--resume` and is
refused in one line naming what it holds. docs/safety.md.
Forgiving: `manifest.json` holds each file's sha256, and a damaged newest checkpoint is
skipped for the newest intact one. Several processes write `shards/`, a `rank-NNNNN.pt`
each and a shared `state.pt`, and resume with as many processes. docs/resume.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import torch

from grpo.errors import UserError, first_line
from grpo.infra.space import writing

_NAME = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"


def checkpoint_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoints that were completely written (renamed into place), oldest first."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / "state.pt").is_file()]
    return [p for _, p in sorted(found)]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(directory: Path, step: int, world_size: int) -> None:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {
        "step": step,
        "world_size": world_size,
        "files": {str(p.relative_to(directory)): _sha256(p) for p in files},
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _replace(tmp: Path, final: Path, output_dir: Path, keep: int) -> None:
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _save_file(state: dict, path: Path) -> None:
    """torch.save through a Python file, synced: its failed write is then an OSError that
    says why (to a path, torch.save's own writer reports only 'iostream error')."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(output_dir: Path, step: int, state: dict, *, keep: int) -> Path:
    """One process: `state` (tensors and plain data only) to step-N/state.pt, with its
    manifest. A failed write (NoSpace for lack of space) leaves no part of it behind."""
    root = checkpoint_dir(output_dir)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    with writing(final):
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            _save_file(state, tmp / "state.pt")
            _write_manifest(tmp, step, 1)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    _replace(tmp, final, output_dir, keep)
    return final


def save_sharded_checkpoint(
    world, output_dir: Path, step: int, common: dict, local: dict, sharded: dict, *, keep: int
) -> Path:
    """Every process calls this at the same step: `sharded` (a state dict of DTensors and
    plain tensors) goes to `shards/`, `local` to this process's own file, `common` (the
    same in every process) to `state.pt`, written last, then the manifest. A failed write
    (NoSpace for lack of space) leaves no part of it behind."""
    import torch.distributed.checkpoint as dcp

    root = checkpoint_dir(output_dir)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    with writing(final):
        try:
            if world.is_main:
                root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            world.barrier()
            dcp.save(sharded, checkpoint_id=str(tmp / "shards"))
            _save_file(local, tmp / f"rank-{world.rank:05d}.pt")
            world.barrier()
            if world.is_main:
                _save_file({**common, "world_size": world.world_size}, tmp / "state.pt")
                _write_manifest(tmp, step, world.world_size)
        except BaseException:
            if world.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    if world.is_main:
        _replace(tmp, final, output_dir, keep)
    world.barrier()
    return final


# ---- reading ----------------------------------------------------------------------------------


def refusal(err: Exception, holder: str = "a checkpoint") -> str:
    """torch.load(weights_only=True)'s refusal in a few words, the global the file names where
    it names one (torch's own text suggests loading the file with weights_only=False, which
    runs what it holds: never here). `holder`: what the file was meant to be."""
    text = str(err)
    if named := re.search(r"GLOBAL ([\w.]+)", text):
        return f"names {named.group(1)}, which {holder} never holds"
    if reason := re.search(r"WeightsUnpickler error:\s*(.+)", text):
        return f"is not {holder} ({reason.group(1).strip()})"
    if text.startswith("Weights only load failed"):
        return f"holds objects that {holder} never holds"
    return f"is not {holder} ({first_line(err)})"


def _weights_only(file, where) -> object:
    """torch.load(weights_only=True) of `file`: tensors and plain data, nothing else built, no
    code run; anything else a one-line UserError naming `where`."""
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise UserError(f"{where} {refusal(err)}") from None


def _load(path: Path) -> dict:
    """A checkpoint's file: tensors and plain data only; nothing else is built, no code runs.
    A refusal names the file within its checkpoint."""
    return _weights_only(path, path.name)


def _damage(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be used, or None when its files match the manifest."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (not written by this version, or damaged)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} is unreadable ({first_line(err)})"
    for name, digest in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if _sha256(file) != digest:
            return f"{name} does not match its checksum"
    return None


def load_latest_checkpoint(output_dir: Path, *, world_size: int = 1, rank: int = 0) -> dict:
    """The newest intact checkpoint's state; for a run over several processes also this
    process's own state (`local`) and where the shards are (`shards`, loaded once the models
    exist). A damaged newer checkpoint, or one holding what a checkpoint never holds, is
    reported on stderr (process 0) and skipped."""
    checkpoints = list_checkpoints(output_dir)
    if not checkpoints:
        raise UserError(f"--resume: no checkpoint in {checkpoint_dir(output_dir)}")
    problems = []
    for path in reversed(checkpoints):
        problem = _damage(path)
        if problem is None:
            try:
                state = _load(path / "state.pt")
                if world_size > 1 and state.get("world_size", 1) == world_size:
                    # Every process reads every process's file and the shards' metadata, so
                    # that all of them take the same checkpoint when one file is refused.
                    local = [_load(path / f"rank-{r:05d}.pt") for r in range(world_size)]
                    state["local"] = local[rank]
                    read_shards_metadata(path / "shards", "shards/.metadata")
            except Exception as err:  # unpicklable, truncated, or not ours
                problem = f"cannot be read ({first_line(err)})"
        if problem is not None:
            problems.append(f"{path.name}: {problem}")
            if rank == 0:
                print(f"grpo: warning: checkpoint {path} is damaged ({problem}); trying an older one", file=sys.stderr)
            continue
        saved = state.get("world_size", 1)
        if saved != world_size:
            raise UserError(
                f"--resume: {path} was written by {saved} process(es) and this run has {world_size}; "
                f"resume with the same number of processes"
            )
        if world_size > 1:
            state["shards"] = str(path / "shards")
        state["path"] = str(path)
        return state
    raise UserError(f"--resume: no intact checkpoint in {checkpoint_dir(output_dir)} ({'; '.join(problems)})")


class _Refused(pickle.UnpicklingError):
    """A name in a checkpoint's metadata that `_MetadataUnpickler` does not build."""


class _MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint's metadata, and nothing else: exactly the classes its
    `Metadata` pickles (its dataclasses, torch's sizes, dtypes and layouts, the path it was
    written to). Anything else, and any dotted name (which pickle would resolve attribute by
    attribute, out of an allowed module), is refused before it is imported or built."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch": {"Size"},
        "torch.serialization": {"_get_layout"},
        "pathlib": {"PosixPath"},  # StorageMeta.checkpoint_id
        "pathlib._local": {"PosixPath"},  # where Python 3.13 defines it
    }

    def find_class(self, module: str, name: str):
        if "." not in name:
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            if name in self._ALLOWED.get(module, ()):
                return super().find_class(module, name)
        named = f"{module}.{name}"
        shown = named if re.fullmatch(r"[\w.]+", named) else ascii(named)  # the file's text, on one line
        raise _Refused(f"names {shown}, which a checkpoint never holds")


def _read_metadata(stream, where):
    """A sharded checkpoint's metadata from `stream`, by `_MetadataUnpickler`, its shards files
    of its own folder; a refused or unreadable one a one-line UserError naming `where`."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(stream).load()
    except _Refused as err:
        raise UserError(f"{where} {err}") from None
    except Exception as err:  # truncated, garbage
        raise UserError(f"{where} is not a checkpoint's metadata ({first_line(err)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UserError(f"{where} is not a checkpoint's metadata (it holds a {type(metadata).__name__})")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise UserError(f"{where} names a shard outside its folder ({ascii(name)})")
    return metadata


def read_shards_metadata(path: Path, where: str | None = None):
    """The metadata of the shards in `path` (its `.metadata`), read as `load_shards` reads it;
    `where` names the file in a refusal (the whole path when None)."""
    file = Path(path) / ".metadata"
    with open(file, "rb") as f:
        return _read_metadata(f, where or file)


def safe_shards_reader(path: str, metadata=None):
    """A torch.distributed.checkpoint reader for `path` whose metadata file is read by
    `_MetadataUnpickler` (the stock reader unpickles it unrestricted); `metadata`: the file
    already read so (read_shards_metadata), which it then gives without reading it again."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            read = metadata if kwargs.get("rank") is None else None
            if read is None:
                file = self._get_metadata_path(kwargs.get("rank"))
                with self.fs.create_stream(file, "rb") as f:
                    read = _read_metadata(f, file)
            if getattr(read, "storage_meta", None) is None:
                read.storage_meta = StorageMeta()
            read.storage_meta.load_id = self.load_id
            return read

    return SafeReader(path)


def safe_load_planner(path: str):
    """torch.distributed.checkpoint's default load planner, but reading the shards' plain
    entries (the optimizer's hyperparameters, ...) with torch.load(weights_only=True): the
    stock one unpickles them unrestricted. A refused entry is a UserError naming it."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            fqn = read_item.dest_index.fqn
            obj = _weights_only(value, f"{path}: the entry {fqn}")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafePlanner()


def load_shards(state_dict: dict, path: str) -> None:
    """torch.distributed.checkpoint.load of the shards in `path` into `state_dict`, in place,
    with nothing but tensors and plain data built (`safe_shards_reader`, `safe_load_planner`).
    A refusal in any process is the one-line UserError in every process (the metadata's is
    read first: torch's load would fold it into an error of its own)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = safe_shards_reader(path, read_shards_metadata(path))
    try:
        dcp.load(state_dict, storage_reader=reader, planner=safe_load_planner(path))
    except CheckpointException as err:  # what every process raised, gathered
        refused = [exc for exc, _ in err.failures.values() if isinstance(exc, UserError)]
        if refused:
            raise refused[0] from None
        raise
