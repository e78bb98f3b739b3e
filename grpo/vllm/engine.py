"""One vLLM engine in the training process, fed the policy's weights (docs/vllm.md).

`LocalEngine` holds one vLLM `LLM`, built from the policy's config alone (vLLM's "dummy"
load), in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) on the policy's device, so the
first sync is what loads the real weights and the check after it proves them.

A sync is vLLM's in-place reload (`reload_weights`), which reruns each layer's loaders; a
tied head is sent as a weight of its own (vLLM's packed copy of it goes stale otherwise), and
the prefix cache is reset. `check_sync` then compares the log-probs of one fixed sequence,
engine against trainer, and fails in one line over the tolerance. Log-probs are vLLM's
`processed_logprobs`: those of the distribution each token was drawn from, as the fast
decoder's. Server mode (grpo.vllm.client / server) reuses `sampling_params`, `completions`
and `policy_weights`, the pieces that hold no engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from grpo.errors import UserError
from grpo.refusals import refuse
from grpo.infra.imports import describe
from grpo.rollout.params import SamplingParams
from grpo.rollout.weights import base_model, policy_weights
from grpo.vllm import INSTALL, missing, unsupported

# vllm/v1/attention/backends/cpu_attn.py: get_supported_head_sizes.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
LOGPROBS_MODE = "processed_logprobs"  # of the distribution sampled from (module doc)


def head_dim(config) -> int:
    text = getattr(config, "get_text_config", None)
    config = text() if text is not None else config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def refusal(policy, device: torch.device) -> str | None:
    """Why vLLM cannot run `policy` on `device` (one line); None if it can, as far as can be
    known before building an engine: vLLM installed, a head size the CPU attention takes."""
    if missing() is not None:
        return f"vLLM is not installed ({INSTALL})"
    config = base_model(policy).config
    if device.type == "cpu" and head_dim(config) not in CPU_HEAD_SIZES:
        sizes = ", ".join(map(str, CPU_HEAD_SIZES))
        return f"vLLM's CPU attention takes head_dim {sizes}; this model's is {head_dim(config)}"
    return None


def environment(kv_cache_gb: int) -> None:
    """What vLLM reads from the environment, set before it is imported: the engine in this
    process (the weights are handed over in memory), the CPU KV cache's size, and no OpenMP
    thread binding (the trainer shares the cores), its errors only. A value the user set
    wins, except the first: an engine in another process could not take the weights this way."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gb)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # not its benign warnings; a stale weight is the check's


def sampling_params(
    p: SamplingParams, *, n: int, seed: int | None, logprobs: bool = True, max_tokens: int | None = None
):
    """vLLM's SamplingParams for `n` completions of one prompt, each option of `p` under
    vLLM's name. EOS is given as stop token ids (vLLM runs without a tokenizer); vLLM seeds
    child i of a seeded request with seed + i (v1/engine/parallel_sampling.py)."""
    import vllm

    reason = unsupported(p)
    if reason is not None:
        raise UserError(reason)
    return vllm.SamplingParams(
        n=n,
        seed=seed,
        temperature=p.temperature,
        top_k=p.top_k,  # 0 = off for both
        top_p=p.top_p,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_tokens=p.min_new_tokens,
        max_tokens=p.max_new_tokens if max_tokens is None else max_tokens,
        stop_token_ids=list(p.eos_token_ids),
        ignore_eos=False,
        logprobs=0 if logprobs else None,  # the drawn token's only
        detokenize=False,
        skip_special_tokens=False,
    )


def completions(output) -> list[tuple[list[int], list[float] | None]]:
    """One vLLM RequestOutput -> its completions in order: (token ids, the log-prob of each
    drawn token, or None when none were asked for). An EOS that stopped one is its last token."""
    rows = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        ids = list(c.token_ids)
        logprobs = None if c.logprobs is None else [step[token].logprob for step, token in zip(c.logprobs, ids)]
        rows.append((ids, logprobs))
    return rows


@contextlib.contextmanager
def _kept_random_state():
    """vLLM seeds Python's, NumPy's and torch's global streams when it builds an engine: the
    trainer's are put back as they were, so that building one changes no draw of the run's."""
    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []):
        yield
    random.setstate(py)
    np.random.set_state(npy)


def fixed_sequence(vocab: int, length: int) -> list[int]:
    """The check's sequence: `length` token ids drawn from a fixed seed (no model favours it)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(vocab, (length,), generator=g).tolist()


class StaleWeights(RuntimeError):
    """The engine's log-probs of the check's sequence differ from the trainer's: its weights
    are not the policy's."""


class LocalEngine:
    """One vLLM `LLM` in this process, on `device`, built from `policy`'s config (module doc).

    `max_model_len`: the longest prompt + completion; `max_num_seqs`: sequences decoded at
    once; `dtype`: the engine's (None: the policy's); `gpu_memory_utilization` and `sleep`
    (CUDA only): the share of the GPU it takes, and whether `sleep` frees its KV cache and
    weights while the update runs; `kv_cache_gb`: its KV cache on a CPU."""

    def __init__(
        self,
        policy,
        *,
        device: torch.device,
        max_model_len: int | None,
        max_num_seqs: int = 256,
        dtype: torch.dtype | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        sleep: bool = False,
        kv_cache_gb: int = 1,
    ):
        reason = refusal(policy, device)
        if reason is not None:
            refuse("sampler+model", sampler="vllm", why=reason, others="auto, fast or hf")
        environment(kv_cache_gb)
        import vllm

        model = base_model(policy)
        self.device = device
        self.longest = max_model_len  # None: the model's positions
        self.dtype = dtype or next(model.parameters()).dtype
        self.vocab = model.get_input_embeddings().weight.shape[0]
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.sleep_mode = sleep and device.type == "cuda"
        self.asleep = self.kv_cache_asleep = False  # weights (they must be synced again) and KV cache freed
        self._dir = tempfile.TemporaryDirectory(prefix="grpo-vllm-")  # config.json only: vLLM's dummy load
        config = json.loads(model.config.to_json_string())
        config.pop("quantization_config", None)  # a 4-bit base is sent dequantized (`policy_weights`)
        (Path(self._dir.name) / "config.json").write_text(json.dumps(config))
        options = dict(
            model=self._dir.name,
            load_format="dummy",  # random weights; the first sync loads the policy's
            skip_tokenizer_init=True,  # prompts go in as token ids, completions come out as ids
            generation_config="vllm",  # the model's generation_config.json sets no sampling default
            dtype=self.dtype,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            logprobs_mode=LOGPROBS_MODE,
            enforce_eager=device.type == "cpu",
        )
        if device.type == "cuda":
            options.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_mode)
        # Under torchrun, an engine per process on the process group torchrun set up (as TRL's
        # colocated mode does), not a distributed environment of vLLM's own.
        self.external = torch.distributed.is_available() and torch.distributed.is_initialized()
        if self.external:
            options.update(distributed_executor_backend="external_launcher")
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with _kept_random_state(), on_device:
            try:
                self.llm = vllm.LLM(**options)
            except Exception as err:  # vLLM's own refusals (an architecture it lacks, ...) come as many kinds
                raise UserError(
                    f"rollout.sampler: vllm could not build its engine: {describe(err)} (if its KV cache cannot hold "
                    "max_model_len tokens: set rollout.max_prompt_length, or raise rollout.vllm.kv_cache_gb or "
                    "gpu_memory_utilization)"
                ) from err
        self.holds = None  # (weakref to the policy, its version) whose weights it holds; the decoder's
        self.syncs, self.sync_seconds, self.check_seconds = 0, 0.0, 0.0  # what the syncs have cost so far

    # ---- generating ---------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: list) -> list[list[tuple[list[int], list[float] | None]]]:
        """Prompts as token ids, each with its vLLM SamplingParams (`sampling_params`) ->
        each prompt's completions (`completions`), in order."""
        inputs = [{"prompt_token_ids": list(ids)} for ids in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        return [completions(o) for o in outputs]

    def sample(self, prompts: list[list[int]], params: SamplingParams, counts: list[int], seeds: list[int]):
        """counts[i] completions of prompt i (token ids), drawn as our `params` say with
        seeds[i]: `generate` with `sampling_params` per prompt. The decoder calls this, as a
        server's engine does for a remote trainer (grpo.vllm.server)."""
        return self.generate(prompts, [sampling_params(params, n=n, seed=seed) for n, seed in zip(counts, seeds)])

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """The engine's log-prob of each token of `ids` after the first, given those before
        (its raw distribution: temperature 1, no penalty)."""
        import vllm

        params = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        (out,) = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return [step[token].logprob for step, token in zip(out.prompt_logprobs[1:], ids[1:])]

    # ---- weights ------------------------------------------------------------------------------

    def _worker(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker  # in-process only (environment)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Put `weights` (Hugging Face names -> tensors; `policy_weights`) into the engine, in
        place, and drop what the old weights computed (the prefix cache)."""
        self.wake()
        worker = self._worker()
        worker.reload_weights(weights_iterator=((n, t.to(self.dtype)) for n, t in weights))
        vllm_model = worker.model_runner.model
        head = getattr(vllm_model, "lm_head", None)
        embed = getattr(getattr(vllm_model, "model", None), "embed_tokens", None)
        if (
            self.tied
            and head is not None
            and hasattr(head, "cpu_linear")
            and getattr(head, "weight", None) is getattr(embed, "weight", 0)
        ):  # the CPU's packed copy of a tied head: rebuilt from the new embedding
            head.quant_method.process_weights_after_loading(head)
        self.llm.reset_prefix_cache()
        if self.kv_cache_asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.kv_cache_asleep = False

    def check(self, policy, tolerance: float, length: int = 32) -> float:
        """The mean |log-prob difference| over one fixed sequence, engine against `policy`
        (run in the trainer, in float32); raises StaleWeights over `tolerance`. The sequence
        is cut to the engine's max_model_len: a run of short prompts and completions builds
        an engine that scores no longer one."""
        ids = fixed_sequence(self.vocab, min(length, self.longest or length))
        engine = torch.tensor(self.prompt_logprobs(ids))
        device = next(policy.parameters()).device
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()
        trainer = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:], device=device)[:, None]).squeeze(1).cpu()
        gap = float((engine - trainer).abs().mean())
        if not gap <= tolerance:
            raise StaleWeights(
                f"the vLLM engine's weights are not the policy's: its log-probs of a fixed sequence differ from "
                f"the trainer's by {gap:.3g} per token on average (rollout.vllm.check_tolerance: {tolerance:g})"
            )
        return gap

    def sync(self, policy, *, check: bool, tolerance: float) -> None:
        """The policy's weights into the engine (`policy_weights`), then the check."""
        start = time.perf_counter()
        self.load_weights(policy_weights(policy))
        middle = time.perf_counter()
        if check:
            self.check(policy, tolerance)
        self.syncs += 1
        self.sync_seconds += middle - start
        self.check_seconds += time.perf_counter() - middle

    def close(self) -> None:
        """Shut the engine down and free what it holds (the next engine in this process can
        then set up vLLM's state again). Under torchrun the process group stays: it is the
        trainer's (`_keeping_default_group`)."""
        with _keeping_default_group() if self.external else contextlib.nullcontext():
            self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        if not self.external:  # torchrun's process group is the trainer's: left alone
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
        self._dir.cleanup()

    # ---- sleeping (CUDA) ----------------------------------------------------------------------

    def sleep(self) -> None:
        """Free the engine's KV cache and weights while the update runs (level 2: the next
        sync loads every weight anyway). A no-op without sleep mode (and on a CPU)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = self.kv_cache_asleep = True

    def wake(self) -> None:
        """Before a sync: room for the weights again (the KV cache comes back after them)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.asleep = False


@contextlib.contextmanager
def _keeping_default_group():
    """vLLM's engine shutdown ends with `torch.distributed.destroy_process_group()` on the
    default group (vllm/distributed/parallel_state.py: `cleanup_dist_env_and_memory` ->
    `destroy_distributed_environment`), which under torchrun is the trainer's: a shutdown
    inside this block destroys only vLLM's own groups, the process group stays."""
    from vllm.distributed import parallel_state

    def vllm_groups_only():
        if parallel_state._WORLD is not None:
            parallel_state._WORLD.destroy()  # vLLM's copy of the world (its own torch groups)
        parallel_state._WORLD = parallel_state._NODE_COUNT = None

    original = parallel_state.destroy_distributed_environment
    parallel_state.destroy_distributed_environment = vllm_groups_only
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = original
