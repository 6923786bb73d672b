"""math (NeMo Gym math_with_judge) against NeMo Gym's recorded rollouts and differential cases.

The judge is an LLM, so it is replaced here by ``ScriptedJudge``, a named TEST DOUBLE that
replays judge replies (NeMo Gym's recorded ones, or texts written in the test).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from gym_runtime.config import load_config
from gym_runtime.messages import (
    CreateParams,
    Message,
    Reasoning,
    Response,
    assistant_message,
    output_text,
)
from gym_runtime.resource import Verdict
from gym_runtime.resources.math import (
    JUDGE_SYSTEM_MESSAGE,
    MathWithJudge,
    judge_says_equal,
    library_verify,
    parse_options,
    strip_math_delimiters,
)
from tests.differential import (
    COMPAT,
    ScriptedJudge,
    differential_cases,
    example_rollouts,
    new_session,
    recorded_response,
    text_response,
)

ENV_DIR = Path(__file__).resolve().parents[1]
NEMO = COMPAT / "nemo_gym" / "math_with_judge"
FAST = {"library_verifier_max_concurrency": 2}
# One event loop for the module, so anyio's worker-process pool (one per loop) is started once.
module_loop = pytest.mark.asyncio(loop_scope="module")


def judge_reply(text: str, *, part_type: str = "output_text") -> Response:
    part = {"annotations": [], "text": text, "type": part_type}
    return Response(id="judge", created_at=0.0, output=[Message(role="assistant", content=[part], status="completed")])


async def session(options: dict[str, Any] | None = None, judge: ScriptedJudge | None = None) -> MathWithJudge:
    return await new_session(MathWithJudge, {**FAST, **(options or {})}, models=judge or ScriptedJudge([]))


# Parity runs get wide timeouts: on a loaded 2-core machine one recorded rollout needs 5-9 s of
# SymPy, and a timeout would turn NeMo Gym's 1.0 into 0 (the defaults are NeMo Gym's 10 s budget).
PARITY = {
    "library_verifier_max_concurrency": 1,
    "library_verifier_timeout_seconds": 120.0,
    "math_verify_timeout_seconds": 60,
}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def parity() -> dict[str, Any]:
    """Every differential case and recorded rollout, verified concurrently (the slow ones overlap)."""
    cases = differential_cases("math_with_judge")
    pairs = example_rollouts(ENV_DIR, NEMO)

    class JudgedMath(MathWithJudge):
        """The same resource under a second config: the judge on, as NeMo Gym recorded these rollouts."""

    await MathWithJudge.setup(PARITY)  # the differential cases' config: judge off
    await JudgedMath.setup({**PARITY, "should_use_judge": True})
    runs, judges = [], []
    # One worker per class; the long (slow) expected answers start first, so the two slow ones overlap.
    cases.sort(key=lambda tc: -len(tc[1]["expected_answer"]))
    pairs.sort(key=lambda tr: -len(tr[1]["expected_answer"]))
    for task, _ in cases:
        inst = MathWithJudge()
        inst.models = ScriptedJudge([])  # asking it would fail the case
        runs.append(inst.verify(task, recorded_response(task["response"])))
    for task, rollout in pairs:
        inst = JudgedMath()
        inst.models = judge = ScriptedJudge(
            [recorded_response(e["response"]) for e in rollout["judge_evaluations"] or []]
        )
        judges.append(judge)
        runs.append(inst.verify(task, recorded_response(rollout["response"])))
    outs = await asyncio.gather(*runs, return_exceptions=True)
    return {
        "cases": [(case, out) for (_, case), out in zip(cases, outs[: len(cases)])],
        "rollouts": [
            (task, rollout, judge, out) for (task, rollout), judge, out in zip(pairs, judges, outs[len(cases) :])
        ],
    }


@module_loop
async def test_differential_cases_reproduce_reward_and_fields_exactly(parity: dict[str, Any]) -> None:
    assert len(parity["cases"]) >= 33
    for case, out in parity["cases"]:
        assert isinstance(out, Verdict), (case["case"], out)
        assert out.reward == case["expected_reward"], case["case"]
        # extracted_answer is SymPy's str(): reproduced exactly, as are library_reward and judge_evaluations.
        assert json.dumps(out.fields, sort_keys=True) == json.dumps(case["expected_fields"], sort_keys=True), case[
            "case"
        ]


@module_loop
async def test_recorded_rollouts_reverify_with_their_recorded_judge_replies(parity: dict[str, Any]) -> None:
    assert len(parity["rollouts"]) == 5
    judged = 0
    for task, rollout, judge, out in parity["rollouts"]:
        recorded_evals = rollout["judge_evaluations"] or []
        assert isinstance(out, Verdict), out
        assert out.reward == rollout["reward"]
        assert out.fields["extracted_answer"] == rollout["extracted_answer"]
        assert out.fields["library_reward"] == rollout["library_reward"]
        assert rollout["expected_answer"] == task["expected_answer"]  # NeMo Gym echoes the task field
        if rollout["judge_evaluations"] is None:
            assert out.fields["judge_evaluations"] is None and not judge.calls
            continue
        ours = out.fields["judge_evaluations"]
        assert len(ours) == len(recorded_evals) == len(judge.calls)
        for mine, theirs in zip(ours, recorded_evals):
            # What we asked the judge is, field for field, what NeMo Gym asked it.
            assert mine["responses_create_params"] == theirs["responses_create_params"]
            for key, value in mine["response"].items():
                if key in theirs["response"] and key != "output":
                    assert value == theirs["response"][key], key
            assert [i["type"] for i in mine["response"]["output"]] == [i["type"] for i in theirs["response"]["output"]]
        judged += 1
    assert judged == 2


@pytest.mark.parametrize(
    ("text", "equal"),
    [
        ("My final verdict is [[A=B]]", True),
        ("My final verdict is different [[A!=B]]", False),
        ("[[A=B]] ... on second thought [[A!=B]]", True),  # the first label wins
        ("[[A!=B]] ... no wait [[A=B]]", False),
        ("They look the same to me.", False),  # no label: not equal
        ("", False),
    ],
)
def test_judge_verdict_parsing(text: str, equal: bool) -> None:
    assert judge_says_equal(judge_reply(text)) is equal


def test_judge_verdict_needs_a_final_output_text_message() -> None:
    assert judge_says_equal(judge_reply("[[A=B]]", part_type="refusal")) is False
    reasoning_last = Response(id="j", created_at=0.0, output=[*judge_reply("[[A=B]]").output, Reasoning(id="rs")])
    assert judge_says_equal(reasoning_last) is False
    assert judge_says_equal(Response(id="j", created_at=0.0, output=[])) is False
    two_parts = judge_reply("[[A=B]]")
    two_parts.output[0].content.append({"type": "output_text", "text": "no label here"})  # type: ignore[union-attr]
    assert judge_says_equal(two_parts) is False  # only the last part is read


TASK = {"question": "What is 14 divided by 10?", "expected_answer": "1.4"}


@module_loop
async def test_judge_decides_only_when_the_library_says_no_and_asks_both_orders() -> None:
    judge = ScriptedJudge([judge_reply("Sure [[A=B]]"), judge_reply("[[A=B]]")])
    inst = await session(
        {"should_use_judge": True, "judge_responses_create_params": {"input": [], "temperature": 0.0}}, judge
    )
    out = await inst.verify(TASK, text_response("Final answer: seven fifths"))
    assert (out.reward, out.fields["library_reward"]) == (1.0, 0.0)
    assert len(out.fields["judge_evaluations"]) == 2
    first, second = (c.input for c in judge.calls)
    assert [m.role for m in first] == ["system", "user"] and first[0].content == JUDGE_SYSTEM_MESSAGE
    assert "<|Start of Assistant A's Answer|>\n1.4\n" in first[1].content
    assert "<|Start of Assistant B's Answer|>\nFinal answer: seven fifths\n" in first[1].content
    assert "<|Start of Assistant A's Answer|>\nFinal answer: seven fifths\n" in second[1].content
    assert judge.calls[0].temperature == 0.0
    dumped = out.fields["judge_evaluations"][0]["responses_create_params"]
    assert dumped["temperature"] == 0.0 and dumped["stream"] is None and dumped["input"][0]["type"] == "message"


@pytest.mark.parametrize(
    ("replies", "reward", "evaluations"),
    [
        (["[[A!=B]]"], 0.0, 1),  # first order says different: stop
        (["[[A=B]]", "[[A!=B]]"], 0.0, 2),  # positional disagreement
        (["no verdict"], 0.0, 1),
        (["[[A=B]]", "[[A=B]]"], 1.0, 2),
    ],
)
@module_loop
async def test_judge_flow(replies: list[str], reward: float, evaluations: int) -> None:
    judge = ScriptedJudge([judge_reply(t) for t in replies])
    # wide timeouts: this test is about the judge flow, not about a loaded machine's SymPy speed
    out = await (await session({**PARITY, "should_use_judge": True}, judge)).verify(TASK, text_response("\\boxed{3}"))
    assert out.reward == reward
    assert out.fields["library_reward"] == 0.0 and out.fields["extracted_answer"] == "3"
    assert len(out.fields["judge_evaluations"]) == evaluations
    assert not judge.replies


@module_loop
async def test_no_judge_when_library_agrees_or_judge_is_off() -> None:
    judge = ScriptedJudge([])  # any call would fail the test
    out = await (await session({"should_use_judge": True}, judge)).verify(TASK, text_response("\\boxed{\\frac{7}{5}}"))
    assert (out.reward, out.fields["library_reward"], out.fields["judge_evaluations"]) == (1.0, 1.0, None)
    out = await (await session({"should_use_judge": False}, judge)).verify(TASK, text_response("\\boxed{3}"))
    assert (out.reward, out.fields["judge_evaluations"]) == (0.0, None)


@module_loop
async def test_a_failing_judge_call_raises_instead_of_scoring() -> None:
    class BrokenJudge:
        """TEST DOUBLE: a judge model that is unreachable."""

        async def generate(self, params: CreateParams, *, model: str) -> Response:
            raise ConnectionError("judge down")

    inst = await session({"should_use_judge": True})
    inst.models = BrokenJudge()
    with pytest.raises(ConnectionError):
        await inst.verify(TASK, text_response("\\boxed{3}"))


def _pathological() -> str:
    terms = "+".join("1" if e == 0 else f"x^{e}" for e in range(800))
    return "\\boxed{\\frac{x^{800}-1}{x-1}-(" + terms + ")}"


@module_loop
async def test_math_verify_timeout_scores_zero_and_the_worker_survives() -> None:
    # the pool's worker started and used first (an interpreter, SymPy, its first parse: 4.7 s in all at load
    # 15), so the clock below times the check and its end; run to its end the check takes 11.9 s at load 4
    warm = await session({"library_verifier_timeout_seconds": 60.0, "library_verifier_max_concurrency": 1})
    assert (await warm.verify({"question": "q", "expected_answer": "32"}, text_response("\\boxed{32}"))).reward == 1
    inst = await session({"library_verifier_timeout_seconds": 0.5, "library_verifier_max_concurrency": 1})
    start = time.monotonic()
    out = await inst.verify({"question": "q", "expected_answer": "0"}, text_response(_pathological()))
    assert time.monotonic() - start < 6.0
    assert (out.reward, out.fields) == (
        0.0,
        {"extracted_answer": None, "library_reward": 0.0, "judge_evaluations": None},
    )
    # The killed worker process was replaced; the resource keeps verifying.
    out = await inst.verify({"question": "q", "expected_answer": "32"}, text_response("\\boxed{32}"))
    assert (out.reward, out.fields["extracted_answer"]) == (1.0, "32")


def test_library_verify_in_process() -> None:
    assert library_verify("\\(\\frac{1}{2}\\)", "so \\boxed{0.5}") == (1.0, "1/2")
    assert library_verify("2", "no math here") == (0.0, None)
    assert library_verify("", "\\boxed{1}") == (0.0, None)  # no gold to extract: math-verify raises, we score 0


@pytest.mark.parametrize(
    ("raw", "stripped"),
    [("\\(\\sqrt{2}\\)", "\\sqrt{2}"), ("$12$", "12"), (" $ 3 $ ", "3"), ("$", "$"), ("\\(  $5$ \\)", "5"), ("7", "7")],
)
def test_strip_math_delimiters(raw: str, stripped: str) -> None:
    assert strip_math_delimiters(raw) == stripped


def test_response_text_joins_output_text_parts_of_messages_only() -> None:
    msg = Message(
        role="assistant",
        content=[
            {"type": "output_text", "text": "a"},
            {"type": "refusal", "refusal": "x"},
            {"type": "output_text", "text": "b"},
        ],
    )
    response = Response(
        id="r", created_at=0.0, output=[Reasoning(id="rs", summary=[{"text": "zzz"}]), msg, assistant_message("c")]
    )
    assert output_text(response.output) == "abc"


@pytest.mark.parametrize("task", [{"expected_answer": "1"}, {"question": "q"}, {"question": "q", "expected_answer": 1}])
@module_loop
async def test_task_rows_need_question_and_expected_answer_strings(task: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="task row needs a string"):
        await (await session()).verify(task, text_response("\\boxed{1}"))


@pytest.mark.parametrize(
    "options", [{"judge": "x"}, {"library_verifier_timeout_seconds": 0}, {"library_verifier_max_concurrency": 0}]
)
def test_bad_options_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="math options"):
        parse_options(options)


def test_config_names_its_judge() -> None:
    cfg = load_config(ENV_DIR / "config.yaml")
    res = cfg.resources["math"]
    assert parse_options(res.options).judge_model in cfg.models
