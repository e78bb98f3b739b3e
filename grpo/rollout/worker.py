"""A generator in a process of its own (rollout.async): `WorkerGenerator`, and `build_generator`.

The worker is spawned (a fresh interpreter, nothing inherited but its arguments) on
rollout.async.threads torch threads. It loads the policy from the run's model, builds the
LocalGenerator the trainer would build from the same `GeneratorSpec` (tools and the
environment from the config, the same seeds), and serves messages from one queue, in the
order sent: `weights` (a version, published through `SharedFile`: merged LoRA, gathered
shards) and `sample` (a purpose, a step, its rows and seeds). So what it samples is decided
by the trainer alone. Weights and batches travel as files of a private folder, written whole
before their name is sent: no read waits on a writer that died. A batch is tensors and plain
data, read with `torch.load(weights_only=True)` (its environments, user objects, sealed with
the run's key): a file planted in the folder runs no code. The worker is no daemon, so that a
tool may start processes; it leads a process group of its own, which the processes its tools
start join. It ignores Ctrl-C (the trainer stops it, then ends what is left in its group), and
ends itself and its group the moment the trainer is gone; the trainer turns a failed, dead or
silent worker into one line (`take`). Docs: docs/async.md.
"""

from __future__ import annotations

import dataclasses
import hmac
import multiprocessing
import multiprocessing.util
import os
import pickle
import queue
import shutil
import signal
import sys
import threading
import time
import warnings

import torch

from grpo.errors import UserError, first_line
from grpo.refusals import refuse
from grpo.infra.distributed import SingleProcess, World
from grpo.infra.space import no_space
from grpo.rollout import decoders
from grpo.rollout.batch import Rollout
from grpo.rollout.generator import TRAIN, Generator, GeneratorSpec, LocalGenerator
from grpo.rollout.tools import Toolbox
from grpo.rollout.weights import (
    ROOM,
    SharedFile,
    base_model,
    load_weights,
    read_weights,
    weights_bytes,
    weights_folder,
)

POLL_S = 0.5  # how often a waiting side checks that the other is still there
NAME = "grpo-generator"  # the worker process's name
UNGUARDED = 87  # the worker's exit code when the main script it imports calls grpo.train
REFUSED = 'rollout.async: the generator process imports the main script again: put its call of grpo.train under if __name__ == "__main__":'


def build_generator(
    spec: GeneratorSpec,
    tokenizer,
    *,
    tools: Toolbox | None = None,
    world: World = SingleProcess(),
    worker: bool = False,
) -> Generator:
    """The run's generator: in this process (`tools`: the run's Toolbox, already checked),
    or, with `worker` (rollout.async), in a process of its own that builds the same
    LocalGenerator from `spec`."""
    if worker:
        return WorkerGenerator(spec)
    return LocalGenerator.of(spec, tokenizer, tools, world)


def refuse_in_generator() -> None:
    """End the worker process, quietly, where training starts inside it: a spawned process
    imports the parent's main script again before it runs, and a script that calls
    grpo.train at its top level would train again there. The trainer says why, in one line
    (`WorkerGenerator._gone`)."""
    if multiprocessing.current_process().name == NAME:
        os._exit(UNGUARDED)


def _plain_if_uncaught(error: UserError) -> None:
    """Print `error`, or the UserError that carries it, as one line rather than a traceback
    should it end the script: the refusal of an unguarded script reaches its top level."""
    previous = sys.excepthook

    def hook(kind, value, traceback):
        cause = value
        while cause is not None and cause is not error:
            cause = cause.__cause__
        if cause is None:
            return previous(kind, value, traceback)
        print(f"grpo: error: {value}", file=sys.stderr)

    sys.excepthook = hook


FIELDS = frozenset(f.name for f in dataclasses.fields(Rollout))


def _key() -> bytes:
    """The run's secret: the trainer's multiprocessing key, which the spawned worker inherits
    and nothing else holds."""
    return bytes(multiprocessing.current_process().authkey)


def _seal(value) -> dict:
    """`value` (user objects: an environment's instances) pickled, with a MAC under `_key`:
    the trainer unpickles only what its own worker sealed."""
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return {"data": data, "mac": hmac.new(_key(), data, "sha256").digest()}


def _unseal(sealed, path: str):
    data, mac = (sealed.get("data"), sealed.get("mac")) if isinstance(sealed, dict) else (None, None)
    if not (isinstance(data, bytes) and isinstance(mac, bytes)):
        raise UserError(f"rollout.async: refused {path}: its environments are not sealed as the generator seals them")
    if not hmac.compare_digest(mac, hmac.new(_key(), data, "sha256").digest()):
        raise UserError(f"rollout.async: refused {path}: its environments carry no seal of this run's generator")
    return pickle.loads(data)  # sealed by our worker, with a key only it and this process hold


def _put_rollout(folder: str, step: int, rollout: Rollout, asked: list[dict]) -> str:
    """`rollout` saved into a new file of `folder` (written whole, then renamed) as tensors and
    plain data; its path. `asked` are the rows the request gave: each row is sent as what
    changed in it (an environment's reset rewrites its prompt), so that the trainer's rows come
    back as they were (a value of any type). A full folder is a one-line error."""
    fields = {name: getattr(rollout, name) for name in FIELDS}
    repeated = [row for row in asked for _ in range(rollout.group_size)]
    fields["rows"] = [
        {k: v for k, v in row.items() if k not in given or given[k] is not v}
        for row, given in zip(rollout.rows, repeated)
    ]
    if rollout.environments is not None:
        fields["environments"] = _seal(rollout.environments)
    path = os.path.join(folder, f"rollout-{step}-{time.monotonic_ns()}.pt")
    try:
        with open(path + ".part", "wb") as f:  # ordinary writes: a full folder raises, never faults
            torch.save(fields, f)
    except OSError as err:
        if os.path.exists(path + ".part"):
            os.unlink(path + ".part")
        if no_space(err) is not None:
            raise UserError(f"no room for a batch in {folder} ({err.strerror}): {ROOM}") from None
        raise
    os.replace(path + ".part", path)
    return path


def _why(err: Exception) -> str:
    """What torch's weights-only loader refused (its message's core: a global, an opcode), or the error's first line."""
    text = str(err)
    if "WeightsUnpickler error:" in text:
        return text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()[0].split(". ")[0]
    return f"{type(err).__name__}: {first_line(err)}"


def _take_rollout(path: str, asked: list[dict]) -> Rollout:
    """The batch `_put_rollout` wrote at `path` (removed once read), its rows rebuilt from
    `asked`; a file that is anything else is refused in one line and runs nothing."""
    try:
        with warnings.catch_warnings():  # torch warns of a planted pickle's protocol: the refusal says it all
            warnings.simplefilter("ignore")
            fields = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle.UnpicklingError (a global outside the allow-list), a file torch cannot read
        raise UserError(f"rollout.async: refused {path}: not a batch of tensors and plain data ({_why(err)})") from None
    finally:
        if os.path.exists(path):
            os.unlink(path)
    if not isinstance(fields, dict) or set(fields) != FIELDS or not isinstance(fields["rows"], list):
        raise UserError(f"rollout.async: refused {path}: not a batch of the fields the generator writes")
    repeated = [row for row in asked for _ in range(fields["group_size"])]
    fields["rows"] = [{**given, **changed} if changed else given for changed, given in zip(fields["rows"], repeated)]
    if fields["environments"] is not None:
        fields["environments"] = _unseal(fields["environments"], path)
    return Rollout(**fields)


def batches_bytes(rollout) -> int:
    """What the batches in transit may take at once, generously: max_staleness + 1 batches
    of prompts_per_step x group_size rows, each (prompt + completion) tokens of 32 bytes (ids,
    masks, log-probs and text); a prompt of no set limit counted as long as a completion.
    `rollout`: a grpo.config.RolloutConfig."""
    tokens = (rollout.max_prompt_length or rollout.max_new_tokens) + rollout.max_new_tokens
    return (rollout.async_.max_staleness + 1) * rollout.prompts_per_step * rollout.group_size * tokens * 32


def _lead_a_group() -> None:
    """Make this process the leader of a process group of its own, which the processes its
    tools start join: whatever they leave, the trainer ends with it (`_end_group`); Ctrl-C at
    a terminal (sent to the trainer's group) reaches none of them."""
    if hasattr(os, "setpgid"):
        os.setpgid(0, 0)


def _end_group(group: int) -> None:
    """SIGKILL to every process still in process group `group` (a worker's: its tools'
    processes; the worker too, if it still runs)."""
    if hasattr(os, "killpg"):
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # none left


def _end_with_the_trainer(parent, folder: str) -> None:
    """A thread that, the moment the trainer is gone (killed: it cannot stop us), removes the
    run's folder and ends this process and its group (what its tools started), whatever the
    process is doing then (sampling, in a tool's call)."""
    trainer = os.getppid()

    def watch():
        while parent.is_alive() and os.getppid() == trainer:  # a parent gone: its pipe closed, or us adopted
            parent.join(POLL_S)
        shutil.rmtree(folder, ignore_errors=True)  # what it left
        if hasattr(os, "getpgid") and os.getpgid(0) == os.getpid():
            _end_group(os.getpid())  # our own group: this process included
        os._exit(0)

    threading.Thread(target=watch, name="grpo-trainer-watch", daemon=True).start()


def _serve(spec: GeneratorSpec, requests, results) -> None:
    """The worker process: serve `weights` and `sample` messages until `stop` (or until the
    trainer is gone); an error goes back as one line, and ends the process."""
    from tqdm import tqdm

    from grpo.infra.hf import load_tokenizer
    from grpo.infra.seed import seed_everything
    from grpo.infra.hf import load_causal_lm

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the trainer stops us
    # tqdm's default lock is a named semaphore the trainer's resource tracker would report as
    # leaked were this process killed: a thread's lock is not.
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(spec.threads)
    _lead_a_group()
    parent = multiprocessing.parent_process()
    if parent is not None:
        _end_with_the_trainer(parent, spec.folder)
    try:
        seed_everything(spec.seed + 1_000_003 * spec.rank)  # the global stream iterative RL's samples draw from
        tokenizer = load_tokenizer(spec.model)
        policy = load_causal_lm(spec.model, spec.dtype, device=spec.device)
        # A version's fused weights serve every batch it samples (`Sampler`'s hold_prepared).
        local = LocalGenerator.of(spec, tokenizer, Toolbox.from_config(spec.rollout), hold_prepared=True)
        try:
            _answer(spec, local, policy, requests, results)
        finally:
            local.close()  # the engine it built (vLLM in this process) shut down, as the trainer's is
    except BaseException as err:  # anything: the trainer must hear of it, not wait for a batch
        message = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {first_line(err)}"
        results.put(("error", message))


def _answer(spec: GeneratorSpec, local: LocalGenerator, policy, requests, results) -> None:
    """`_serve`'s loop: load the weights sent, sample the batches asked, until `stop`."""
    idle, since = 0.0, time.perf_counter()
    while True:
        message = requests.get()  # the trainer's death ends us meanwhile (`_end_with_the_trainer`)
        if message[0] == "stop":
            return
        if message[0] == "weights":
            _, version, path, layout, aliases = message
            weights = read_weights(path, layout, aliases)
            load_weights(policy, weights)
            del weights
            local.publish(policy, version)  # vLLM in this process: its engine syncs and checks
            continue
        _, purpose, step, rows, seeds = message
        idle += time.perf_counter() - since  # waiting for a request and its weights
        local.request(step, rows, seeds, purpose)
        rollout = local.take(step, purpose)
        if purpose == TRAIN and rollout.sampled_logprobs is None:
            refuse("async+auto-hf")
        seconds = {"generate": local.seconds["generate"], "idle": idle}
        path = _put_rollout(spec.folder, step, rollout.to("cpu"), rows)
        results.put(("rollout", purpose, step, path, seconds))
        idle, since = 0.0, time.perf_counter()


def refuse_auto_generate(rollout, policy) -> None:
    """rollout.sampler: auto falls back to `generate` for a model the fast loop cannot run,
    and `generate` returns no log-probs: refuse it (`async+auto-hf`), here for the shortest
    sequence, and in the worker for each batch's (a sliding window may fit one and not another).
    The worker samples a plain model (LoRA merged): a trainer's LoRA policy is asked as its base."""
    model = base_model(policy)
    if rollout.sampler == decoders.AUTO and decoders.choose(decoders.AUTO, model, 1 + rollout.max_new_tokens) == "hf":
        refuse("async+auto-hf")


def _stop(process, requests, results, folder: str) -> None:
    """Stop a worker (asked, then killed after a grace), end what its tools left in its group,
    close its queues, remove its folder: `WorkerGenerator.close`, and at the trainer's exit
    should nothing have closed it (before multiprocessing joins the processes that are no
    daemon, which would wait on the worker forever)."""
    if process.is_alive():
        try:
            requests.put(("stop",))
        except (OSError, ValueError):
            pass
        process.join(timeout=5)
    if process.is_alive():
        process.kill()
        process.join(timeout=5)
    _end_group(process.pid)  # its group outlives it while a process in it runs: its id is not reused meanwhile
    for q in (requests, results):
        q.cancel_join_thread()  # nothing left to flush to a process that is gone
        q.close()
    shutil.rmtree(folder, ignore_errors=True)  # weights it never read, batches never taken


class WorkerGenerator:
    """The trainer's side of a worker process: publishing writes the weights into a file
    of the private folder, a request is a message, `take` waits for the step's batch (within
    rollout.async.timeout, watching that the worker lives), keeping those that come first.
    The process starts with the run (`start`, or the first publish): the folder is chosen then,
    from the policy's size, for every version."""

    def __init__(self, spec: GeneratorSpec):
        self.spec, self.timeout, self.rollout = spec, spec.rollout.async_.timeout, spec.rollout
        context = torch.multiprocessing.get_context("spawn")
        self.context, self.requests, self.results = context, context.Queue(), context.Queue()
        self.process = self.folder = self.publisher = None
        self.published, self.closed = None, False
        self.asked: dict[tuple[str, int], list[dict]] = {}
        self.ready: dict[tuple[str, int], tuple[Rollout, dict]] = {}
        self.seconds = {"generate": 0.0, "idle": 0.0}

    def _launch(self, policy=None) -> None:
        """Choose the folder (room for two versions of the weights, the one the worker reads
        and the next one written, and the batches) and start the worker."""
        if self.process is not None:
            return
        need = (2 * weights_bytes(policy) if policy is not None else 0) + batches_bytes(self.rollout)
        self.folder = self.spec.folder = weights_folder(need, "rollout.async")
        # No daemon: a daemon may not start processes, and a tool may (a process pool).
        self.process = self.context.Process(
            target=_serve, args=(self.spec, self.requests, self.results), name=NAME, daemon=False
        )
        self.process.start()
        # At exit multiprocessing joins the processes that are no daemon: this runs first (its priority).
        self._finalizer = multiprocessing.util.Finalize(
            self, _stop, args=(self.process, self.requests, self.results, self.folder), exitpriority=100
        )
        self.publisher = SharedFile(self.folder, self.requests.put, self._wait_for_room)

    def start(self, policy) -> None:
        """Refuse now what the worker's samplers would refuse at their first batch (the rest of
        what they refuse comes back from `take`); start the worker."""
        refuse_auto_generate(self.rollout, policy)
        self._launch(policy)

    def publish(self, policy, version: int) -> None:
        self._launch(policy)
        self.room_until, self.patience = time.monotonic() + self.timeout, 10
        self.publisher.publish(policy, version)
        self.published = version

    def _wait_for_room(self, error: OSError) -> None:
        """The folder is full as a version is written: the worker frees each version as it
        loads it, so wait while it has some to read (and a few polls for the one it loads),
        within rollout.async.timeout; then one line."""
        if not self.process.is_alive():
            raise self._gone()
        if self.publisher.unread() == 0:
            self.patience -= 1
        if self.patience < 0 or time.monotonic() > self.room_until:
            raise UserError(f"rollout.async: no room for the weights in {self.folder} ({error.strerror}): {ROOM}")
        time.sleep(POLL_S)

    def request(self, step: int, rows: list[dict], seeds: list[int] | None = None, purpose: str = TRAIN) -> None:
        self._launch()
        self.asked[(purpose, step)] = rows
        self.requests.put(("sample", purpose, step, rows, seeds))

    def take(self, step: int, purpose: str = TRAIN) -> Rollout:
        deadline = time.monotonic() + self.timeout
        while (purpose, step) not in self.ready:
            got, path, seconds = self._receive(deadline)
            self.ready[got] = (_take_rollout(path, self.asked.pop(got)), seconds)
        rollout, self.seconds = self.ready.pop((purpose, step))
        return rollout

    def _receive(self, deadline: float):
        """The worker's next batch; a one-line UserError when it failed, died, or sent nothing
        before `deadline`."""
        while True:
            try:
                message = self.results.get(timeout=max(min(POLL_S, deadline - time.monotonic()), 0.01))
            except queue.Empty:
                if not self.process.is_alive():
                    raise self._gone() from None
                if time.monotonic() >= deadline:
                    raise UserError(
                        f"rollout.async: the generator sent no batch in {self.timeout:g} s (rollout.async.timeout): "
                        "it hangs, or samples slower than that"
                    ) from None
                continue
            if message[0] == "error":
                raise UserError(f"rollout.async: the generator failed: {message[1]}")
            _, purpose, step, path, seconds = message
            return (purpose, step), path, seconds

    def _gone(self) -> UserError:
        """Why the worker process is no longer there, in one line."""
        code = self.process.exitcode
        if code == UNGUARDED:
            error = UserError(REFUSED)
            _plain_if_uncaught(error)
            return error
        return UserError(
            f"rollout.async: the generator process died (exit code {code}) without a word: killed, out of memory, "
            "or stopped as it started (its error is above)"
        )

    def close(self) -> None:
        """Stop the worker and what its tools started; what it sampled ahead is discarded (a
        resume samples it again)."""
        if self.closed:
            return
        self.closed = True
        if self.process is not None:
            self._finalizer()
            return
        for q in (self.requests, self.results):
            q.cancel_join_thread()
            q.close()
