"""Rigs for trying the trainer adapters on a laptop, offline, with no GPU: the policy the trainer tests train and
docs/trainer.md's recipes build (``tiny_policy``), and TRL's asynchronous GRPO on CPU (``trl_cpu``). Not the
adapters themselves (``gym_runtime.trainers``): nothing there imports them, but for ``GymRolloutWorker``, which
applies the CPU attention where torch has no CUDA (``trl_cpu.where_needed``)."""
