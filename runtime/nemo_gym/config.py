"""NeMo Gym's config files read as ours: the reader is ``gym_runtime.config.nemo_gym``, with the config it writes
(``load_config`` calls it, and the config layer imports nothing of this package: no circle between the two).
This name keeps the documented import path."""

from gym_runtime.config.nemo_gym import (
    NemoConfigError,
    convert,
    convert_file,
    data_only_overrides,
    datasets,
    is_nemo_gym,
    merged_dict,
)

__all__ = [
    "NemoConfigError",
    "convert",
    "convert_file",
    "data_only_overrides",
    "datasets",
    "is_nemo_gym",
    "merged_dict",
]
