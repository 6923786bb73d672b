"""The training-rows format is spelled once (issue 74): ``rowkeys.TrainFields`` is what the writer adds, what
``view`` reads and the runtime-owned key set, so a key added there reaches all three."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from gym_runtime.data import rowkeys
from gym_runtime.data.rowkeys import TRAIN_KEYS, TrainFields
from gym_runtime.trainers.train_rows import TrainRowsWriter
from gym_runtime.view import training


def test_what_the_writer_adds_is_the_struct_the_view_reads_and_the_keys_the_runtime_owns(tmp_path: Path) -> None:
    rows = tmp_path / "train.jsonl"
    writer = TrainRowsWriter(rows)
    writer.write({"reward": 1.0, "task": "t"}, step=3, group=writer.group(), reward=1.0, advantage=float("nan"))
    writer.close()
    line = rows.read_bytes().splitlines()[0]
    written = json.loads(line)
    assert (
        set(written) - {"reward", "task"} == TRAIN_KEYS == {f.encode_name for f in msgspec.structs.fields(TrainFields)}
    )
    assert TRAIN_KEYS <= rowkeys.RUNTIME_KEYS
    assert issubclass(training._Train, TrainFields)
    read = msgspec.json.decode(line, type=training._Train)
    assert (read.train_step, read.train_group, read.train_reward, read.train_advantage) == (3, 0, 1.0, None)
