"""The GPU check of the trainer path, prepared for one H100/H200 machine (not run in CI: no GPU there).

TRL's synchronous ``GRPOTrainer`` with ``gym_runtime.trainers.trl`` and the ``transformers`` adapter generating in
process, in bf16 on CUDA: a random-init Qwen2 of ~0.5B parameters (Qwen2.5-0.5B's shape: hidden 896, 24 layers,
intermediate 4864, its 151,936-row embedding; the word-level tokenizer of ``runtime/rigs/tiny_policy.py`` uses its
first rows), the say-word tool environment (``tests/envs/say_word.py``), real workers on an embedded nats-server.
It first prints what the machine has, then each step's time, and at the end steps/s, rollouts/s and peak GPU memory.
Sized for well under 8 minutes: ``--steps 10`` of 16 rollouts (2 prompts x 8 generations), 16 new tokens a turn.

The machine (``shared/notes/gpu-machine.md``): Python 3.12, torch, transformers, accelerate, pyarrow, pandas, no
network. Carry cp312 wheels (within 64 MiB) of this project (``pip wheel --no-deps .``) and its dependencies, plus
trl 1.16.0, datasets, dill, multiprocess, xxhash (``pip download --only-binary=:all: --python-version 3.12
--platform manylinux_2_28_x86_64 ...``; nkeys: ``pip wheel --no-deps``), then there:

    pip install --no-index --no-deps --target /tmp/wheels wheels/*.whl
    PYTHONPATH=/tmp/wheels:. python tests/gpu/trl_sync_cuda.py --steps 10
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def machine() -> None:
    import torch
    import transformers
    import trl

    print(
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"trl {trl.__version__}"
    )
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this check needs one GPU")
    props = torch.cuda.get_device_properties(0)
    print(f"gpu {props.name}, {props.total_memory / 2**30:.1f} GiB, {torch.cuda.device_count()} device(s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--cpu-dry-run", action="store_true", help="the same loop on CPU with a tiny model (no GPU)")
    args = p.parse_args()
    if not args.cpu_dry_run:
        machine()
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback

    from gym_runtime import SyncClient
    from gym_runtime.trainers.trl import TRLRollouts
    from tests.trainers.world import grpo, world

    tmp = Path(tempfile.mkdtemp(prefix="gpu-trl-"))
    w = world(tmp, rows=16, max_new_tokens=args.max_new_tokens, tool_bias=2.0)
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    if not args.cpu_dry_run:
        w.model = Qwen2ForCausalLM(config).to("cuda", dtype=torch.bfloat16)
    print(f"model: {sum(p.numel() for p in w.model.parameters()) / 1e6:.1f} M parameters, {w.model.dtype}")
    steps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_a, **_k):  # type: ignore[no-untyped-def]
            self.t = time.perf_counter()

        def on_step_end(self, _a, state, *_r, **_k):  # type: ignore[no-untyped-def]
            steps.append(time.perf_counter() - self.t)
            mem = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
            print(f"step {state.global_step}: {steps[-1]:.2f} s, peak {mem:.2f} GiB", flush=True)

    with SyncClient(w.config) as client:
        rollouts = TRLRollouts(client, w.rows)
        trainer = grpo(
            w,
            rollouts,
            rollouts.dataset(),
            tmp,
            steps=args.steps,
            batch=args.batch,
            generations=args.generations,
            use_cpu=args.cpu_dry_run,
            bf16=not args.cpu_dry_run,
            learning_rate=1e-5,
            disable_tqdm=True,
        )
        trainer.add_callback(Clock())
        started = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - started
    later = steps[1:] or steps
    print(
        f"{len(steps)} steps in {wall:.1f} s: {len(later) / sum(later):.2f} steps/s after the first, "
        f"{rollouts.totals.rollouts / wall:.1f} rollouts/s, peak GPU memory "
        f"{torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0:.2f} GiB; "
        f"{rollouts.totals}"
    )


if __name__ == "__main__":
    main()
