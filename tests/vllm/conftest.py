"""tests/vllm run where vLLM is installed (the vLLM venv); elsewhere they are not collected.

vLLM reads its environment when it builds an engine: in this process (the weights are handed
over in memory), a small CPU KV cache, no OpenMP thread binding, one thread (the CI machine
and the development machines share a few cores)."""

import importlib.util
import os

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
