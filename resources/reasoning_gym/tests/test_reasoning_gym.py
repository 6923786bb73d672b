"""reasoning_gym against NeMo Gym's recorded rollouts and differential cases; extraction; the generator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.messages import (
    output_text,
)
from gym_runtime.resources.reasoning_gym import (
    ReasoningGym,
    extract_answer,
    score_answer,
)
from gym_runtime.resources.reasoning_gym.generate import generate, main
from tests.differential import (
    COMPAT,
    differential_cases,
    example_rollouts,
    recorded_response,
    reverify_differential,
    text_response,
    verify_once,
)

ENV_DIR = Path(__file__).resolve().parents[1]
NEMO = COMPAT / "nemo_gym" / "reasoning_gym"
FIELDS = ("task_name", "score", "extracted_answer")
TASK_KEYS = ("responses_create_params", "question", "answer", "metadata")

ARITHMETIC = {
    "question": "Calculate -5 * -6.",
    "answer": "30",
    "metadata": {"source_dataset": "basic_arithmetic", "source_index": 0, "expression": "-5 * -6"},
}


# ------------------------------------------------------------------ parity


async def test_recorded_rollouts_and_differential_cases_reproduce_nemo_gym() -> None:
    # One test, so reasoning-gym is imported once into the scoring worker process.
    pairs = example_rollouts(ENV_DIR, NEMO)
    assert len(pairs) == 5
    for i, (task, rollout) in enumerate(pairs):
        v = await verify_once(ReasoningGym, task, recorded_response(rollout["response"]))
        assert v.reward == rollout["reward"], f"rollout {i}"
        # recorded by an older NeMo Gym that kept untagged text unstripped; its current verify strips it
        recorded = {**{k: rollout[k] for k in FIELDS}, "extracted_answer": rollout["extracted_answer"].strip()}
        assert v.fields == recorded, f"rollout {i}"
    await reverify_differential(ReasoningGym, "reasoning_gym", at_least=20, tolerance=1e-9)


def test_scores_come_from_reasoning_gym() -> None:
    assert score_answer("basic_arithmetic", "30", ARITHMETIC) == 1.0
    assert score_answer("basic_arithmetic", "31", ARITHMETIC) == 0.0
    assert score_answer("no_such_task", "30", ARITHMETIC) == 0.0
    assert score_answer("basic_arithmetic", None, ARITHMETIC) == 0.0  # type: ignore[arg-type]


# ------------------------------------------------------------------ extraction


@pytest.mark.parametrize(
    ("text", "extracted"),
    [
        ("reasoning <answer> 30 </answer>", "30"),
        ("<answer>29</answer> no, <answer>\n30\n</answer>", "30"),  # the last tag wins
        ("<answer>30</answer> \\boxed{31}", "30"),
        ("so \\boxed{30} and later \\boxed{31}", "30"),  # the first box, up to its first closing brace
        ("\\boxed{ \\frac{1}{2} } done", "\\frac{1"),  # as NeMo Gym's regex reads it
        ("\\boxed{} then \\boxed{7}", "7"),  # an empty box is no box
        ("<think>\\boxed{1}</think>The answer is 2.", "1"),  # think text is read like any other text
        ("<think><answer>1</answer></think><answer>2</answer>", "2"),
        ("```\n<answer>30</answer>\n```", "30"),
        ("```json\n[1, 2]\n```", "```json\n[1, 2]\n```"),  # a fence is not removed
        ("\n\nRiley is a pioneer.\n", "Riley is a pioneer."),  # untagged text, stripped
        ("   \n", ""),
        ("", ""),
    ],
)
def test_extract_answer(text: str, extracted: str) -> None:
    assert extract_answer(text) == extracted


def test_only_message_output_text_is_read() -> None:
    response = text_response("<answer>3", "0</answer>", reasoning="<answer>wrong</answer>", refusal="x")
    assert output_text(response.output) == "<answer>30</answer>"
    assert extract_answer(output_text(response.output)) == "30"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({**ARITHMETIC, "metadata": {"source_index": 0}}, "source_dataset"),
        ({**ARITHMETIC, "metadata": None}, "metadata"),
        ({k: v for k, v in ARITHMETIC.items() if k != "answer"}, "answer"),
        ({**ARITHMETIC, "question": None}, "question"),
    ],
)
async def test_invalid_rows_are_refused(row: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await verify_once(ReasoningGym, row, text_response("<answer>30</answer>"))


async def test_verify_scores_in_a_worker_process_and_a_timeout_scores_zero() -> None:
    v = await verify_once(ReasoningGym, ARITHMETIC, text_response("<answer>30</answer>"))
    assert (v.reward, v.fields) == (1.0, {"task_name": "basic_arithmetic", "score": 1.0, "extracted_answer": "30"})
    v = await verify_once(ReasoningGym, ARITHMETIC, text_response("<answer>30</answer>"), {"timeout_s": 0.0})
    assert (v.reward, v.fields["score"]) == (0.0, 0.0)


# ------------------------------------------------------------------ generator


def test_generator_reproduces_the_example_file_byte_for_byte(tmp_path: Path) -> None:
    out = tmp_path / "rows" / "kk.jsonl"
    assert main(["--task", "knights_knaves", "--size", "5", "--seed", "42", "-o", str(out)]) == 0
    assert out.read_bytes() == (ENV_DIR / "data" / "example.jsonl").read_bytes()
    assert not list(out.parent.glob("*.partial"))


def test_generator_reproduces_the_differential_task_rows() -> None:
    for case in [c for _, c in differential_cases("reasoning_gym")]:
        task, index = case["metadata"]["source_dataset"], case["metadata"]["source_index"]
        if task == "no_such_task":
            continue
        row = list(generate(task, index + 1, 42))[index]
        assert json.loads(json.dumps(row)) == {k: case[k] for k in TASK_KEYS}, case["case"]


def test_generator_stdout_config_and_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = '{"min_terms": 3, "max_terms": 3}'
    assert main(["--task", "chain_sum", "--size", "2", "--seed", "7", "--config", config]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert list(row) == list(TASK_KEYS)
        assert row["responses_create_params"] == {"input": [{"role": "user", "content": row["question"]}]}
        assert row["metadata"]["source_dataset"] == "chain_sum" and row["metadata"]["num_terms"] == 3
    out = tmp_path / "x.jsonl"
    assert main(["--task", "no_such_task", "--size", "2", "-o", str(out)]) == 2
    assert main(["--task", "chain_sum", "--size", "2", "--config", '{"bogus": 1}', "-o", str(out)]) == 2
    assert not out.exists()
    assert "unknown reasoning-gym task" in capsys.readouterr().err
    assert main(["--list"]) == 0
    names = capsys.readouterr().out.split()
    assert {"knights_knaves", "basic_arithmetic", "countdown"} <= set(names)
    with pytest.raises(SystemExit):
        main(["--size", "2"])


def test_offers_no_tools_the_answer_is_the_message() -> None:
    assert ReasoningGym.tool_definitions() == []
