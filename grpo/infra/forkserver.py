"""`grpo` commands started by forking a process that has already imported what they import.

A run started as a new interpreter spends most of a short run importing torch and
transformers (benchmarks/README.md, `bench_run_start.py`); the demo trains many. A helper
(`python -m grpo.infra.forkserver`) imports them once, runs no tensor operation (OpenMP's
threads start in a child, never in a process that forks), and forks one child per command:
a new process as before (its own memory peak, exit status and signals), running a call such
as `grpo.cli:main(argv)`. Protocol, one JSON line each way: `{"id", "call", "args", "stdout",
"stderr", "cwd"}` in, `{"id", "code"}` out when the child exits (negative: killed by that
signal). At the end of its input it sends its children SIGTERM, waits and exits. The thread
settings are the helper's `env`: `grpo.infra.child.run_starter` starts one helper each.
Linux only (`available()`); elsewhere callers start a new interpreter per run.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
from pathlib import Path

# What a training run imports before its first step; importing them here costs nothing later.
PRELOAD = (
    "torch",
    "transformers",
    "grpo.cli",
    "grpo.train.loop",
    "grpo.train.step",
    "grpo.train.models",
    "grpo.train.layouts",
    "grpo.train.networks",
    "grpo.rollout.fast",
    "grpo.rewards",
    "grpo.tasks",
    "grpo.eval.runner",
)


def available() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork")


class ServerGone(RuntimeError):
    """The helper exited (or was killed) while a command was waiting on it."""


class ForkServer:
    """One helper process; `run` is safe to call from several threads at once (each call
    waits for its own child)."""

    def __init__(self, env: dict[str, str] | None = None, models: list[str] = ()):
        command = [sys.executable, "-m", "grpo.infra.forkserver", *[str(m) for m in models]]
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1
        )
        self._lock = threading.Lock()
        self._waiting: dict[int, dict] = {}  # id -> {"event", "code"}
        self._next = 0
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="grpo-forkserver-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for line in self._process.stdout:
                try:  # anything else on the helper's stdout (a library's print at import) is not ours
                    message = json.loads(line)
                    key = message["id"]
                except (ValueError, TypeError, KeyError):
                    continue
                with self._lock:
                    entry = self._waiting.get(key)
                if entry is not None and "code" in message:
                    entry["code"] = message["code"]
                    entry["event"].set()
        finally:
            with self._lock:  # the helper is gone (or unreadable): nobody waits forever
                self._gone = True
                for entry in self._waiting.values():
                    entry["event"].set()

    def run(self, argv: list[str], *, stdout: str | Path | None = None, stderr: str | Path | None = None) -> int:
        """Run `grpo ARGV` in a forked child, in this process's working directory; its exit
        code. `stdout`/`stderr`: files for the child's output (None: the helper's, which are
        /dev/null and this process's standard error)."""
        return self.call("grpo.cli:main", [list(argv)], stdout=stdout, stderr=stderr)

    def call(
        self, target: str, args: list, *, stdout: str | Path | None = None, stderr: str | Path | None = None
    ) -> int:
        """Call `target` ("module:function") with `args` (JSON values) in a forked child, as
        `run` runs a command; the child's exit code is the function's int result (None: 0),
        1 for an exception it raised (its traceback on the child's stderr)."""
        event = threading.Event()
        with self._lock:
            if self._gone:
                raise ServerGone(f"the helper process that starts runs has exited (code {self._process.poll()})")
            key, self._next = self._next, self._next + 1
            self._waiting[key] = entry = {"event": event, "code": None}
            request = dict(id=key, call=target, args=list(args), cwd=os.getcwd())
            request.update(
                stdout=None if stdout is None else str(stdout), stderr=None if stderr is None else str(stderr)
            )
            try:
                self._process.stdin.write(json.dumps(request) + "\n")
                self._process.stdin.flush()
            except (BrokenPipeError, ValueError) as err:
                del self._waiting[key]
                raise ServerGone(f"the helper process that starts runs has exited ({err})") from err
        event.wait()
        with self._lock:
            del self._waiting[key]
        if entry["code"] is None:
            raise ServerGone(f"the helper process that starts runs exited (code {self._process.wait()}) during a run")
        return entry["code"]

    def close(self) -> None:
        """End the helper (its live children get SIGTERM); waits for it."""
        if self._process.stdin and not self._process.stdin.closed:
            try:
                self._process.stdin.close()
            except BrokenPipeError:
                pass
        self._process.wait()
        self._reader.join(timeout=5)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- the helper's side ----


def _preload(models: list[str]) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    for path in models:  # the classes that load this model (their modules import on first use)
        if not Path(path).is_dir():  # a hub name: nothing is looked up, let alone downloaded, here
            continue
        try:
            from transformers import AutoConfig, AutoTokenizer
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

            config = AutoConfig.from_pretrained(path)
            MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
            AutoTokenizer.from_pretrained(path)
        except Exception:  # noqa: BLE001 (a warm-up only: the child loads the model itself, and says what is wrong)
            pass


def _child(request: dict, channel: tuple[int, int], interrupt) -> None:
    """In the forked child: never returns. `interrupt`: the SIGINT handling the helper was
    started with (the caller's: ignored in a script's background job), the child's again."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for fd in channel:
            os.close(fd)
        if interrupt is not None:
            signal.signal(signal.SIGINT, interrupt)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        for fd, path in ((1, request.get("stdout")), (2, request.get("stderr"))):
            if path is not None:
                target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(target, fd)
                os.close(target)
            elif fd == 1:
                os.dup2(null, 1)
        os.close(null)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(request["cwd"])
        module, name = request["call"].split(":")
        if request["call"] == "grpo.cli:main":
            sys.argv = ["grpo", *request["args"][0]]
        try:
            import importlib

            code = int(getattr(importlib.import_module(module), name)(*request["args"]) or 0)
        except SystemExit as stop:  # argparse's errors, --help
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except KeyboardInterrupt:
            code = 130
        except BaseException:  # noqa: BLE001 (printed as the interpreter would, then the code 1)
            import traceback

            traceback.print_exc()
            code = 1
        import atexit

        atexit._run_exitfuncs()  # what a normal interpreter exit runs (log sinks, temp files)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def serve(models: list[str]) -> None:
    _preload(models)
    # Ctrl-C reaches the whole process group: the children handle it (a run saves and stops);
    # the helper stays to report how they ended.
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()  # SIGCHLD writes here, so that the loop reaps at once
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, int] = {}  # pid -> request id
    out = sys.stdout

    def say(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            key = children.pop(pid, None)
            if key is not None:
                say({"id": key, "code": os.waitstatus_to_exitcode(status)})

    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ, "request")
    selector.register(wake_r, selectors.EVENT_READ, "wake")
    pending = b""  # requests read but not yet whole (read with os.read: nothing waits in a buffer)
    open_input = True
    while open_input:
        for key, _ in selector.select(timeout=1.0):
            if key.data == "wake":
                os.read(wake_r, 512)
                continue
            chunk = os.read(0, 65536)
            if not chunk:
                open_input = False
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                out.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, (wake_r, wake_w), interrupt)
                children[pid] = request["id"]
        reap()
    for pid in children:  # the caller is done or gone: stop what still runs
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for pid, key in list(children.items()):
        _, status = os.waitpid(pid, 0)
        say({"id": key, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    from grpo.infra.allocator import preload

    preload(["train"])  # the training runs it forks get the `grpo train` command's allocator (before torch loads)
    serve(sys.argv[1:])
