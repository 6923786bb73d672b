"""workplace_assistant against NeMo Gym's differential cases and recorded rollouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.messages import FunctionCall, FunctionCallOutput, Response
from gym_runtime.resource import ToolArgumentsError, replay_calls
from gym_runtime.resources.workplace_assistant import WorkplaceAssistant
from gym_runtime.resources.workplace_assistant.workbench import (
    OPERATIONS,
    READ_ONLY,
    Workbench,
    _initial,
)
from gym_runtime.testing import new_session, read_jsonl, recorded_response, replay_rollouts
from tests.differential import compat_dir, differential_cases

ENV_DIR = Path(__file__).resolve().parents[1]


def call(name: str, **arguments: Any) -> dict[str, str]:
    return {"name": name, "arguments": json.dumps(arguments)}


def calls_response(*calls: dict[str, str]) -> Response:
    return Response(
        id="r",
        created_at=0.0,
        output=[FunctionCall(name=c["name"], arguments=c["arguments"], call_id=f"c{i}") for i, c in enumerate(calls)],
    )


async def reward_for(ground_truth: list[dict[str, str]], *calls: dict[str, str]) -> float:
    inst = await new_session(WorkplaceAssistant)
    for c in calls:
        await inst.call_tool(c["name"], c["arguments"])
    return await inst.verify({"ground_truth": ground_truth}, calls_response(*calls))


async def output(inst: WorkplaceAssistant, tool_name: str, /, **arguments: Any) -> Any:
    return json.loads(await inst.call_tool(tool_name, json.dumps(arguments)))["output"]


async def test_differential_cases_run_live_reproduce_every_tool_output_and_the_reward() -> None:
    cases = differential_cases("workplace_assistant")
    assert len(cases) >= 26
    outputs = 0
    for task, case in cases:
        response = recorded_response(task["response"])
        recorded = {i.call_id: i.output for i in response.output if isinstance(i, FunctionCallOutput)}
        inst = WorkplaceAssistant()
        await inst.seed(task)
        for item in response.output:
            if isinstance(item, FunctionCall):
                ours = await inst.call_tool(item.name, item.arguments)
                assert json.loads(ours) == json.loads(recorded[item.call_id]), (case["case"], item.name)
                outputs += 1
        reward = await inst.verify(task, response)
        assert isinstance(reward, float)
        assert reward == case["expected_reward"], case["case"]
        assert case["expected_fields"] == {}  # NeMo Gym's verify adds no fields
    assert outputs >= 60


async def test_differential_cases_through_the_reverify_replay_path() -> None:
    """What the runtime does for ``reverify = "replay"``: seed, replay the response's calls, verify."""
    assert WorkplaceAssistant.reverify == "replay"
    for task, case in differential_cases("workplace_assistant"):
        inst = WorkplaceAssistant()
        await inst.seed(task)
        response = recorded_response(task["response"])
        await replay_calls(inst, response)
        assert await inst.verify(task, response) == case["expected_reward"], case["case"]


async def test_unseeded_verify_rebuilds_the_state_from_the_response_like_nemo_gym() -> None:
    for task, case in differential_cases("workplace_assistant"):
        assert (
            await WorkplaceAssistant().verify(task, recorded_response(task["response"])) == case["expected_reward"]
        ), case["case"]


async def test_recorded_rollouts_tool_outputs_are_reproduced_byte_for_byte() -> None:
    """NeMo Gym's recorded rollouts (other tasks than example.jsonl): our answers are its answers, as text."""
    rollouts = compat_dir("nemo_gym", "workplace_assistant", "example_rollouts.jsonl")
    assert await replay_rollouts(WorkplaceAssistant, rollouts) >= 6


REPLY = call("email_reply_email", email_id="00000057", body="Thanks for the update - I will get back to you tomorrow.")
EVENT_A = call(
    "calendar_create_event",
    event_name="Design sync",
    participant_email="leila.azizi@atlas.com",
    event_start="2023-12-05 10:00:00",
    duration="30",
)
EVENT_B = call(
    "calendar_create_event",
    event_name="Budget review",
    participant_email="luis.ortiz@atlas.com",
    event_start="2023-12-06 14:00:00",
    duration="60",
)
STATUS = [
    call("customer_relationship_manager_update_customer", customer_id=c, field="status", new_value="Lost")
    for c in ("00000037", "00000195", "00000058")
]


async def test_state_comparison_semantics() -> None:
    assert await reward_for([REPLY], REPLY) == 1.0
    assert await reward_for([], call("email_search_emails", query="carlos")) == 1.0  # reads change nothing
    assert await reward_for([EVENT_A, EVENT_B], EVENT_A, EVENT_B) == 1.0
    assert await reward_for([EVENT_A, EVENT_B], EVENT_B, EVENT_A) == 0.0  # generated ids swap
    assert await reward_for(STATUS, *reversed(STATUS)) == 1.0  # independent updates in any order
    assert await reward_for(STATUS, *STATUS, STATUS[0]) == 1.0  # idempotent duplicate
    assert await reward_for(STATUS, *STATUS[:2]) == 0.0
    lowered = [
        call("customer_relationship_manager_update_customer", customer_id="00000037", field="notes", new_value="LOST")
    ]
    assert (
        await reward_for([{**lowered[0], "arguments": lowered[0]["arguments"].replace("LOST", "lost")}], *lowered)
        == 1.0
    )
    # status, list_name and board compare case-sensitively (and the tools refuse other spellings anyway)
    status_lower = call(
        "customer_relationship_manager_update_customer", customer_id="00000037", field="status", new_value="lost"
    )
    assert await reward_for(STATUS[:1], status_lower) == 0.0


async def test_an_equivalent_send_email_counts_as_the_reply() -> None:
    inst = await new_session(WorkplaceAssistant)
    original = await output(inst, "email_get_email_information_by_id", email_id="00000057", field="sender/recipient")
    subject = await output(inst, "email_get_email_information_by_id", email_id="00000057", field="subject")
    send = call(
        "email_send_email",
        recipient=original["sender/recipient"],
        subject=f"RE: {subject['subject']}",
        body="Thanks for the update - I will get back to you tomorrow.",
    )
    assert await reward_for([REPLY], send) == 1.0


async def test_sessions_are_independent_and_the_seed_state_stays_pristine() -> None:
    pristine = {k: v.copy() for k, v in _initial().items()}
    a, b = await new_session(WorkplaceAssistant), await new_session(WorkplaceAssistant)
    await a.call_tool(*REPLY.values())
    await a.call_tool(
        "calendar_update_event", json.dumps({"event_id": "00000252", "field": "event_name", "new_value": "X"})
    )
    await a.call_tool("analytics_get_average_session_duration", "{}")  # converts a's own column in place
    assert len(a.bench.emails) == 501 and len(b.bench.emails) == 500  # type: ignore[union-attr]
    assert await output(b, "calendar_get_event_information_by_id", event_id="00000252", field="event_name") == {
        "event_name": "brainstorming session"
    }
    for name, frame in _initial().items():
        assert frame.equals(pristine[name]), name


async def test_tool_answers_follow_nemo_gym() -> None:
    inst = await new_session(WorkplaceAssistant)
    assert (
        await output(inst, "email_send_email", recipient="x", subject="s", body="b")
        == "Invalid recipient email address."
    )
    assert await output(inst, "calendar_update_event", event_id="252", field="event_name", new_value="x") == (
        "Invalid event ID format. Expected 8-digit ID."
    )
    assert (
        await output(
            inst,
            "calendar_create_event",
            event_name="E",
            participant_email="A@B.com",
            event_start="2023-12-05 10:00:00",
            duration="30",
        )
        == "00000300"
    )
    assert (
        await output(
            inst,
            "calendar_create_event",
            event_name="E",
            participant_email="a@b.com",
            event_start="not a date",
            duration="30",
        )
        == "Invalid event_start format. Expected YYYY-MM-DD HH:MM:SS."
    )
    assert (
        await output(
            inst,
            "customer_relationship_manager_add_customer",
            customer_name="D",
            assigned_to_email="nadia.moreau@atlas.com",
            status="Lead",
        )
        == "00000200"
    )
    assert await output(inst, "company_directory_find_email_address", name="nadia") == ["nadia.moreau@atlas.com"]
    assert await output(inst, "project_management_search_tasks") == "No search parameters provided."
    assert await output(inst, "send_fax") == "Error executing tool 'send_fax': 'send_fax'"
    assert await output(inst, "email_delete_email", email_id="00000001", force=True) == (
        "Error executing tool 'email_delete_email': EmailTool.delete_email() got an unexpected keyword argument 'force'"
    )
    assert (await output(inst, "company_directory_find_email_address", name="(")).startswith(
        "Error executing tool 'company_directory_find_email_address': missing ), unterminated subpattern"
    )  # the name is a regular expression, as in NeMo Gym
    visitor = await output(inst, "customer_relationship_manager_search_customers", customer_name="Casey Wilson")
    assert visitor["customers"][0]["customer_phone"] is None  # NaN answers as null
    assert (
        await inst.call_tool("email_delete_email", '{"email_id": "00000001"}')
    ) == '{"output":"Email deleted successfully."}'


async def test_nulls_are_dropped_for_reads_and_kept_for_changes() -> None:
    inst = await new_session(WorkplaceAssistant)
    by_default = await output(inst, "email_search_emails", query="kofi")
    assert await output(inst, "email_search_emails", query="kofi", date_min=None, page=None) == by_default
    # A state change sees the arguments as NeMo Gym's verify replays them: notes stays null, not "".
    await inst.call_tool(
        "customer_relationship_manager_add_customer",
        json.dumps(
            {"customer_name": "D", "assigned_to_email": "nadia.moreau@atlas.com", "status": "Lead", "notes": None}
        ),
    )
    assert inst.bench is not None and inst.bench.crm.iloc[-1]["notes"] is None


@pytest.mark.parametrize("arguments", ['{"email_id": "1"', "[1]", '"text"'])
async def test_unreadable_arguments_are_refused_and_change_nothing(arguments: str) -> None:
    inst = await new_session(WorkplaceAssistant)
    with pytest.raises(ToolArgumentsError):
        await inst.call_tool("email_delete_email", arguments)
    assert await inst.verify({"ground_truth": []}, calls_response()) == 1.0


async def test_ground_truth_handling() -> None:
    inst = await new_session(WorkplaceAssistant)
    with pytest.raises(ValueError, match="ground_truth"):
        await inst.verify({}, calls_response())
    # NeMo Gym accepts a string ground truth and replays nothing from it.
    assert (
        await (await new_session(WorkplaceAssistant)).verify({"ground_truth": "email_reply_email"}, calls_response())
        == 1.0
    )
    # Ground-truth calls that fail (bad JSON, unknown tool) are skipped, as NeMo Gym's replay skips them.
    broken = [{"name": "email_reply_email", "arguments": "{"}, {"name": "nope", "arguments": "{}"}, REPLY]
    assert await reward_for(broken, REPLY) == 1.0


def test_every_operation_is_a_tool_and_the_schemas_match_the_dataset() -> None:
    row = read_jsonl(ENV_DIR / "data" / "example.jsonl")[0]
    theirs = {t["name"]: t for t in row["responses_create_params"]["tools"]}
    ours = {t["name"]: t for t in WorkplaceAssistant.tool_definitions()}
    assert set(ours) == set(theirs) == OPERATIONS
    assert READ_ONLY < OPERATIONS
    for name, t in theirs.items():
        assert ours[name]["description"] == t["description"], name
        assert set(ours[name]["parameters"]["properties"]) == set(t["parameters"]["properties"]), name
        assert sorted(ours[name]["parameters"]["required"]) == sorted(t["parameters"]["required"]), name


async def test_tool_methods_can_be_called_directly() -> None:
    inst = WorkplaceAssistant()
    assert await inst.email_send_email("a@b.com", "s", "b") == "Email sent successfully."
    assert isinstance(inst.bench, Workbench) and len(inst.bench.emails) == 501
