"""equivalence_llm_judge against NeMo Gym's recorded rollouts (which carry the judge's replies).

The judge is an LLM, so it is replaced here by ``ScriptedJudge``, a named TEST DOUBLE that
replays judge replies: NeMo Gym's recorded ones, or texts written in the test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gym_runtime.config import load_config
from gym_runtime.messages import (
    CreateParams,
    Message,
    Reasoning,
    Response,
)
from gym_runtime.resource import Verdict
from gym_runtime.resources.equivalence_llm_judge import (
    DEFAULT_PROMPT_TEMPLATE,
    EquivalenceLLMJudge,
    generated_answer,
    judge_verdict,
    parse_options,
    pick,
    question_text,
)
from tests.differential import (
    COMPAT,
    ScriptedJudge,
    example_rollouts,
    new_session,
    recorded_response,
    text_response,
)

ENV_DIR = Path(__file__).resolve().parents[1]
NEMO = COMPAT / "nemo_gym" / "equivalence_llm_judge"
EQ, NEQ = "[[A=B]]", "[[A!=B]]"


def task(question: str = "Who proposed natural selection?", expected: str = "darwin", **extra: Any) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": question}]},
        "expected_answer": expected,
        **extra,
    }


async def session(judge: ScriptedJudge, **options: Any) -> EquivalenceLLMJudge:
    return await new_session(EquivalenceLLMJudge, options, models=judge)


async def test_recorded_rollouts_reverify_to_recorded_reward_and_fields() -> None:
    """Replaying NeMo Gym's recorded judge replies: same prompt sent, same verdict, same reward and fields."""
    pairs = example_rollouts(ENV_DIR, NEMO)
    assert len(pairs) == 5
    for row, rollout in pairs:
        recorded = rollout["judge_evaluations"]
        judge = ScriptedJudge([recorded_response(e["response"]) for e in recorded])
        out = await (await session(judge)).verify(row, recorded_response(rollout["response"]))
        assert isinstance(out, Verdict)
        assert out.reward == rollout["reward"]
        assert set(out.fields) == set(rollout) - {"responses_create_params", "response", "reward"}
        assert out.fields["expected_answer"] == rollout["expected_answer"]
        ours = out.fields["judge_evaluations"]
        assert len(ours) == len(recorded) == len(judge.calls)
        for mine, theirs in zip(ours, recorded):
            assert mine["responses_create_params"] == theirs["responses_create_params"]  # the exact prompt
            assert mine["verdict_label"] == theirs["verdict_label"]
            for key, value in mine["response"].items():
                if key in theirs["response"] and key != "output":
                    assert value == theirs["response"][key], key
            ours_text = [p["text"] for i in mine["response"]["output"] if i["type"] == "message" for p in i["content"]]
            theirs_text = [
                p["text"] for i in theirs["response"]["output"] if i["type"] == "message" for p in i["content"]
            ]
            assert ours_text == theirs_text


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("The candidate matches.\n\n[[A=B]] they are equivalent", EQ),
        ("Extra word.\n\n[[A!=B]] they are not equivalent", NEQ),
        ("[[A=B]] at first, then [[A!=B]]", EQ),  # the label that occurs first wins
        ("[[A!=B]] at first, then [[A=B]]", NEQ),
        ("no verdict at all", None),
        ("", None),
    ],
)
def test_verdict_parsing(text: str, label: str | None) -> None:
    assert judge_verdict(text_response(text), EQ, NEQ) == label


def test_verdict_needs_a_final_message() -> None:
    assert judge_verdict(Response(id="j", created_at=0.0, output=[]), EQ, NEQ) is None
    reasoning_last = Response(id="j", created_at=0.0, output=[*text_response(EQ).output, Reasoning(id="rs")])
    assert judge_verdict(reasoning_last, EQ, NEQ) is None
    refusal = Response(
        id="j", created_at=0.0, output=[Message(role="assistant", content=[{"type": "refusal", "refusal": EQ}])]
    )
    assert judge_verdict(refusal, EQ, NEQ) is None
    two_parts = Message(
        role="assistant", content=[{"type": "output_text", "text": EQ}, {"type": "output_text", "text": "hmm"}]
    )
    assert judge_verdict(Response(id="j", created_at=0.0, output=[two_parts]), EQ, NEQ) is None  # the last part only


@pytest.mark.parametrize(("reply", "reward"), [(f"ok {EQ}", 1.0), (f"no {NEQ}", 0.0), ("unsure", 0.0)])
async def test_reward_follows_the_verdict(reply: str, reward: float) -> None:
    judge = ScriptedJudge([text_response(reply)])
    out = await (await session(judge)).verify(task(), text_response("Charles Darwin"))
    assert out.reward == reward
    assert len(out.fields["judge_evaluations"]) == 1
    assert out.fields["judge_evaluations"][0]["verdict_label"] == {1.0: EQ, 0.0: NEQ if "no" in reply else None}[reward]


async def test_prompt_is_the_template_filled_with_question_gold_and_candidate() -> None:
    judge = ScriptedJudge([text_response(EQ)])
    await (await session(judge)).verify(task(), text_response("Charles Darwin.\n\n\\boxed{Darwin}"))
    (prompt,) = judge.prompts()
    assert prompt == DEFAULT_PROMPT_TEMPLATE.format(
        question="Who proposed natural selection?",
        expected_answer="darwin",
        generated_answer="Charles Darwin.\n\n\\boxed{Darwin}",
    )
    assert [m.role for m in judge.calls[0].input] == ["user"]  # no system message by default


async def test_swap_check_asks_again_with_the_answers_swapped() -> None:
    judge = ScriptedJudge([text_response(EQ), text_response(NEQ)])
    out = await (await session(judge, check_twice_swap=True, reward_if_swap_fails=-1.0)).verify(
        task(), text_response("Darwin")
    )
    assert out.reward == -1.0 and len(out.fields["judge_evaluations"]) == 2
    first, second = judge.prompts()
    assert "GOLD:\ndarwin\n\nCANDIDATE:\nDarwin" in first and "GOLD:\nDarwin\n\nCANDIDATE:\ndarwin" in second
    judge = ScriptedJudge([text_response(NEQ)])  # a first "not equal" is final
    out = await (await session(judge, check_twice_swap=True)).verify(task(), text_response("Wallace"))
    assert out.reward == 0.0 and len(out.fields["judge_evaluations"]) == 1


async def test_per_record_regex_and_full_generation_rescue() -> None:
    row = task(template_metadata={"output_regex": r"Answer:\s*(\w+)"})
    judge = ScriptedJudge([text_response(NEQ), text_response(EQ)])
    inst = await session(judge, check_full_generation_on_fail=True, reward_if_full_generation_succeeds=0.5)
    out = await inst.verify(row, text_response("I think Answer: Lamarck\nno wait, Answer: Darwin"))
    assert out.reward == 0.5
    first, second = judge.prompts()
    assert first.endswith("CANDIDATE:\nDarwin")  # the last match's group
    assert second.endswith("CANDIDATE:\nI think Answer: Lamarck\nno wait, Answer: Darwin")
    # Without a per-record regex there is nothing to rescue.
    judge = ScriptedJudge([text_response(NEQ)])
    inst = await session(judge, check_full_generation_on_fail=True)
    assert (await inst.verify(task(), text_response("Darwin"))).reward == 0.0


async def test_long_expected_answers_skip_the_per_record_regex() -> None:
    row = task(expected="x" * 30, template_metadata={"output_regex": r"Answer:\s*(\w+)"})
    judge = ScriptedJudge([text_response(NEQ)])
    inst = await session(judge, extraction_length_threshold=20, check_full_generation_on_fail=True)
    out = await inst.verify(row, text_response("Answer: y"))
    assert out.reward == 0.0 and len(judge.calls) == 1  # no rescue: the whole text was judged already
    assert judge.prompts()[0].endswith("CANDIDATE:\nAnswer: y")


async def test_system_message_labels_and_create_params_options() -> None:
    judge = ScriptedJudge([text_response("YES")], model="grader")
    inst = await session(
        judge,
        judge_model="grader",
        judge_system_message="Be strict.",
        judge_prompt_template="Q={question} G={expected_answer} C={generated_answer}",
        judge_equal_label="YES",
        judge_not_equal_label="NO",
        judge_responses_create_params={"input": [], "temperature": 0.0, "max_output_tokens": 64},
    )
    out = await inst.verify(task(), text_response("Darwin"))
    assert out.reward == 1.0
    params = judge.calls[0]
    assert [(m.role, m.content) for m in params.input] == [  # type: ignore[union-attr]
        ("system", "Be strict."),
        ("user", "Q=Who proposed natural selection? G=darwin C=Darwin"),
    ]
    assert (params.temperature, params.max_output_tokens) == (0.0, 64)
    dumped = out.fields["judge_evaluations"][0]["responses_create_params"]
    assert dumped["temperature"] == 0.0 and dumped["stream"] is None and dumped["input"][0]["type"] == "message"


def test_generated_answer_extraction() -> None:
    fail = "[NO VALID ANSWER EXTRACTED]"
    two_parts = Message(
        role="assistant", content=[{"type": "output_text", "text": " a "}, {"type": "output_text", "text": "b"}]
    )
    assert generated_answer(Response(id="r", created_at=0.0, output=[two_parts]), None, fail) == "a \nb"
    assert generated_answer(text_response("first", "  last  "), None, fail) == "last"  # the last assistant message
    assert generated_answer(text_response("   "), None, fail) == fail
    assert generated_answer(Response(id="r", created_at=0.0, output=[Reasoning(id="x")]), None, fail) == fail
    assert generated_answer(text_response("Answer: 4"), r"Answer: (\d+)", fail) == "4"
    assert generated_answer(text_response("no match"), r"Answer: (\d+)", fail) == "no match"
    assert generated_answer(text_response("x"), r"(", fail) == "x"  # an invalid regex extracts nothing


def test_pick_prefers_the_first_non_empty_group_of_the_last_match() -> None:
    assert pick("A: 1\nA: 2", r"A: (\d)") == "2"
    assert pick("key=  ", r"key=(\s*)|key") == "key="
    assert pick("abc", r"b") == "b"


def test_question_is_the_last_user_message_with_string_content() -> None:
    row = {
        "responses_create_params": {
            "input": [
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "ignored"},
                {"role": "user", "content": " Question: second? "},
                {"role": "user", "content": [{"type": "input_text", "text": "parts are skipped"}]},
            ]
        }
    }
    assert question_text(row, None) == "Question: second?"
    assert question_text(row, r"Question:\s*(.*)") == "second?"
    assert question_text({"responses_create_params": {"input": "a plain string"}}, None) == ""


async def test_expected_answer_falls_back_to_metadata() -> None:
    judge = ScriptedJudge([text_response(EQ)])
    row = task(expected="", metadata={"expected_answer": 42})
    out = await (await session(judge)).verify(row, text_response("42"))
    assert out.fields["expected_answer"] == "42" and "GOLD:\n42\n" in judge.prompts()[0]


async def test_a_failing_judge_call_raises_instead_of_scoring() -> None:
    class BrokenJudge:
        """TEST DOUBLE: a judge model that is unreachable."""

        async def generate(self, params: CreateParams, *, model: str) -> Response:
            raise ConnectionError("judge down")

    inst = await session(ScriptedJudge([]))
    inst.models = BrokenJudge()
    with pytest.raises(ConnectionError):
        await inst.verify(task(), text_response("Darwin"))


def test_unknown_options_are_refused() -> None:
    with pytest.raises(ValueError, match="equivalence_llm_judge options"):
        parse_options({"judge_modle": "judge"})


def test_config_names_its_judge() -> None:
    cfg = load_config(ENV_DIR / "config.yaml")
    res = cfg.resources["equivalence_llm_judge"]
    assert parse_options(res.options).judge_model in cfg.models
