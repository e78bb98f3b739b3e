"""A generator in a process of its own (rollout.async): `WorkerGenerator`, and `build_generator`.

The worker is spawned (a fresh interpreter, nothing inherited but its arguments) on
rollout.async.threads torch threads. It loads the policy from the run's model, builds the
LocalGenerator the trainer would build from the same `GeneratorSpec` (tools and the
environment from the config, the same seeds), and serves messages from one queue, in the
order sent: `weights` (a version, published through `SharedFile`: merged LoRA, gathered
shards) and `sample` (a purpose, a step, its rows and seeds). So what it samples is decided
by the trainer alone. Weights and batches travel as files of a private folder, written whole
before their name is sent: no read waits on a writer that died. The worker ignores Ctrl-C
(the trainer stops it) and exits when the trainer is gone; the trainer turns a failed, dead or
silent worker into one line (`take`).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import shutil
import signal
import sys
import threading
import time

import torch

from grpo.errors import UserError, first_line
from grpo.refusals import refuse
from grpo.infra.distributed import SingleProcess, World
from grpo.rollout import decoders
from grpo.rollout.batch import Rollout
from grpo.rollout.generator import TRAIN, Generator, GeneratorSpec, LocalGenerator, samplers_of
from grpo.rollout.tools import Toolbox
from grpo.rollout.weights import SharedFile, base_model, load_weights, read_weights, weights_folder

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
    return LocalGenerator(samplers_of(spec, tokenizer, tools), world)


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


def _put_rollout(folder: str, step: int, rollout: Rollout) -> str:
    """`rollout` pickled into a new file of `folder` (written whole, then renamed); its path."""
    path = os.path.join(folder, f"rollout-{step}-{time.monotonic_ns()}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump(rollout, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(path + ".part", path)
    return path


def _take_rollout(path: str) -> Rollout:
    with open(path, "rb") as f:
        data = f.read()
    os.unlink(path)
    return pickle.loads(data)  # the worker's own batch, in the run's private folder (not a user's file)


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
    parent = multiprocessing.parent_process()
    try:
        seed_everything(spec.seed + 1_000_003 * spec.rank)  # the global stream iterative RL's samples draw from
        tokenizer = load_tokenizer(spec.model)
        policy = load_causal_lm(spec.model, spec.dtype, device=spec.device)
        local = LocalGenerator(samplers_of(spec, tokenizer, Toolbox.from_config(spec.rollout)))
        for sampler in local.samplers.values():
            sampler.hold_prepared = True  # a version's fused weights serve every batch it samples
        idle, since = 0.0, time.perf_counter()
        while True:
            try:
                message = requests.get(timeout=POLL_S)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    shutil.rmtree(spec.folder, ignore_errors=True)  # what it left
                    return  # the trainer is gone (killed): nobody to sample for
                continue
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
            results.put(("rollout", purpose, step, _put_rollout(spec.folder, step, rollout.to("cpu")), seconds))
            idle, since = 0.0, time.perf_counter()
    except BaseException as err:  # anything: the trainer must hear of it, not wait for a batch
        message = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {first_line(err)}"
        results.put(("error", message))


def refuse_auto_generate(rollout, policy) -> None:
    """rollout.sampler: auto falls back to `generate` for a model the fast loop cannot run,
    and `generate` returns no log-probs: refuse it (`async+auto-hf`), here for the shortest
    sequence, and in the worker for each batch's (a sliding window may fit one and not another).
    The worker samples a plain model (LoRA merged): a trainer's LoRA policy is asked as its base."""
    model = base_model(policy)
    if rollout.sampler == decoders.AUTO and decoders.choose(decoders.AUTO, model, 1 + rollout.max_new_tokens) == "hf":
        refuse("async+auto-hf")


class WorkerGenerator:
    """The trainer's side of a worker process: publishing writes the weights into a file
    of the private folder, a request is a message, `take` waits for the step's batch (within
    rollout.async.timeout, watching that the worker lives), keeping those that come first."""

    def __init__(self, spec: GeneratorSpec):
        self.timeout, self.rollout = spec.rollout.async_.timeout, spec.rollout
        self.folder = weights_folder()
        spec.folder = self.folder
        context = torch.multiprocessing.get_context("spawn")
        self.requests, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=_serve, args=(spec, self.requests, self.results), name=NAME, daemon=True)
        self.process.start()
        self.publisher = SharedFile(self.folder, self.requests.put)
        self.published, self.closed = None, False
        self.ready: dict[tuple[str, int], tuple[Rollout, dict]] = {}
        self.seconds = {"generate": 0.0, "idle": 0.0}

    def start(self, policy) -> None:
        """Refuse now what the worker's samplers would refuse at their first batch; the rest of
        what they refuse comes back from `take`."""
        refuse_auto_generate(self.rollout, policy)

    def publish(self, policy, version: int) -> None:
        self.publisher.publish(policy, version)
        self.published = version

    def request(self, step: int, rows: list[dict], seeds: list[int] | None = None, purpose: str = TRAIN) -> None:
        self.requests.put(("sample", purpose, step, rows, seeds))

    def take(self, step: int, purpose: str = TRAIN) -> Rollout:
        deadline = time.monotonic() + self.timeout
        while (purpose, step) not in self.ready:
            got, path, seconds = self._receive(deadline)
            self.ready[got] = (_take_rollout(path), seconds)
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
        """Stop the worker; what it sampled ahead is discarded (a resume samples it again)."""
        if self.closed:
            return
        self.closed = True
        if self.process.is_alive():
            try:
                self.requests.put(("stop",))
            except (OSError, ValueError):
                pass
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        for q in (self.requests, self.results):
            q.cancel_join_thread()  # nothing left to flush to a process that is gone
            q.close()
        shutil.rmtree(self.folder, ignore_errors=True)  # weights it never read, batches never taken
