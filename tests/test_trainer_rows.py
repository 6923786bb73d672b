"""How the TRL adapter finds a prompt's row and cuts TRL's prompts into groups (no TRL needed)."""

from __future__ import annotations

import pytest

from gym_runtime.errors import ClientError
from gym_runtime.trainers.rows import RowIndex, runs


def row(text: str, **task: object) -> dict[str, object]:
    return {"responses_create_params": {"input": [{"role": "user", "content": text}]}, **task}


def test_two_rows_with_the_same_prompt_are_not_confused() -> None:
    rows = [row("2+2?", answer=4), row("2+2?", answer=5), row("3+3?", answer=6)]
    index = RowIndex(rows)
    data = index.dataset()
    assert [index.find(d["prompt"]) for d in data] == [0, 1, 2]
    assert data[1]["prompt"] == [{"role": "user", "content": "2+2?", "gym_row": 1}]
    assert index.find([{"role": "user", "content": "3+3?"}]) == 2  # no key: by its text, once
    with pytest.raises(ClientError, match="2 rows have the prompt"):
        index.find([{"role": "user", "content": "2+2?"}])
    with pytest.raises(ClientError, match="no row has the prompt"):
        index.find("4+4?")
    with pytest.raises(ClientError, match="names row 7"):
        index.find([{"role": "user", "content": "x", "gym_row": 7}])


def test_trls_repeated_prompts_become_groups_in_order() -> None:
    assert runs([3, 3, 5, 5, 3, 3]) == [(3, 2), (5, 2), (3, 2)]
    assert runs([1, 1, 1, 1]) == [(1, 4)]  # one row twice in a row: one group of the run's length
