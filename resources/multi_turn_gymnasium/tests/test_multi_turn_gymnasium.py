"""multi_turn_gymnasium against NeMo Gym's recorded example_multi_turn_gymnasium rollouts (no NATS here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

import gym_runtime.resources.multi_turn_gymnasium as multi_turn_gymnasium
from gym_runtime.config import load_config
from gym_runtime.gymnasium import RESET, STEP, Action, Reset, Step
from gym_runtime.messages import Message, Response, assistant_message, output_text, parse_items
from gym_runtime.resource import Verdict, find_resource_class
from gym_runtime.resources.multi_turn_gymnasium import (
    MultiTurnGymnasium,
    last_turn,
)
from tests.differential import COMPAT, compat_dir, example_rollouts, read_jsonl

ENV_DIR = Path(__file__).resolve().parents[1]
NEMO = COMPAT / "nemo_gym" / "example_multi_turn_gymnasium"


def turns(output: list[Any]) -> list[list[Any]]:
    """Split a trajectory into its policy turns (at user messages)."""
    out: list[list[Any]] = [[]]
    for item in output:
        if isinstance(item, Message) and item.role == "user":
            out.append([])
        else:
            out[-1].append(item)
    return out


def test_data_is_nemo_gyms() -> None:
    assert read_jsonl(ENV_DIR / "data/example.jsonl") == read_jsonl(compat_dir(NEMO / "example.jsonl"))


async def test_episode_replays_follow_ups_and_reproduces_recorded_rewards() -> None:
    for task, rec in example_rollouts(ENV_DIR, NEMO):
        output = parse_items(rec["response"]["output"])
        recorded_users = [i.content for i in output if isinstance(i, Message) and i.role == "user"]
        inst = MultiTurnGymnasium()
        await inst.seed(task)
        reset = msgspec.json.decode(await inst.call_operation(RESET, "{}"), type=Reset)
        assert reset.observation is None
        observations, total = [], 0.0
        for n, items in enumerate(turns(output), 1):
            action = Action(text=output_text(items), output=items, turn=n)
            step = msgspec.json.decode(await inst.call_operation(STEP, msgspec.json.encode(action)), type=Step)
            total += step.reward
            if step.terminated:
                assert n == len(task["follow_ups"]) + 1
                break
            observations.append(step.observation)
        assert observations == recorded_users == task["follow_ups"]
        assert total == rec["reward"]
        verdict = await inst.verify(task, Response(id="r", created_at=0.0, output=output))
        assert isinstance(verdict, Verdict)
        assert (verdict.reward, verdict.fields) == (
            rec["reward"],
            {k: rec[k] for k in ("terminated", "truncated", "info")},
        )


async def test_verify_without_an_episode_scores_the_last_turn() -> None:
    for task, rec in example_rollouts(ENV_DIR, NEMO):
        inst = MultiTurnGymnasium()
        await inst.seed(task)
        verdict = await inst.verify(
            task, Response(id="r", created_at=0.0, output=parse_items(rec["response"]["output"]))
        )
        assert verdict.reward == rec["reward"]  # type: ignore[union-attr]


async def test_expected_answer_is_case_insensitive_and_only_in_the_final_turn() -> None:
    task = {"verifier_metadata": {"follow_ups": ["and?"], "expected_answer": "Eiffel"}}
    inst = MultiTurnGymnasium()
    await inst.seed(task)
    await inst.call_operation(RESET, "{}")
    first = Action(text="the eiffel tower", output=[assistant_message("the eiffel tower")], turn=1)
    step = msgspec.json.decode(await inst.call_operation(STEP, msgspec.json.encode(first)), type=Step)
    assert step.observation == "and?" and step.reward == 0.0  # the answer counts only after the follow-ups
    final = Action(text="no idea", output=[assistant_message("no idea")], turn=2)
    step = msgspec.json.decode(await inst.call_operation(STEP, msgspec.json.encode(final)), type=Step)
    assert step.terminated and step.reward == 0.0
    assert last_turn([assistant_message("a"), Message(role="user", content="q"), assistant_message("EIFFEL")])[
        0
    ].content


def test_module_and_config() -> None:
    assert find_resource_class(multi_turn_gymnasium) is MultiTurnGymnasium
    cfg = load_config(ENV_DIR / "config.yaml")
    assert list(cfg.agents) == ["example_multi_turn_gymnasium_agent"]  # the data's agent_ref
    agent = cfg.agents["example_multi_turn_gymnasium_agent"]
    assert agent.agent == "agents.multi_turn" and agent.options == {"user": "env", "max_turns": 5}
