"""calendar: multi-turn scheduling; the verifier checks the final schedule.

Matches NeMo Gym's ``calendar`` resources server. The user asks, turn by turn, to
add events (with an id and a duration) and to constrain them ("between 10am and
11:45am", "before 1:45pm", "after 2pm", "at 3pm"); after every user turn the
assistant prints the whole calendar as a JSON list of
``{"event_id", "event_name", "start_time", "duration"}``. The task's
``exp_cal_state`` maps each event id to its duration, constraint and allowed
window (``min_time``/``max_time``).

Grading of an answer (NeMo Gym's rules, reimplemented): reward 0 if it contains
``<think>``; 1 if no events are expected; otherwise 0 unless the first JSON list
of objects in the text has exactly the expected events, none overlapping, each
with the expected duration, inside the window and satisfying its constraint; any
malformed value counts as 0. The graded text is that of the *last* output item
(an answer cut while still reasoning scores 0).

Two task layouts, both run by ``agents.multi_turn`` with ``user: env``:

* **NeMo Gym's** (``data/example.jsonl``): the conversation so far, earlier
  assistant calendars included, is in ``responses_create_params.input`` and the
  policy answers its last user turn: one policy turn, graded. This reproduces
  NeMo Gym's rewards for the same answers.
* **Interactive** (``data/example_interactive.jsonl``, made by
  ``interactive_row``): the input holds only the system prompt; the user turns are
  in ``user_turns``. ``reset`` gives the first one, each ``step`` the next, so the
  policy keeps the calendar itself over the whole conversation. Every
  intermediate answer is checked too (no ``<think>``, no overlapping events in a
  printed calendar); a failed check ends the episode early with reward 0. The
  final answer is graded as above.

The row carries ``terminated``/``truncated``/``info`` (``info.grade_reason``:
pass, think_found, no_json_list, different_number_of_events,
conflicting_events, constraint_violated, error_in_grading, or
``turn N: ...`` for an early stop).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from gym_runtime.gymnasium import Action, GymResource, Step
from gym_runtime.messages import Response, last_item_text
from gym_runtime.resource import Verdict

# ----------------------------------------------------------------------- grading


def to_minutes(text: str) -> int:
    """``"10:30"``, ``"2pm"``, ``"11:45am"`` → minutes after midnight (12am is 0, 12pm is noon)."""
    s = text.strip()
    suffix = "am" if "am" in s else ("pm" if "pm" in s else None)
    if suffix is None:
        hours, minutes = (int(x) for x in s.split(":"))
        return hours * 60 + minutes
    core = s.replace(suffix, "")
    if ":" in core:
        hours, minutes = (int(x) for x in core.split(":"))
    else:
        hours, minutes = int(core), 0
    return (0 if hours == 12 else hours * 60) + minutes + (12 * 60 if suffix == "pm" else 0)


def _json_list_span(text: str) -> tuple[int, int] | None:
    """Where NeMo Gym's calendar regex first matches, without its exponential backtracking.

    The regex is ``\\[ X \\{ X \\} X \\]`` with ``X = (?:[^\\[\\]]|\\{[^}]*\\})*``: a ``[``, then text
    without brackets (a bracket may sit inside a ``{...}`` group, which ends at its first ``}``),
    holding a ``{`` and a later ``}``, then ``]``. Python's engine tries, greedily, a plain character
    before a group before leaving the loop; ``[{}{}{}...`` with no ``]`` then takes 2^n tries (a cut
    answer of 20 events: seconds). This walks the same choices in the same order, remembering the
    (part, position) states that failed, so the first match it finds is the engine's, in O(n) states.
    """
    n = len(text)
    closing = [-1] * (n + 1)  # closing[k]: the first "}" at or after k
    for k in range(n - 1, -1, -1):
        closing[k] = k if text[k] == "}" else closing[k + 1]
    literal = "{}]"  # what ends the loop of part 0, 1, 2
    failed: set[tuple[int, int]] = set()

    def match_from(part: int, pos: int) -> int:
        # Explicit stack of (part, pos, next choice); returns the match end or -1.
        stack = [(part, pos, 0)]
        while stack:
            part, pos, choice = stack.pop()
            if choice == 0:
                if (part, pos) in failed:
                    continue
                stack.append((part, pos, 1))
                if pos < n and text[pos] not in "[]":
                    stack.append((part, pos + 1, 0))
                continue
            if choice == 1:
                stack.append((part, pos, 2))
                if pos < n and text[pos] == "{" and closing[pos + 1] != -1:
                    stack.append((part, closing[pos + 1] + 1, 0))
                continue
            if choice == 2:
                stack.append((part, pos, 3))
                if pos < n and text[pos] == literal[part]:
                    if part == 2:
                        return pos + 1
                    stack.append((part + 1, pos + 1, 0))
                continue
            failed.add((part, pos))  # choice 3: every way on from here failed
        return -1

    last = text.rfind("]")  # every match ends with one: no search starts after the last
    for start in range(last):
        if text[start] == "[" and (end := match_from(0, start + 1)) != -1:
            return start, end
    return None


def first_json_list(text: str) -> Any:
    """NeMo Gym's ``extract_json_list``: the regex's first match parsed as JSON (None if none or invalid).

    The first match decides: if it is not valid JSON the answer has no calendar, even when a later
    span would parse (a single event holding a list, ``[{"tags": ["a"]}]``, is no match at all).
    """
    span = _json_list_span(text)
    if span is None:
        return None
    try:
        return json.loads(text[span[0] : span[1]])
    except json.JSONDecodeError:
        return None


def overlaps_another(events: list[dict[str, Any]], event: dict[str, Any]) -> bool:
    """Whether ``event`` overlaps an event of ``events`` other than (an equal copy of) itself."""
    start = to_minutes(event["start_time"])
    end = start + event["duration"]
    for other in events:
        if event and other == event:
            continue
        o_start = to_minutes(other["start_time"])
        o_end = o_start + other["duration"]
        if start < o_end and o_start < end:
            return True
    return False


def meets_constraint(event: dict[str, Any], spec: dict[str, Any]) -> bool:
    if event["duration"] != spec["duration"]:
        return False
    start = to_minutes(event["start_time"])
    end = start + event["duration"]
    if start < to_minutes(spec["min_time"]) or end > to_minutes(spec["max_time"]):
        return False
    constraint = spec["constraint"]
    if constraint is None:
        return True
    for kind in ("before ", "after ", "between ", "at "):
        if constraint.startswith(kind):
            rest = constraint.replace(kind, "")
            break
    else:
        return True
    if kind == "before ":
        return end <= to_minutes(rest)
    if kind == "after ":
        return start >= to_minutes(rest)
    if kind == "at ":
        return start == to_minutes(rest)
    bounds = rest.split(" and ")
    if len(bounds) != 2:
        raise ValueError(f"invalid 'between' constraint: {constraint!r}")
    return start >= to_minutes(bounds[0]) and end <= to_minutes(bounds[1])


def grade(text: str, expected: dict[str, Any]) -> tuple[float, str]:
    """(reward, reason) for an answer against the expected calendar state."""
    if "<think>" in text:
        return 0.0, "think_found"
    if not expected:
        return 1.0, "pass"
    try:
        calendar = first_json_list(text)
        if not calendar:
            return 0.0, "no_json_list"
        by_id = {str(e["event_id"]): e for e in calendar}
        if len(by_id) != len(expected):
            return 0.0, "different_number_of_events"
        if any(overlaps_another(calendar, e) for e in calendar):
            return 0.0, "conflicting_events"
        if not all(meets_constraint(by_id[k], spec) for k, spec in expected.items()):
            return 0.0, "constraint_violated"
    except Exception:
        return 0.0, "error_in_grading"
    return 1.0, "pass"


def check_intermediate(text: str) -> str | None:
    """Why an intermediate answer fails (None if it is acceptable)."""
    if "<think>" in text:
        return "think_found"
    try:
        calendar = first_json_list(text)
        if calendar and any(overlaps_another(calendar, e) for e in calendar):
            return "conflicting_events"
    except Exception:
        return None  # an unreadable intermediate calendar is judged at the end, not here
    return None


# ------------------------------------------------------------------------ layouts


def interactive_row(row: dict[str, Any]) -> dict[str, Any]:
    """NeMo Gym's history layout → the interactive one.

    System/developer messages stay in the input; the user messages become
    ``user_turns``; the recorded assistant turns are dropped (the policy writes
    its own). Other task fields are kept.
    """
    params = dict(row["responses_create_params"])
    raw = params["input"]
    messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
    params["input"] = [m for m in messages if m.get("role") in ("system", "developer")]
    turns = [m["content"] for m in messages if m.get("role") == "user"]
    out = {k: v for k, v in row.items() if k != "responses_create_params"}
    return {"responses_create_params": params, "user_turns": turns, **out}


# ----------------------------------------------------------------------- resource


class CalendarTask(msgspec.Struct, kw_only=True):
    """The task fields reset and verify read."""

    exp_cal_state: dict[str, Any]
    user_turns: list[str] | None = None


class Calendar(GymResource):
    task_fields = CalendarTask

    async def reset(self, task: dict[str, Any]) -> str | None:
        turns = task.get("user_turns")
        if turns is not None and not (isinstance(turns, list) and all(isinstance(t, str) for t in turns)):
            raise ValueError("user_turns must be a list of strings")
        self.user_turns: list[str] = list(turns or [])
        self.next_turn = 1
        return self.user_turns[0] if self.user_turns else None

    def _expected(self, task: dict[str, Any]) -> dict[str, Any]:
        expected = task.get("exp_cal_state")
        if not isinstance(expected, dict):
            raise ValueError("task row: exp_cal_state must be an object of event id -> expected event")
        return expected

    async def step(self, action: Action) -> Step:
        if self.next_turn < len(self.user_turns):
            failed = check_intermediate(action.text)
            if failed:
                return Step(reward=0.0, terminated=True, info={"grade_reason": f"turn {action.turn}: {failed}"})
            text = self.user_turns[self.next_turn]
            self.next_turn += 1
            return Step(observation=text)
        reward, reason = grade(last_item_text(action.output), self._expected(self.task))
        return Step(reward=reward, terminated=True, info={"grade_reason": reason})

    async def verify(self, task: dict[str, Any], response: Response) -> float | Verdict:
        if self.steps:
            return await super().verify(task, response)
        # No episode (re-verify, or another user source): grade the response's final answer.
        reward, reason = grade(last_item_text(response.output), self._expected(task))
        return Verdict(reward=reward, fields={"terminated": True, "truncated": False, "info": {"grade_reason": reason}})


__all__ = ["Calendar", "first_json_list", "grade", "interactive_row", "to_minutes"]
