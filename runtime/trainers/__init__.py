"""Adapters that let a trainer learn from gym-runtime's rows (public API: ``gym_runtime.trainers.trl``)."""
