"""Resumable checkpoints: everything a run needs to continue exactly where it stopped.

Safe to write: written to a temporary directory beside the others, synced and renamed into
place, so that a run killed while saving keeps the previous checkpoint; a failed write (a
full disk: NoSpace) removes what it wrote, and older ones are pruned only after. Safe to
read: tensors and plain data only, loaded with `torch.load(weights_only=True)` (sharded
metadata with `_MetadataUnpickler`), so a planted file runs no code on `--resume`.
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


def _load(path: Path) -> dict:
    """A checkpoint file: tensors and plain data only; nothing else is built, no code runs."""
    return torch.load(path, weights_only=True, map_location="cpu")


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
    exist). A damaged newer checkpoint is reported on stderr (process 0) and skipped."""
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
                    state["local"] = _load(path / f"rank-{rank:05d}.pt")
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


class _MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint's metadata, and nothing else: its own classes, torch's
    dtypes and sizes, paths. Anything else in the file is refused, never built."""

    _ALLOWED = {
        "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
        "torch": {"Size"},
        "torch.serialization": {"_get_layout"},
        "collections": {"OrderedDict"},
    }
    _DCP = (
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed.checkpoint.planner",
    )

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in self._ALLOWED.get(module, ()) or (module in self._DCP and not name.startswith("__")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which a checkpoint never holds")


def safe_shards_reader(path: str):
    """A torch.distributed.checkpoint reader for `path` whose metadata file is read by
    `_MetadataUnpickler` (the stock reader unpickles it unrestricted)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)
