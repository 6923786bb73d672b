"""TRL's asynchronous GRPO on a machine without CUDA: ``use_cpu_attention()`` before building the trainer (a
``GymRolloutWorker`` calls it as it is built where CUDA is not available: ``where_needed``).

``AsyncGRPOTrainer`` computes its tree attention with FlashAttention-3 (a CUDA kernel fetched from the hub); here it
is replaced by a plain-torch varlen attention with the same arguments and result (causal, aligned to the bottom
right as flash-attn aligns a query segment shorter than its keys), so the trainer's real steps run on CPU. Slow
(a Python loop over the packed sequences): for small models, tests and a first try of a recipe.
"""

from __future__ import annotations

__all__ = ["flash_attn_varlen_func", "use_cpu_attention", "where_needed"]

import math
from types import SimpleNamespace
from typing import Any


def flash_attn_varlen_func(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    **_: Any,
) -> Any:
    import torch

    heads, kv_heads = q.shape[1], k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        a, b = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        c, d = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi = q[a:b].transpose(0, 1).float()  # heads, len_q, dim
        ki = k[c:d].transpose(0, 1).float().repeat_interleave(heads // kv_heads, 0)
        vi = v[c:d].transpose(0, 1).float().repeat_interleave(heads // kv_heads, 0)
        scores = qi @ ki.transpose(1, 2) * scale
        if causal:
            lq, lk = b - a, d - c
            rows = torch.arange(lq).unsqueeze(1) + (lk - lq)
            scores = scores.masked_fill(torch.arange(lk).unsqueeze(0) > rows, float("-inf"))
        out[a:b] = (torch.softmax(scores, -1) @ vi).transpose(0, 1).to(q.dtype)
    return out


def use_cpu_attention() -> None:
    """Point TRL's tree attention at ``flash_attn_varlen_func`` (TRL 1.16's kernel loader is a cached function), and
    its MFU metric, which asks CUDA for the device's name when the trainer is built, at a constant. Call it once,
    before ``AsyncGRPOTrainer(...)``, where ``torch.cuda.is_available()`` is false."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    packing._flash_attn = lambda: SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)
    # TRL's MFU metric asks CUDA for the device's name at construction; on CPU there is none
    async_grpo_trainer.get_peak_flops_per_device = lambda *args, **kwargs: 1e12


def where_needed() -> bool:
    """``use_cpu_attention()`` when torch has no CUDA and TRL's asynchronous GRPO is installed (without it, building
    ``AsyncGRPOTrainer`` on such a machine raises "Torch not compiled with CUDA enabled"); whether it did."""
    try:
        import torch
        from trl.experimental.async_grpo import async_grpo_trainer  # noqa: F401
    except ImportError:
        return False
    if torch.cuda.is_available():
        return False
    use_cpu_attention()
    return True
