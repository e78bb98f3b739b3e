"""Containing a call of user code (a reward function, a tool), so that what it does stays
inside the call and a long run goes on.

Anything the code raises becomes `Failed` (BaseException and sys.exit included; a UserError
passes through, a real Ctrl-C propagates), and so does os._exit called on the call's own
thread (`_exit_raises`). A `timeout` bounds the call: on a daemon thread, abandoned past the
limit (Python cannot stop a thread), or cancelled when the function is async. A reward gets
its own copies of the batch (`_copies`). `isolate` (a tool: its spec) runs the function in a
worker process of its own that imports it by its spec and is killed past the limit
(`_Worker`); a run's workers stop when the run ends (`run_workers`). A step's async reward
functions run together on one event loop (`call_concurrently`), as TRL runs them. A
`Recorder` among a call's shared arguments (TRL's `log_metric`) reaches an isolated function
too: its calls there are recorded and made again here when the call returns. What this
means for a user: docs/safety.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import multiprocessing.connection
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from grpo.errors import UserError
from grpo.infra.imports import describe, import_callable, one_line

__all__ = [
    "Failed",
    "Outcome",
    "Recorder",
    "TimedOut",
    "call",
    "call_concurrently",
    "call_function",
    "call_functions_concurrently",
    "run_workers",
    "stop_workers",
]

_START_SECONDS = 120.0  # for a worker to import its function, before the first call's clock starts
_STOP_SECONDS = 5.0  # for a killed worker to be reaped


class Failed(Exception):
    """The function raised (anything), or its worker process died; `description` says how,
    on one line, as the predicate of a sentence: 'raised ValueError: boom'."""

    def __init__(self, description: str):
        super().__init__(description)
        self.description = description


class TimedOut(Exception):
    """The call took longer than the reward's `timeout`."""


class Recorder:
    """A callable given to a reward function among its shared arguments (TRL's `log_metric`,
    `log_extra`): `Recorder(receive)(*args)` is `receive(*args)`. In an isolated function's
    worker process its calls are recorded and sent back with what the function returned, then
    made here, in order, once the call has returned (so a call that failed or timed out made
    none). A UserError that `receive` raises passes through the contained call, as the
    function's own would."""

    def __init__(self, receive):
        self.receive = receive

    def __call__(self, *args) -> None:
        self.receive(*args)


class _Tape:
    """A Recorder's stand-in in a worker process: it adds (its key, the arguments) of every
    call to `calls`, which all the call's tapes share (their order kept)."""

    def __init__(self, key: str, calls: list[tuple[str, tuple]]):
        self.key, self.calls = key, calls

    def __call__(self, *args) -> None:
        self.calls.append((self.key, args))


_RECORDED = "grpo.infra.contain:recorded"  # in a worker's request: a Recorder stands here


Batch = tuple[list, list, dict[str, list], dict[str, Any]]  # prompts, completions, columns, shared


class Contained(Protocol):
    """What `call` needs of a reward (`grpo.rewards.types.WeightedReward`): its function, and
    how its calls are contained."""

    fn: Any  # called as TRL calls a reward (`arguments_for`)
    timeout: float | None  # seconds a call may take; None = no limit
    isolate: bool  # in a worker process that imports `spec`
    spec: str | None  # 'pkg.module:attr'


def call(
    reward: Contained,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: dict[str, Sequence[Any]],
    shared: dict[str, Any] | None = None,
) -> Any:
    """`reward.fn(prompts=..., completions=..., **columns, **shared)` (all by keyword, as TRL's
    GRPOTrainer calls it), contained; what it returns, unchecked. `columns` hold one value
    per completion; `shared` one value for the batch (trainer_state).

    Raises UserError (the function's own, passed through), Failed or TimedOut.
    """
    shared = dict(shared or {})
    if reward.isolate:
        recorders = {key: value for key, value in shared.items() if isinstance(value, Recorder)}
        sent = {key: _RECORDED if key in recorders else value for key, value in shared.items()}
        batch = (list(prompts), list(completions), {key: list(values) for key, values in columns.items()}, sent)
        values, calls = _in_worker(("reward", reward.spec), batch, reward.timeout)
        for key, args in calls:
            recorders[key](*args)
        return values
    batch = _copies(prompts, completions, columns, shared)
    if reward.timeout is None:
        with _SigintNoted() as sigint:
            return _invoke(reward.fn, batch, sigint=sigint)
    return _on_thread(reward.fn, batch, reward.timeout)


def call_function(fn, keywords: dict[str, Any], timeout: float | None, *, spec: str | None = None) -> Any:
    """`fn(**keywords)`, contained as a reward's call is, for callers other than rewards (a
    tool): anything raised, sys.exit and os._exit included, becomes Failed (a real Ctrl-C
    excepted); an awaitable result is run to completion; past `timeout` s, TimedOut (the
    call abandoned on its thread, or cancelled if async). A UserError passes through. No
    copies: the arguments are the caller's to give. With `spec` ('pkg.module:attr', what
    names `fn`), the call runs in a worker process of the spec's own, as an isolated
    reward's does: the keywords and the result travel pickled, and past `timeout` the
    worker is killed."""
    if spec is not None:
        return _in_worker(("tool", spec), keywords, timeout)

    def thunk():
        return fn(**keywords)

    if timeout is None:
        with _SigintNoted() as sigint:
            return _invoke(thunk, _NOTHING, sigint=sigint)
    return _on_thread(thunk, _NOTHING, timeout)


_NOTHING: Batch = ([], [], {}, {})  # what `_invoke` gives a function of no parameters


class Outcome:
    """What one call came to: its values, or the UserError, Failed or TimedOut it raised
    (raised again by `get`, where the caller handles the call's failures)."""

    __slots__ = ("values", "error")

    def __init__(self, values: Any = None, error: BaseException | None = None):
        self.values, self.error = values, error

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.values


def is_async(fn) -> bool:
    """An `async def` function, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def call_concurrently(
    rewards: Sequence[Contained],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: dict[str, Sequence[Any]],
    shared: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
) -> dict[int, Outcome]:
    """`call` for each of `rewards` that is async and not isolated, all on one event loop at
    once; keyed by the reward's index in `rewards`. Empty when fewer than two qualify (one
    call alone gains nothing from a loop of its own). Each call gets its own copies of the
    batch and its own `timeout` (past it, the call is cancelled: TimedOut). `shared`: one
    dict for every call, or one per reward."""
    chosen = [i for i, r in enumerate(rewards) if not r.isolate and is_async(r.fn)]
    if len(chosen) < 2:
        return {}
    shares = [dict(shared or {})] * len(rewards) if shared is None or isinstance(shared, dict) else list(shared)
    batches = [_copies(prompts, completions, columns, dict(shares[i])) for i in chosen]

    def reward_call(reward: Contained, batch: Batch):
        prompts, completions, columns, shared = batch
        positional, keywords = arguments_for(reward.fn, prompts, completions, {**columns, **shared})
        return lambda: reward.fn(*positional, **keywords)

    calls = [(reward_call(rewards[i], batch), rewards[i].timeout) for i, batch in zip(chosen, batches)]
    return dict(zip(chosen, _together(calls)))


def call_functions_concurrently(calls: Sequence[tuple[Any, dict[str, Any], float | None]]) -> list[Outcome]:
    """`fn(**keywords)` for each (fn, keywords, timeout) of `calls`, async functions all (a
    turn's async tool calls, as TRL awaits them), on one event loop at once, each contained
    as `call_function` contains a call and bounded by its own timeout (past it, cancelled:
    TimedOut). One Outcome per call, in order."""
    return _together([((lambda fn=fn, kw=keywords: fn(**kw)), timeout) for fn, keywords, timeout in calls])


def _together(calls: Sequence[tuple[Any, float | None]]) -> list[Outcome]:
    """Each (thunk, timeout) of `calls` run on one event loop at once (`_one`)."""
    if not calls:
        return []

    def run_all(sigint: list) -> list[Outcome]:
        async def together():
            return await asyncio.gather(*(_one(thunk, timeout, sigint) for thunk, timeout in calls))

        return asyncio.run(together())

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        with _SigintNoted() as sigint, _exit_raises():
            return run_all(sigint)
    # This thread runs a loop already (a notebook): asyncio.run needs a thread of its own.
    return _on_thread(lambda: run_all([]), _NOTHING, None)


async def _one(thunk, timeout: float | None, sigint: list) -> Outcome:
    """One call (`thunk()`, awaited if it gives an awaitable) inside `_together`'s loop, as
    `_invoke` makes it: everything raised becomes the Outcome's error (a real Ctrl-C
    excepted), so that one function's failure, sys.exit included, neither stops the others
    nor the loop."""
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            values = thunk()
            if inspect.isawaitable(values):
                values = await values
        return Outcome(values)
    except (UserError, Failed) as exc:
        return Outcome(error=exc)
    except KeyboardInterrupt as exc:
        if sigint:
            raise
        return Outcome(error=Failed(_description(exc)))
    except BaseException as exc:
        if scope.expired():
            return Outcome(error=TimedOut())
        if isinstance(exc, asyncio.CancelledError) and asyncio.current_task().cancelling():
            raise  # the loop itself is being stopped, not this call
        return Outcome(error=Failed(_description(exc)))


def arguments_for(fn, prompts: list, completions: list, others: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """How `fn` is called: as TRL's GRPOTrainer calls a reward, all by keyword
    (`prompts=`, `completions=`, then `others`), when it names either argument, takes
    only **kwargs, or its first two parameters are named after arguments of `others`
    (`def f(environments, trainer_state, **kw)`); a function that names neither but takes
    two other positional parameters (`lambda p, c, **kw: ...`) gets the two positionally. Of
    `others` it gets all when it has **kwargs, else those it names (so `def f(prompts,
    completions)` still works)."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a callable without a signature: TRL's way
        return (), {"prompts": prompts, "completions": completions, **others}
    kinds = inspect.Parameter
    named = {p.name for p in parameters if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in parameters)
    positional = [p for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    extras = others if var_keyword else {k: v for k, v in others.items() if k in named}
    if named & {"prompts", "completions"} or len(positional) < 2 or {p.name for p in positional[:2]} <= set(others):
        given = {k: v for k, v in (("prompts", prompts), ("completions", completions)) if var_keyword or k in named}
        return (), {**given, **extras}
    extras = {k: v for k, v in extras.items() if k not in {positional[0].name, positional[1].name}}
    return (prompts, completions), extras


def _copies(
    prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, Sequence[Any]], shared: dict[str, Any]
) -> Batch:
    """The batch one call gets: its lists and dicts fresh at every depth (`_fresh`)."""
    return (
        [_fresh(p) for p in prompts],
        [_fresh(c) for c in completions],
        {key: [_fresh(v) for v in values] for key, values in columns.items()},
        shared,
    )


def _fresh(value: Any) -> Any:
    """`value` with its lists and dicts copied at every depth (chat messages, list-valued
    columns, shared by a row's G completions and by the dataset), so that a function that
    edits them in place breaks neither the step nor the functions after it. Other objects
    (strings, numbers, arrays, images) are shared: copying them could cost a large column per
    function per step, and they are rarely edited in place."""
    if type(value) is list:
        return [_fresh(v) for v in value]
    if type(value) is dict:
        return {k: _fresh(v) for k, v in value.items()}
    return value


class _ExitCalled(BaseException):
    """os._exit(code), called by contained code on its own thread: raised in its place."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


_contained = threading.local()  # .depth: contained calls under way on this thread
_guard = {"calls": 0, "exit": None, "pid": None}  # calls under way in the process; the os._exit it replaced
_guard_lock = threading.Lock()


def _raising_exit(code):
    if getattr(_contained, "depth", 0) and os.getpid() == _guard["pid"]:
        raise _ExitCalled(code)
    _guard["exit"](code)  # another thread's, or a forked child's: the real one


@contextlib.contextmanager
def _exit_raises():
    """While contained code runs on this thread, os._exit called there raises _ExitCalled
    (module doc). Put back once no contained call is under way in the process, abandoned
    ones included (they leave when they return)."""
    with _guard_lock:
        if _guard["calls"] == 0:
            _guard.update(exit=os._exit, pid=os.getpid())
            os._exit = _raising_exit
        _guard["calls"] += 1
    _contained.depth = getattr(_contained, "depth", 0) + 1
    try:
        yield
    finally:
        _contained.depth -= 1
        with _guard_lock:
            _guard["calls"] -= 1
            if _guard["calls"] == 0 and os._exit is _raising_exit:
                os._exit = _guard["exit"]


def _description(exc: BaseException) -> str:
    if isinstance(exc, _ExitCalled):
        return f"called os._exit({one_line(repr(exc.code))})"
    if isinstance(exc, SystemExit):
        return "called sys.exit()" if exc.code is None else f"called sys.exit({one_line(repr(exc.code))})"
    return f"raised {describe(exc)}"


def _invoke(
    fn, batch: Batch, *, deadline: float | None = None, sigint: list | tuple = (), in_worker: bool = False
) -> Any:
    """Call `fn` on `batch` here; an awaitable result is run to completion (cancelled at
    `deadline`). Everything it raises but a UserError becomes Failed, except a
    KeyboardInterrupt that follows a SIGINT noted in `sigint` (a real Ctrl-C); so does
    os._exit, unless `in_worker` (a worker's death is its own containment, and said so)."""
    prompts, completions, columns, shared = batch
    try:
        positional, keywords = arguments_for(fn, prompts, completions, {**columns, **shared})
        with contextlib.nullcontext() if in_worker else _exit_raises():
            values = fn(*positional, **keywords)
            if inspect.isawaitable(values):
                values = _await(values, deadline)
        return values
    except (UserError, Failed, TimedOut):
        raise
    except KeyboardInterrupt as exc:
        if sigint:
            raise
        raise Failed(_description(exc)) from exc
    except BaseException as exc:
        raise Failed(_description(exc)) from exc


def _await(awaitable, deadline: float | None) -> Any:
    async def bounded():
        task = asyncio.ensure_future(awaitable)
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        await asyncio.wait({task}, timeout=timeout)
        if not task.done():
            task.cancel()  # cooperative code stops here: an HTTP client closes its request
            raise TimedOut
        return task.result()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(bounded())
    # This thread runs a loop already (a notebook): asyncio.run needs a thread of its own.
    return _on_thread(lambda: asyncio.run(bounded()), _NOTHING, None)


def _on_thread(fn, batch: Batch, timeout: float | None) -> Any:
    """`_invoke` on a daemon thread, waited for at most `timeout` s, then abandoned."""
    deadline = None if timeout is None else time.monotonic() + timeout
    outcome: dict[str, Any] = {}

    def run():
        try:
            outcome["values"] = _invoke(fn, batch, deadline=deadline)
        except BaseException as exc:  # already a UserError, Failed or TimedOut
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"reward {getattr(fn, '__name__', fn)}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimedOut
    if "error" in outcome:
        raise outcome["error"]
    return outcome["values"]


class _SigintNoted:
    """Chains a handler in front of the current SIGINT handler that notes the signal (in the
    list it yields) and then does what the current one does. Only on the main thread, and
    only over a Python handler: with SIG_IGN or SIG_DFL no KeyboardInterrupt can come of it."""

    def __enter__(self) -> list:
        self.noted: list[int] = []
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            current = signal.getsignal(signal.SIGINT)
            if callable(current):
                self.previous = current
                signal.signal(signal.SIGINT, self._note)
        return self.noted

    def _note(self, signum, frame):
        self.noted.append(signum)
        self.previous(signum, frame)

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


# ---- isolation: a worker process per spec ---------------------------------------------------

# The worker's first line: the training process's sys.path, then this file loaded by its path,
# so that the worker imports neither torch nor the user's __main__ (a script that calls
# grpo.train needs no `if __name__ == "__main__"` guard), and a restart costs an interpreter
# and the user's module.
_BOOT = (
    "import json, sys, importlib.util as u; sys.path[:] = json.loads(sys.argv[1]); "
    "s = u.spec_from_file_location('grpo_reward_worker', sys.argv[2]); m = u.module_from_spec(s); "
    "s.loader.exec_module(m); m._serve(sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))"
)

# What a worker is called with, by kind: a reward's batch, or a tool's keywords.
_ARGUMENTS = {"reward": "a batch", "tool": "arguments"}


class _Worker:
    """A process that imports one reward function or tool by its spec and calls it on
    request (`kind`: 'reward' or 'tool'). A fresh interpreter (subprocess, not
    multiprocessing) with the training process's sys.path and working directory; arguments
    and results travel pickled. It ignores SIGINT (a Ctrl-C is the training process's) and
    exits when the training process ends, however it ends: the pipe `alive` closes. Unix
    only: it inherits its two descriptors."""

    def __init__(self, kind: str, spec: str):
        self.kind = kind
        ours, theirs = socket.socketpair()
        watched, self.alive = os.pipe()  # the worker exits when `alive` closes: when we stop it, or end
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _BOOT,
                    json.dumps([str(p) for p in sys.path]),
                    __file__,
                    kind,
                    spec,
                    str(theirs.fileno()),
                    str(watched),
                ],
                pass_fds=(theirs.fileno(), watched),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            os.close(self.alive)
            raise
        finally:
            theirs.close()
            os.close(watched)
        self.conn = multiprocessing.connection.Connection(ours.detach())
        try:
            self.receive(_START_SECONDS, starting=True)
        except BaseException:
            self.stop()
            raise

    def call(self, request: Batch | dict[str, Any], timeout: float | None) -> Any:
        try:
            data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # a column value that does not pickle: nothing was sent
            what = _ARGUMENTS[self.kind]
            raise Failed(f"got {what} that cannot be sent to its worker process ({describe(exc)})") from exc
        self.conn.send_bytes(data)
        return self.receive(timeout)

    def receive(self, timeout: float | None, *, starting: bool = False) -> Any:
        if not self.conn.poll(timeout):
            if starting:
                raise Failed(f"did not start in its worker process within {_START_SECONDS:g} s")
            raise TimedOut
        try:
            data = self.conn.recv_bytes()
        except EOFError:
            raise Failed(f"ended its worker process ({self._how_it_ended()})") from None
        try:
            kind, payload = pickle.loads(data)
        except Exception as exc:
            raise Failed(f"returned a value that does not unpickle from its worker process ({describe(exc)})") from exc
        if kind == "user_error":
            raise UserError(payload)
        if kind == "failed":
            raise Failed(payload)
        return payload

    def _how_it_ended(self) -> str:
        try:
            code = self.process.wait(_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            return "it closed its connection"
        if code >= 0:
            return f"exit code {code}"
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(_STOP_SECONDS)
        self.conn.close()
        os.close(self.alive)


_workers: dict[tuple[str, str], _Worker] = {}  # (kind, spec) -> its worker, in the run under way (`run_workers`)
_runs = {"depth": 0}  # run_workers scopes entered and not yet left, in the process
_runs_lock = threading.Lock()


def _in_worker(key: tuple[str, str], request: Batch | dict[str, Any], timeout: float | None) -> Any:
    worker = _workers.get(key)
    if worker is not None and worker.process.poll() is not None:  # it died between calls (an OOM kill)
        _workers.pop(key).stop()
        worker = None
    if worker is None:
        worker = _workers[key] = _Worker(*key)
    try:
        return worker.call(request, timeout)
    except (UserError, Failed):
        if worker.process.poll() is not None:  # it died: the next call starts a fresh one
            _workers.pop(key).stop()
        raise
    except BaseException:
        # Past the limit, or interrupted while waiting (a real Ctrl-C): the worker may still be
        # busy, and an answer that came late would be read as the next call's.
        _workers.pop(key).stop()
        raise


@contextlib.contextmanager
def run_workers():
    """The scope of one run (`grpo.train`, an evaluation, `sft`, a demo), as a `with` or a
    decorator: the outermost one gives the calls made inside it a table of workers of their
    own and stops them all when it ends, by a return, an exception or a Ctrl-C. So no worker
    outlives its run, and the next run in the process (a notebook's, the user's reward edited
    in between) imports the user's code afresh in new workers. A scope inside another (a
    demo's evaluations) shares the outer one's workers."""
    global _workers
    with _runs_lock:
        outermost = _runs["depth"] == 0
        _runs["depth"] += 1
        if outermost:
            before, _workers = _workers, {}  # those started outside any run are not the run's
    try:
        yield
    finally:
        with _runs_lock:
            _runs["depth"] -= 1
            if outermost:
                ours, _workers = _workers, before
        if outermost:
            _stop(ours)


def stop_workers() -> None:
    """Stop the workers of the run under way, or where none is, those started outside any run
    (`run_workers`); all stop anyway when this process ends."""
    _stop(_workers)


def _stop(workers: dict[tuple[str, str], _Worker]) -> None:
    while workers:
        workers.popitem()[1].stop()


def _exit_when_closed(fd: int) -> None:
    """Exit the worker when the training process closes its end of the pipe `fd` (it
    stopped the worker, or it ended, however), even in the middle of a runaway call."""
    while os.read(fd, 1):
        pass
    os._exit(1)


def _recording(fn, batch: Batch) -> tuple[Any, list[tuple[str, tuple]]]:
    """A reward's call in its worker, each Recorder of its shared arguments a _Tape: what it
    returned, and the recorders' calls, (key, args) in the order made."""
    prompts, completions, columns, shared = batch
    calls: list[tuple[str, tuple]] = []
    shared = {
        key: _Tape(key, calls) if isinstance(value, str) and value == _RECORDED else value
        for key, value in shared.items()
    }
    return _invoke(fn, (prompts, completions, columns, shared), in_worker=True), calls


def _serve(kind: str, spec: str, fd: int, watched: int) -> None:
    """The worker's main loop: import the function, say ready, then answer calls until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the training process's to handle
    threading.Thread(target=_exit_when_closed, args=(watched,), name="exit with parent", daemon=True).start()
    conn = multiprocessing.connection.Connection(fd)
    try:
        fn = import_callable(spec, kind=kind)
    except UserError as exc:
        conn.send_bytes(pickle.dumps(("user_error", f"{exc} (in its worker process)")))
        return
    except BaseException as exc:
        conn.send_bytes(pickle.dumps(("failed", f"{_description(exc)} on import in its worker process")))
        return
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        try:
            request = pickle.loads(data)
            if kind == "tool":
                reply = ("ok", _invoke(lambda: fn(**request), _NOTHING, in_worker=True))
            else:
                reply = ("ok", _recording(fn, request))
        except UserError as exc:
            reply = ("user_error", str(exc))
        except Failed as exc:
            reply = ("failed", exc.description)
        except Exception as exc:  # a column value that does not unpickle here
            reply = ("failed", f"got {_ARGUMENTS[kind]} its worker process cannot unpickle ({describe(exc)})")
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            data = pickle.dumps(("failed", f"returned a value its worker process cannot send back ({describe(exc)})"))
        conn.send_bytes(data)
