"""vLLM's CPU backend for ``vllm_engine``: a KV-cache size chosen by itself, or one clear error.

Unset, vLLM's CPU worker reserves 92% of the NUMA node's memory for the KV cache
and refuses to start when less is free — the usual case on a shared machine —
with the reason only in its worker process's log.
"""

from __future__ import annotations

import os
from typing import Any

from gym_runtime.errors import ModelError
from gym_runtime.observability import logs

log = logs.get("gym.models.vllm_engine")

KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB of KV cache vLLM's CPU backend reserves


def _available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def cpu_kv_cache(engine_args: dict[str, Any]) -> bool:
    """On vLLM's CPU backend, choose a KV-cache size when the user did not; True when on CPU.

    Unset, vLLM reserves 92% of the NUMA node's memory and refuses to start when
    less is free (the usual case on a shared machine). We set
    ``VLLM_CPU_KVCACHE_SPACE`` (read by the engine process this worker spawns) to a
    quarter of the available memory, 1 to 4 GiB — unless the environment or
    ``engine_args`` (``gpu_memory_utilization``, ``kv_cache_memory_bytes``) already say.
    """
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
    except Exception:  # noqa: BLE001 - an unusual vLLM build: leave its defaults alone
        return False
    if os.environ.get(KV_CACHE_ENV) or {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(engine_args):
        return True
    free = _available_gib()
    gib = 1 if free is None else int(min(4.0, max(1.0, free / 4)))
    os.environ[KV_CACHE_ENV] = str(gib)
    log.info("model.cpu_kv_cache", gib=gib, available_gib=round(free or 0, 1), env=KV_CACHE_ENV)
    return True


def cpu_start_error(e: BaseException) -> ModelError:
    """The engine did not start on CPU: one line that says which option to set."""
    first = (str(e).splitlines() or [type(e).__name__])[0][:200]
    return ModelError(
        f"vllm_engine: vLLM could not start on CPU ({first}); when it lacks memory, set "
        f"{KV_CACHE_ENV}=<GiB> in the environment or engine_args.gpu_memory_utilization"
    )
