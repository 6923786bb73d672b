"""calendar: grading rules, both task layouts, and NeMo Gym's recorded rewards (no NATS here)."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

import gym_runtime.resources.calendar as calendar_module
from gym_runtime.config import load_config
from gym_runtime.gymnasium import RESET, STEP, Action, Reset, Step
from gym_runtime.messages import Response, assistant_message, last_item_text, parse_items
from gym_runtime.resource import Verdict, find_resource_class
from gym_runtime.resources.calendar import (
    Calendar,
    _json_list_span,
    first_json_list,
    grade,
    interactive_row,
    to_minutes,
)
from tests.differential import COMPAT, compat_dir, example_rollouts, read_jsonl

ENV_DIR = Path(__file__).resolve().parents[1]
NEMO = COMPAT / "nemo_gym" / "calendar"


def cal(*events: tuple[int, str, int]) -> str:
    return json.dumps([{"event_id": i, "event_name": f"e{i}", "start_time": t, "duration": d} for i, t, d in events])


EXPECTED = {
    "0": {
        "event_id": 0,
        "duration": 60,
        "constraint": "between 10am and 11:45am",
        "min_time": "10:00",
        "max_time": "16:00",
    },
    "1": {"event_id": 1, "duration": 30, "constraint": "after 2pm", "min_time": "10:00", "max_time": "16:00"},
}


@pytest.mark.parametrize(
    ("text", "minutes"),
    [
        ("10:00", 600),
        ("09:05", 545),
        ("2pm", 840),
        ("12pm", 720),
        ("12am", 0),
        ("11:45am", 705),
        ("12:30pm", 750),
        ("1:45pm", 825),
        (" 3pm ", 900),
    ],
)
def test_times(text: str, minutes: int) -> None:
    assert to_minutes(text) == minutes


@pytest.mark.parametrize("bad", ["10 AM", "ten", "10:00:00"])
def test_unreadable_times_raise(bad: str) -> None:
    with pytest.raises(ValueError):
        to_minutes(bad)


def test_first_json_list() -> None:
    assert first_json_list('Sure!\n\n[{"event_id": 0}]\nDone.') == [{"event_id": 0}]
    assert first_json_list('ids [1, 2] and then [{"event_id": 3}]') == [{"event_id": 3}]
    # NeMo Gym's regex takes a bracket only inside {...} up to its first "}": these are no calendar there
    assert first_json_list('[{"event_name": "Review [v2]", "event_id": 1}]') is None
    assert first_json_list('[{"event_id": 1, "tags": ["a"]}]') is None
    assert first_json_list('[{"event_id": 1, "tags": ["a"]}, {"event_id": 2}]') == [
        {"event_id": 1, "tags": ["a"]},
        {"event_id": 2},
    ]
    # the first candidate decides, as in NeMo Gym: invalid JSON there means "no calendar"
    assert first_json_list('[{event_id: 0}] [{"event_id": 1}]') is None
    assert first_json_list("no calendar here") is None
    assert first_json_list("[]") is None


# NeMo Gym's calendar/utils.py extract_json_list pattern, the reference for where a calendar is found.
NEMO_GYM_LIST = re.compile(r"\[(?:[^\[\]]|\{[^}]*\})*\{(?:[^\[\]]|\{[^}]*\})*\}(?:[^\[\]]|\{[^}]*\})*\]", re.DOTALL)


def test_the_calendar_is_found_where_nemo_gyms_regex_finds_it() -> None:
    """40,000 random short texts of brackets, braces and quotes: the same span as NeMo Gym's regex (re.search),
    or none where it finds none; and a cut-off 5,000-event answer, on which that regex backtracks for ages."""
    rng = random.Random(25)
    for length in range(12):
        for _ in range(3500):
            text = "".join(rng.choice('[]{}a"') for _ in range(length))
            m = NEMO_GYM_LIST.search(text)
            assert _json_list_span(text) == (m.span() if m else None), text
    started = time.monotonic()
    assert first_json_list("[" + '{"event_id": 0}, ' * 5000 + '{"event_id": 1} [') is None
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    ("text", "reward", "reason"),
    [
        (cal((0, "10:00", 60), (1, "14:00", 30)), 1.0, "pass"),
        (cal((0, "10:45", 60), (1, "2:30pm", 30)), 1.0, "pass"),
        ("<think>hm</think>" + cal((0, "10:00", 60), (1, "14:00", 30)), 0.0, "think_found"),
        ("I scheduled it.", 0.0, "no_json_list"),
        (cal((0, "10:00", 60)), 0.0, "different_number_of_events"),
        (cal((0, "10:00", 60), (1, "10:30", 30)), 0.0, "conflicting_events"),
        (cal((0, "11:00", 60), (1, "14:00", 30)), 0.0, "constraint_violated"),  # ends 12:00 > 11:45
        (cal((0, "10:00", 45), (1, "14:00", 30)), 0.0, "constraint_violated"),  # duration
        (cal((0, "10:00", 60), (1, "15:45", 30)), 0.0, "constraint_violated"),  # past max_time
        (cal((0, "10:00", 60), (2, "14:00", 30)), 0.0, "error_in_grading"),  # unknown id
        (cal((0, "10 AM", 60), (1, "14:00", 30)), 0.0, "error_in_grading"),
    ],
)
def test_grading(text: str, reward: float, reason: str) -> None:
    assert grade(text, EXPECTED) == (reward, reason)


def test_constraint_kinds() -> None:
    spec = {"duration": 30, "min_time": "10:00", "max_time": "16:00"}
    for constraint, start, ok in [
        ("before 1pm", "12:30", True),
        ("before 1pm", "12:45", False),
        ("at 2pm", "14:00", True),
        ("at 2pm", "14:15", False),
        (None, "15:00", True),
        ("sometime", "15:00", True),
    ]:
        text = cal((0, start, 30))
        assert grade(text, {"0": {**spec, "constraint": constraint}})[0] == float(ok), (constraint, start)
    assert grade("anything", {}) == (1.0, "pass")


def test_graded_text_is_the_last_items_first_part() -> None:
    msg = assistant_message("[1]")
    reasoning = parse_items([{"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}])[0]
    call = parse_items([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])[0]
    assert last_item_text([reasoning, msg]) == "[1]"
    assert last_item_text([msg, reasoning]) == ""  # cut while still thinking
    assert last_item_text([msg, call]) == ""
    assert last_item_text([]) == ""


def test_data_is_nemo_gyms_and_interactive_layout_is_derived_from_it() -> None:
    ours = read_jsonl(ENV_DIR / "data" / "example.jsonl")
    assert ours == read_jsonl(compat_dir(NEMO / "example.jsonl"))
    assert read_jsonl(ENV_DIR / "data" / "example_interactive.jsonl") == [interactive_row(r) for r in ours]
    for row in ours:
        inter = interactive_row(row)
        assert [m["role"] for m in inter["responses_create_params"]["input"]] == ["system"]
        users = [m["content"] for m in row["responses_create_params"]["input"] if m["role"] == "user"]
        assert inter["user_turns"] == users and inter["exp_cal_state"] == row["exp_cal_state"]


async def call(inst: Calendar, name: str, payload: Any = None) -> Any:
    out = await inst.call_operation(name, msgspec.json.encode(payload or {}).decode())
    return msgspec.json.decode(out, type=Reset if name == RESET else Step)


async def test_recorded_rewards_as_an_episode_and_as_a_reverify() -> None:
    for task, rec in example_rollouts(ENV_DIR, NEMO):
        output = parse_items(rec["response"]["output"])
        response = Response(id="r", created_at=0.0, output=output)
        # one policy turn: reset (no observation), step with the recorded answer
        inst = Calendar()
        await inst.seed(task)
        assert (await call(inst, RESET)).observation is None
        step = await call(inst, STEP, Action(text="", output=output, turn=1))
        assert step.terminated and step.reward == rec["reward"]
        verdict = await inst.verify(task, response)
        assert isinstance(verdict, Verdict) and verdict.reward == rec["reward"]
        assert verdict.fields["terminated"] is True and verdict.fields["truncated"] is False
        # session-less verification (re-verify) gives the same reward
        fresh = Calendar()
        await fresh.seed(task)
        assert (await fresh.verify(task, response)).reward == rec["reward"]  # type: ignore[union-attr]


async def test_interactive_episode_sends_user_turns_and_stops_early_on_a_bad_calendar() -> None:
    task = {
        "responses_create_params": {"input": [{"role": "system", "content": "sys"}]},
        "user_turns": ["add 0", "add 1", "move 1"],
        "exp_cal_state": EXPECTED,
    }
    inst = Calendar()
    await inst.seed(task)
    assert (await call(inst, RESET)).observation == "add 0"
    first = await call(inst, STEP, Action(text=cal((0, "10:00", 60)), turn=1))
    assert first.observation == "add 1" and not first.terminated
    bad = cal((0, "10:00", 60), (1, "10:30", 30))
    stop = await call(inst, STEP, Action(text=bad, turn=2))
    assert stop.terminated and stop.reward == 0.0 and stop.info == {"grade_reason": "turn 2: conflicting_events"}

    await inst.seed(task)
    await call(inst, RESET)
    for t, text in enumerate([cal((0, "10:00", 60)), cal((0, "10:00", 60), (1, "11:00", 30))], 1):
        assert not (await call(inst, STEP, Action(text=text, turn=t))).terminated
    final = cal((0, "10:00", 60), (1, "14:00", 30))
    done = await call(inst, STEP, Action(text=final, output=[assistant_message(final)], turn=3))
    assert done.terminated and done.reward == 1.0 and done.info == {"grade_reason": "pass"}


def test_module_and_config() -> None:
    assert find_resource_class(calendar_module) is Calendar
    cfg = load_config(ENV_DIR / "config.yaml")
    (agent,) = cfg.agents.values()
    assert agent.agent == "agents.multi_turn" and agent.options["user"] == "env"
    assert cfg.models[agent.model].adapter == "scripted"
