"""Where metrics go: metrics.jsonl always; TensorBoard, wandb and trackio when
train.report_to names them; behind one interface.

The loop calls `log(step, metrics)` (and `log_table(step, name, rows)` for the samples) on
a `Sinks` and never asks which sinks exist. The dashboards are started before training (a
missing package or a service that refuses is one line, before any step), their packages are
imported only when asked for (slow imports), and they get the finite numbers of each step
and each table, as a table (wandb, trackio) or as markdown text (TensorBoard); metrics.jsonl
takes no table (samples.jsonl holds the same rows). A dashboard that fails mid-run is a
warning and no more: the run goes on, and metrics.jsonl holds every step.
"""

from __future__ import annotations

import contextlib
import html
import importlib
import json
import math
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Protocol

from grpo.errors import UserError, first_line
from grpo.infra.space import NoSpace, writing


class Sink(Protocol):
    def log(self, step: int, metrics: dict) -> None: ...
    def log_table(self, step: int, name: str, rows: list[dict]) -> None: ...
    def close(self) -> None: ...


def _clean(value):
    """JSON has no NaN: a number that is not finite is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlSink:
    """One JSON object per line, flushed at once, so a killed run loses no logged step. A
    line cut short (a full disk, a kill mid-write) is dropped when the run resumes. A write
    that fails for lack of space is NoSpace; for another reason, a UserError."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.file = open(path, "a", encoding="utf-8")

    def log(self, step, metrics):
        line = json.dumps({k: _clean(v) for k, v in metrics.items()}) + "\n"
        try:
            with writing(self.path):
                self.file.write(line)
                self.file.flush()
        except NoSpace:
            raise
        except OSError as err:
            raise UserError(f"cannot write {self.path}: {err.strerror or err}") from None

    def log_table(self, step, name, rows):
        """A log of numbers holds no table (samples.jsonl holds the samples)."""

    def close(self):
        try:
            self.file.close()
        except OSError:
            pass  # every line is flushed as it is logged: only a failed one, already reported, is left


def _scalars(metrics: dict) -> dict:
    """What a dashboard plots: the metrics that are finite numbers (no bools, strings, lists,
    NaN or inf)."""
    return {
        k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def _columns(rows: list[dict]) -> list[str]:
    """A table's columns: every key of its rows, in the order they first come."""
    return list(dict.fromkeys(key for row in rows for key in row))


def _cell(value):
    """A table cell as a dashboard shows it: a string, a finite number or a bool as it is,
    nothing (None) for a missing value or one that is not finite, and anything else (a chat
    prompt, a multi-turn rollout's messages, a list a reward logged) as its JSON."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return _clean(value)
    return json.dumps(value, ensure_ascii=False)


def _table_cells(rows: list[dict]) -> tuple[list[str], list[list]]:
    """(columns, one list of cells per row)."""
    columns = _columns(rows)
    return columns, [[_cell(row.get(column)) for column in columns] for row in rows]


_MARKDOWN = re.compile(r"([\\`*_\[\]|#!])")  # what markdown would read as markup: escaped


def markdown_table(rows: list[dict]) -> str:
    """The rows as a markdown table (TensorBoard's text tab renders it), each cell's text shown
    as written: HTML and markdown's markup escaped, line breaks as <br> (one table row a row)."""

    def text(value) -> str:
        escaped = _MARKDOWN.sub(r"\\\1", html.escape("" if value is None else str(value), quote=False))
        return escaped.replace("\r\n", "<br>").replace("\n", "<br>")

    columns, cells = _table_cells(rows)
    lines = [[text(c) for c in columns], ["---"] * len(columns), *[[text(c) for c in row] for row in cells]]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


# Each dashboard's module, imported only when train.report_to names it; the extra is its name.
PACKAGES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "trackio": "trackio"}


def _import(name: str):
    module = PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        missing = err.name in (module, module.split(".")[0], name)
        detail = "" if missing else f" ({first_line(err)})"
        raise UserError(
            f"train.report_to: {name} needs the {name} package: pip install 'grpo[{name}]'{detail}"
        ) from None


class TensorBoardSink:
    def __init__(self, directory: Path, purge_step: int | None = None):
        """`purge_step`: a resumed run's first step; TensorBoard hides the events logged at
        and after it by the run that stopped."""
        self.writer = _import("tensorboard").SummaryWriter(str(directory), purge_step=purge_step)

    def log(self, step, metrics):
        for key, value in _scalars(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_table(self, step, name, rows):
        """A markdown table in the Text tab, under `name`, at `step`."""
        self.writer.add_text(name, markdown_table(rows), step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class _Dashboard:
    """A run on a dashboard service (wandb, trackio) that gets each step's finite numbers and
    tables at that step. One that fails to log either says so in one line and is left alone
    from then on."""

    name = ""

    def __init__(self):
        self.failed = False

    def _log(self, step: int, scalars: dict) -> None:
        raise NotImplementedError

    def _table(self, step: int, name: str, columns: list[str], cells: list[list]) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def _refused(self, err: Exception) -> UserError:
        return UserError(
            f"train.report_to: {self.name} could not start a run ({first_line(err)}); "
            f"fix its settings, or take {self.name} out of train.report_to"
        )

    def log(self, step, metrics):
        scalars = _scalars(metrics)
        scalars.pop("step", None)  # the x-axis already (a reserved name in trackio)
        self._send(step, lambda: self._log(step, scalars))

    def log_table(self, step, name, rows):
        self._send(step, lambda: self._table(step, name, *_table_cells(rows)))

    def _send(self, step: int, send) -> None:
        """`send()`, unless this dashboard failed before; a failure is one warning line."""
        if self.failed:
            return
        try:
            send()
        except Exception as err:
            self.failed = True
            print(
                f"grpo: warning: {self.name} stopped logging at step {step} ({first_line(err)}); "
                "the run goes on and metrics.jsonl has every step",
                file=sys.stderr,
            )

    def close(self):
        try:
            self._finish()
        except Exception as err:
            print(f"grpo: warning: {self.name} could not finish its run ({first_line(err)})", file=sys.stderr)


class WandbSink(_Dashboard):
    """A Weights & Biases run. WANDB_MODE and the other WANDB_* variables apply (offline: the
    run is written to disk for `wandb sync`). Its files go under WANDB_DIR if set, else
    `directory`; its id is kept in `directory/wandb_run_id`, so that --resume continues it."""

    name = "wandb"

    def __init__(self, directory: Path, *, project: str, run_name: str, config: dict, resume: bool):
        super().__init__()
        self.wandb = wandb = _import("wandb")
        id_file = Path(directory) / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else ""
        run_id = run_id or uuid.uuid4().hex[:12]
        try:
            self.run = wandb.init(
                project=project or os.environ.get("WANDB_PROJECT") or "grpo",
                name=run_name,
                id=run_id,
                resume="allow",
                config=config,
                dir=None if os.environ.get("WANDB_DIR") else str(directory),
            )
        except Exception as err:
            raise self._refused(err) from None
        write_atomic(id_file, run_id + "\n")

    def _log(self, step, scalars):
        self.run.log(scalars, step=step)

    def _table(self, step, name, columns, cells):
        table = self.wandb.Table(columns=columns, data=cells, allow_mixed_types=True)
        self.run.log({name: table}, step=step)

    def _finish(self):
        self.run.finish()


class TrackioSink(_Dashboard):
    """A trackio run in its local store (one SQLite database per project under TRACKIO_DIR,
    by default ~/.cache/huggingface/trackio, which `trackio show` reads): no network unless
    TRACKIO_SPACE_ID or TRACKIO_SERVER_URL says where to send it. --resume continues the run
    of the same name."""

    name = "trackio"

    def __init__(self, *, project: str, run_name: str, config: dict, resume: bool):
        super().__init__()
        self.trackio = _import("trackio")
        try:
            with contextlib.redirect_stdout(sys.stderr):  # its notes; grpo's stdout is the result
                self.trackio.init(
                    project=project or "grpo", name=run_name, config=config, resume="allow" if resume else "never"
                )
        except Exception as err:
            raise self._refused(err) from None

    def _log(self, step, scalars):
        self.trackio.log(scalars, step=step)

    def _table(self, step, name, columns, cells):
        rows = [dict(zip(columns, row)) for row in cells]
        self.trackio.log({name: self.trackio.Table(data=rows)}, step=step)

    def _finish(self):
        with contextlib.redirect_stdout(sys.stderr):
            self.trackio.finish()


class Sinks:
    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def log(self, step: int, metrics: dict) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def log_table(self, step: int, name: str, rows: list[dict]) -> None:
        """Table `name` (one dict a row, the same keys) at `step`, to the sinks that show tables."""
        for sink in self.sinks:
            sink.log_table(step, name, rows)

    def close(self) -> None:
        """Close each sink once: closing again does nothing."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()


def open_dashboards(
    names: list[str], directory: Path, *, config: dict, run_name: str, project: str, first_step: int, resume: bool
) -> Sinks:
    """The sinks train.report_to names (grpo.config.reporters), started now. Every package is
    imported before any service starts a run; one that cannot start closes those started
    before it. `first_step`: the step logged next (TensorBoard hides a stopped run's events
    from it on); `resume`: continue the services' runs of the stopped run."""
    for name in names:
        _import(name)
    start = {
        "tensorboard": lambda: TensorBoardSink(Path(directory) / "tensorboard", purge_step=first_step),
        "wandb": lambda: WandbSink(directory, project=project, run_name=run_name, config=config, resume=resume),
        "trackio": lambda: TrackioSink(project=project, run_name=run_name, config=config, resume=resume),
    }
    opened = Sinks([])
    try:
        for name in names:
            opened.sinks.append(start[name]())
    except BaseException:
        opened.close()
        raise
    return opened


def _records(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl log, one per line; a line that is not one (cut short by
    a kill or a full disk while it was written) is left out."""
    records = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return _records(path)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` beside `path` and rename it into place: a reader (or a crash) never sees
    half a file. A failed write (NoSpace for lack of space) removes its partial file and
    leaves `path` as it was."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with writing(path):
        try:
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def truncate_metrics(path: Path, last_step: int, *, key: str = "step") -> None:
    """Keep the lines whose `key` <= last_step (and only whole lines): a resumed run rewrites
    what came after its checkpoint. Atomic: the log is rewritten beside and renamed."""
    path = Path(path)
    if not path.exists():
        return
    kept = [m for m in _records(path) if m.get(key, 0) <= last_step]
    write_atomic(path, "".join(json.dumps(m) + "\n" for m in kept))
