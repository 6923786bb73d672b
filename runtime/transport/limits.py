"""JetStream's size limits and defaults, and sizes as written (``8MB``): plain values, so that the config
can default and check its ``jetstream`` section without importing the transport (nats-py, tracing): a
CLI command that only parses its arguments or its config stays light (``tests/bench/cli_startup.py``).
"""

from __future__ import annotations

from gym_runtime.errors import UserError


def parse_size(text: str | int) -> int:
    """``8MB`` / ``512KB`` / ``1048576`` → bytes."""
    if isinstance(text, int):
        return text
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}.get(t[-1:], 1)
    if mult != 1:
        t = t[:-1]
    try:
        return int(float(t) * mult)
    except ValueError:
        raise UserError(f"not a size: {text!r} (use e.g. 8MB)") from None


def size_text(n: int) -> str:
    """Bytes as ``parse_size`` reads them back, rounded: ``3GB``, ``40MB``, ``200KB``."""
    for unit, mult in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.4g}{unit}"
    return f"{n}B"


# Default size limit per stream (``jetstream.{tasks,results,model,blobs}_max_bytes``), from a weather
# rollout measured in the streams (headers included): 626 B per task, 2,150 B per result (1,818 B before
# rows carried provenance per part, their sandbox commands and costs from the workers), 652 B per queued
# model call. A 1,000,000-rollout batch published at once fits with tasks up to 2.1 KB and results up to
# 5.3 KB each; 100,000 rollouts in flight all waiting on the model
# queue fit with requests up to 10 KB. Together (13 GiB) they fit the ~15 GB JetStream grants itself on a
# disk with 20 GB free. JetStream reserves every stream's max_bytes when it is created: a default the
# server cannot reserve is halved until it can, then halved once more to leave room for the streams after
# it (down to MIN_DEFAULT_BYTES), so a small disk still starts.
# The kept tasks (one body per task, not per repeat: 626 B each for weather, less than a task's share of the
# task stream) hold a 1,000,000-task batch's bodies up to 1 KB each.
# Results and blobs are bounded per writer (a stream per agent, a blob stream per role) since one pool may
# not evict or starve another's data: 5 GiB an agent holds a 1,000,000-rollout batch with results up to
# 5.3 KB each (weather: 2.15 KB); 512 MiB a role holds two of the largest bodies (256 MiB each) at once. A
# server that cannot reserve a default for one more agent's stream halves it (below).
STREAM_LIMITS: dict[str, int] = {
    "tasks": 2 << 30,
    "results": 5 << 30,
    "model": 1 << 30,
    "blobs": 512 << 20,
    "kept": 1 << 30,
    "attempts": 256 << 20,  # ~100 B a record: 2,500,000 attempts; the oldest go first (explain's history)
}
KV_MAX_BYTES = 256 << 20  # the manifest and control buckets (a manifest is a few hundred bytes); on a
KV_MIN_BYTES = 1 << 20  # small disk, quartered down to this
MIN_DEFAULT_BYTES = 64 << 20
# a default below MIN_DEFAULT_BYTES when the streams before it left less (``jetstream._smaller_default``)
MIN_STARVED_BYTES = 1 << 20
# The task and result streams' default duplicate window (``jetstream.duplicate_window_s``): it covers a
# publish retried after a lost ack (``Bus.js_publish`` gives up after 20 s); readers drop later duplicates.
DUPLICATE_WINDOW_S = 120.0
