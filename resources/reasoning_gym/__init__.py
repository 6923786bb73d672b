"""reasoning_gym: procedurally generated reasoning tasks, scored by the ``reasoning-gym`` package.

Matches NeMo Gym's ``reasoning_gym`` resources server. A task row is a
reasoning-gym entry: ``question``, ``answer`` (may be null) and ``metadata``, whose
``source_dataset`` names the task (``python -m gym_runtime.resources.reasoning_gym.generate``
writes such rows for any reasoning-gym task).

The answer is read as NeMo Gym's verify reads it, from the ``output_text`` parts
of the message items, joined (reasoning items and ``<think>`` text are not
removed or treated apart):

1. the last ``<answer>...</answer>`` (reasoning-gym's ``extract_answer``: one
   space or newline trimmed inside the tags, then stripped);
2. else the first ``\\boxed{...}`` holding no ``}`` (up to the first closing
   brace, stripped; ``\\boxed{}`` is no box);
3. else the whole text, stripped (empty when blank).

The score is ``score_answer`` of the task's dataset class with its default config
(``reasoning_gym.get_score_answer_fn``), run in a worker process with a time limit
(``options.timeout_s``, default 30 s); a scorer that raises or times out, or an
unknown task, scores 0. ``reward`` is the score; extra fields ``task_name``,
``score`` and ``extracted_answer``.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from gym_runtime.messages import Response, output_text
from gym_runtime.resource import Resource, Verdict, run_in_process

__all__ = ["ReasoningGym", "extract_answer", "score_answer"]

_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^}]+)\}")


def extract_answer(text: str) -> str:
    """The model's answer in a response text (see the module docstring for the order)."""
    tags = list(_ANSWER_TAG.finditer(text))
    if tags:
        return tags[-1].group(1).strip()
    boxed = _BOXED.search(text)
    if boxed:
        return boxed.group(1).strip()
    return text.strip()


def score_answer(task_name: str, answer: str, entry: dict[str, Any]) -> float:
    """reasoning-gym's own score for ``answer`` (0.0 when scoring fails). Runs in a worker process."""
    try:
        import reasoning_gym

        return float(reasoning_gym.get_score_answer_fn(task_name)(answer=answer, entry=entry))
    except Exception:
        return 0.0


def _entry(row: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    question, metadata = row.get("question"), row.get("metadata")
    if not isinstance(question, str):
        raise ValueError("task row: question (a string) is required")
    if "answer" not in row or not (row["answer"] is None or isinstance(row["answer"], str)):
        raise ValueError("task row: answer (a string or null) is required")
    if not isinstance(metadata, dict):
        raise ValueError("task row: metadata (an object) is required")
    task_name = metadata.get("source_dataset")
    if not task_name:
        raise ValueError(f"task row: no task name (metadata.source_dataset) in metadata: {metadata}")
    return task_name, {"question": question, "answer": row["answer"], "metadata": metadata}


class ReasoningGymTask(msgspec.Struct, kw_only=True):
    """The task fields verify reads; ``metadata.source_dataset`` names the task."""

    question: str
    answer: str | None
    metadata: dict[str, Any]


class ReasoningGym(Resource):
    """Stateless and single-turn: no tools."""

    task_fields = ReasoningGymTask
    requires = ("reasoning_gym",)
    install = "pip install 'gym-runtime[envs]'"
    check_task = staticmethod(_entry)

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        task_name, entry = _entry(task)
        answer = extract_answer(output_text(response.output))
        try:
            score = await run_in_process(
                score_answer, task_name, answer, entry, timeout=float(self.options.get("timeout_s", 30.0))
            )
        except TimeoutError:
            score = 0.0  # a wedged scorer scores 0, as NeMo Gym's grader pool does
        return Verdict(reward=score, fields={"task_name": task_name, "score": score, "extracted_answer": answer})
