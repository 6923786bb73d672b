"""equivalence_llm_judge: an LLM judge decides whether the answer matches the expected one.

Matches NeMo Gym's ``equivalence_llm_judge`` resources server (with its shipped
config as the defaults). The judge is a model of the config, reached through
``self.models.generate(..., model=options["judge_model"])``, so it scales like any
model worker.

What is judged:

- the **question** is the text of the last ``user`` message with string content in
  the task's ``responses_create_params.input`` (``question_extract_regex`` may cut
  it: last match, first non-empty group, else the whole match);
- the **expected answer** is the task's ``expected_answer`` (or
  ``metadata.expected_answer`` when that is empty);
- the **generated answer** is the text of the response's last assistant message
  (its text parts joined with newlines, stripped); an empty or missing message is
  ``msg_extraction_failure``. ``response_extract_regex``, or the row's
  ``template_metadata.output_regex`` when ``use_per_record_regex``, picks the last
  match's first non-empty group (else the whole match); no match keeps the text.

The judge gets one user message, the prompt template filled with the three
(plus a system message if ``judge_system_message`` is set). Its verdict is read
from the last content part of its last output item, which must be a message: the
label that occurs *first* in the text wins (``[[A=B]]`` equal, ``[[A!=B]]`` not
equal); neither label, or any other shape, is "not equal".

Reward: 1.0 when the judge says equal, else 0.0; with ``check_twice_swap`` an
equal verdict is checked again with the two answers swapped (``reward_if_swap_fails``
when that disagrees); with ``check_full_generation_on_fail`` and a per-record
regex, a failed first pass is retried on the whole text for
``reward_if_full_generation_succeeds``. Extra fields: ``expected_answer`` and
``judge_evaluations`` (per judge call: ``responses_create_params`` in NeMo Gym's
dump shape, the judge's ``response``, ``verdict_label``). A failing judge call
raises, so the rollout becomes a failure row, never a silent 0 (NeMo Gym routes
judge errors to its failures file too).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from gym_runtime.messages import CreateParams, Message, Response, create_params, recorded_create_params
from gym_runtime.resource import Resource, Verdict
from gym_runtime.resource import parse_options as _parse_options

# NeMo Gym's prompt_templates/equivalence_llm_judge.txt (Apache-2.0), the default template.
DEFAULT_PROMPT_TEMPLATE = """\
===== System role =====
You are a meticulous STEM grader. Compare a candidate answer to a GOLD reference for a scientific question and decide strict equivalence.

Grading priorities (in order):
1) Factual equivalence to GOLD (accept algebraically/formally equivalent formulations).
2) Completeness on required parts — the candidate must include the same core parts/subclaims as the GOLD.

Rules:
- Treat GOLD as authoritative for what counts as correct.
- If GOLD is a range or set, the candidate is equivalent only if it lies within that range or is a member of that set.
- For formulas/derivations, accept mathematically identical transformations (e.g., symbol reordering, factoring, equivalent identities).
- Multi-part: all essential parts must match for “equivalent”; otherwise they are not equivalent.
- Be concise. Do NOT reveal or rewrite the GOLD.

Show your reason why they are equivalent or not equivalent first and then provide the output.

Output (at the end after double newlines):
- If equivalent: [[A=B]] they are equivalent
- If not equivalent: [[A!=B]] they are not equivalent

===== Example 1 (equivalent) =====
QUESTION:
State Avogadro’s constant (include units).

GOLD:
6.022 × 10^23 mol^-1

CANDIDATE:
6.022e23 per mole.

The candidate gives the same magnitude in scientific notation and the same “per mole” unit; no extra or missing qualifiers.

[[A=B]] they are equivalent

===== Example 2 (not equivalent) =====
QUESTION:
State the first law of thermodynamics for a closed system and identify what each symbol represents.

GOLD:
ΔU = Q − W ; ΔU is change in internal energy, Q is heat added to the system, W is work done by the system.

CANDIDATE:
ΔU = Q + W ; ΔU is change in internal energy, Q is heat added to the system, W is work done by the system.

The candidate uses the opposite sign convention for work relative to the required relationship; one core part is incorrect, so the overall statement does not match.

[[A!=B]] they are not equivalent

===== Inputs =====
QUESTION:
{question}

GOLD:
{expected_answer}

CANDIDATE:
{generated_answer}"""


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``resources.<name>.options`` in the config; defaults are NeMo Gym's shipped config."""

    judge_model: str = "judge"  # a key of the config's ``models``
    judge_responses_create_params: dict[str, Any] = msgspec.field(default_factory=lambda: {"input": []})
    judge_system_message: str | None = None
    judge_prompt_template: str | None = None  # inline template; wins over the file
    judge_prompt_template_fpath: str | None = None
    judge_equal_label: str = "[[A=B]]"
    judge_not_equal_label: str = "[[A!=B]]"
    question_extract_regex: str | None = None
    response_extract_regex: str | None = None
    msg_extraction_failure: str = "[NO VALID ANSWER EXTRACTED]"
    check_twice_swap: bool = False
    reward_if_swap_fails: float = 0.0
    use_per_record_regex: bool = True
    extraction_length_threshold: int | None = None
    check_full_generation_on_fail: bool = False
    reward_if_full_generation_succeeds: float = 0.0


def parse_options(raw: dict[str, Any]) -> Options:
    return _parse_options(raw, Options, "equivalence_llm_judge")


def pick(text: str, pattern: str | None) -> str:
    """The last regex match's first non-empty group (stripped), else the whole match; no match: ``text``."""
    if not pattern:
        return text
    try:
        matches = list(re.finditer(pattern, text, flags=re.MULTILINE | re.DOTALL))
    except re.error:
        return text
    if not matches:
        return text
    last = matches[-1]
    for group in last.groups():
        if isinstance(group, str) and group.strip():
            return group.strip()
    return last.group(0).strip()


def question_text(task: dict[str, Any], pattern: str | None) -> str:
    """The last user message with string content in the task's input, optionally cut by ``pattern``."""
    params = task.get("responses_create_params") or {}
    items = params.get("input") if isinstance(params, dict) else None
    last = None
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and item.get("role") == "user" and isinstance(item.get("content"), str):
                last = item["content"]
    text = (last or "").strip()
    return pick(text, pattern) if text else text


def expected_answer(task: dict[str, Any]) -> str:
    value = task.get("expected_answer")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"task row: expected_answer must be a string, got {type(value).__name__}")
    if value:
        return value
    metadata = task.get("metadata") or {}
    found = metadata.get("expected_answer") if isinstance(metadata, dict) else None
    return "" if found is None else str(found)


def generated_answer(response: Response, pattern: str | None, failure: str) -> str:
    """The last assistant message's text (parts joined by newlines), optionally cut by ``pattern``."""
    for item in reversed(response.output):
        if not (isinstance(item, Message) and item.role == "assistant"):
            continue
        if isinstance(item.content, str):
            text = item.content.strip()
        else:
            text = "\n".join(
                p["text"] for p in item.content if isinstance(p, dict) and isinstance(p.get("text"), str)
            ).strip()
        return pick(text, pattern) if text else failure
    return failure


def judge_verdict(response: Response, equal_label: str, not_equal_label: str) -> str | None:
    """The label the judge chose: the one that occurs first in its final text part; None if neither or no text."""
    if not response.output or not isinstance(response.output[-1], Message):
        return None
    content = response.output[-1].content
    if isinstance(content, str):
        text = content
    elif content and isinstance(content[-1], dict):
        last = content[-1].get("text")
        text = last if isinstance(last, str) else ""
    else:
        return None
    eq, neq = text.find(equal_label), text.find(not_equal_label)
    if eq < 0 and neq < 0:
        return None
    return equal_label if eq >= 0 and (neq < 0 or eq < neq) else not_equal_label


def per_record_regex(task: dict[str, Any]) -> str | None:
    meta = task.get("template_metadata")
    return meta.get("output_regex") or None if isinstance(meta, dict) else None


class JudgeTask(msgspec.Struct, kw_only=True):
    """The task fields verify reads (``expected_answer`` may sit in ``metadata`` instead)."""

    expected_answer: str | None = None
    metadata: dict[str, Any] | None = None
    template_metadata: dict[str, Any] | None = None


class EquivalenceLLMJudge(Resource):
    """Stateless; every verify asks the judge model once (or twice with a swap or rescue pass)."""

    task_fields = JudgeTask
    check_task = staticmethod(expected_answer)

    _opts: Options = Options()
    _template: str = DEFAULT_PROMPT_TEMPLATE

    @classmethod
    async def setup(cls, options: dict[str, Any]) -> None:
        await super().setup(options)
        cls._opts = opts = parse_options(options)
        if opts.judge_prompt_template is not None:
            cls._template = opts.judge_prompt_template.strip()
        elif opts.judge_prompt_template_fpath is not None:
            cls._template = Path(opts.judge_prompt_template_fpath).read_text().strip()
        else:
            cls._template = DEFAULT_PROMPT_TEMPLATE

    def judge_messages(self, question: str, expected: str, generated: str) -> list[dict[str, Any]]:
        """The judge's input, as NeMo Gym dumps it (easy input messages with ``type``)."""
        prompt = self._template.format(question=question, expected_answer=expected, generated_answer=generated)
        system = self._opts.judge_system_message
        msgs = [{"content": system, "role": "system", "type": "message"}] if system else []
        return [*msgs, {"content": prompt, "role": "user", "type": "message"}]

    async def _evaluate(self, question: str, expected: str, generated: str) -> tuple[bool, dict[str, Any]]:
        opts = self._opts
        messages = self.judge_messages(question, expected, generated)
        base = {k: v for k, v in opts.judge_responses_create_params.items() if k != "input"}
        params: CreateParams = create_params({**base, "input": messages})
        response = await self.models.generate(params, model=opts.judge_model)
        label = judge_verdict(response, opts.judge_equal_label, opts.judge_not_equal_label)
        record = {
            "responses_create_params": recorded_create_params({**base, "input": messages}),
            "response": msgspec.to_builtins(response),
            "verdict_label": label,
        }
        return label == opts.judge_equal_label, record

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        opts = self._opts
        expected = expected_answer(task)
        question = question_text(task, opts.question_extract_regex)
        record_regex = per_record_regex(task) if opts.use_per_record_regex else None
        too_long = (
            record_regex is not None
            and opts.extraction_length_threshold is not None
            and len(expected) > opts.extraction_length_threshold
        )
        regex = None if too_long else (record_regex or opts.response_extract_regex)
        generated = generated_answer(response, regex, opts.msg_extraction_failure)

        equal, first = await self._evaluate(question, expected, generated)
        evaluations = [first]
        if equal:
            reward = 1.0
            if opts.check_twice_swap and not too_long:
                swapped_equal, second = await self._evaluate(question, generated, expected)
                evaluations.append(second)
                reward = 1.0 if swapped_equal else opts.reward_if_swap_fails
        else:
            reward = 0.0
            if opts.check_full_generation_on_fail and record_regex is not None and not too_long:
                whole = generated_answer(response, None, opts.msg_extraction_failure)
                rescued, second = await self._evaluate(question, expected, whole)
                evaluations.append(second)
                reward = opts.reward_if_full_generation_succeeds if rescued else 0.0
        return Verdict(reward=reward, fields={"expected_answer": expected, "judge_evaluations": evaluations})
