"""verl trains on a branch point's rows as one group (issue 78, item 4): ``GymAgentLoop(branch_at=k)`` run by verl
0.9.1's own ``AgentLoopWorker(config, llm_client)`` in this process (its ``generate_sequences`` is a coroutine; the
Ray actors are ``tests/on_ray``'s), over a step's batch made as verl's legacy trainer makes it (a ``uid`` per prompt,
then ``repeat(n, interleave=True)``), the loop registered from a YAML file with verl's generated PPO config, real
nats-server and workers, the say-word environment (its ``snapshot``/``restore`` keep the draw) and the tiny policy
behind verl's server handle (the one double: ``TinyServer``). verl's ``compute_advantage`` then runs ``gym_grpo``
on the batch, as its trainer does.

With ``branch_at: 1`` each prompt's ``n`` samples are one rollout (its checkpoints kept) and ``n - 1`` branches of
it after turn 1 (the draw): every member's prompt ids are that prefix, its response only what it generated after
it. Without the option nothing of this appears.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.on_ray.verl_double import verl_config
from tests.trainers.test_verl_loop import served_by_verl
from tests.trainers.world import need, world

verl = need("verl", "GYM_REQUIRE_VERL")


@pytest.fixture(autouse=True)
def registry() -> Iterator[None]:
    """verl's worker writes the YAML's entry into verl's global registry: the other verl tests expect it as it was."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    import gym_runtime.trainers.verl  # noqa: F401  (registers the loop first, as the trainer's process does)

    before = _agent_loop_registry.get("gym_runtime")
    yield
    if before is not None:
        _agent_loop_registry["gym_runtime"] = before


def verl_worker(w: Any, tmp_path: Path, **options: Any) -> Any:
    """verl's ``AgentLoopWorker`` as its manager builds one (its config, the server handle), in this process."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    server = served_by_verl(w)
    model_dir = tmp_path / "policy"  # verl's worker loads the tokenizer from model.path
    w.model.save_pretrained(model_dir)
    w.tokenizer.save_pretrained(model_dir)
    loops = tmp_path / "agent_loops.yaml"
    entry = {"name": "gym_runtime", "_target_": "gym_runtime.trainers.verl.GymAgentLoop", "gym_config": str(w.config)}
    loops.write_text(yaml.safe_dump([{**entry, "rows_path": str(tmp_path / "rows.jsonl"), **options}]))
    return AgentLoopWorker(verl_config(tmp_path, model_dir, loops), server)


def step(rows: list[dict[str, Any]], n: int) -> Any:
    """A step's generation batch as verl's legacy trainer makes it: a uid per prompt, then each prompt n times."""
    import numpy as np
    from verl import DataProto

    def column(values: list[Any]) -> Any:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    prompts = DataProto(
        batch=None,
        non_tensor_batch={
            "agent_name": column(["gym_runtime"] * len(rows)),
            "extra_info": column([{"gym_row": r, "index": i} for i, r in enumerate(rows)]),
            "raw_prompt": column([r["responses_create_params"]["input"] for r in rows]),
            "index": np.arange(len(rows)),
            "uid": column([f"prompt-{i}" for i in range(len(rows))]),
        },
        meta_info={},
    )
    return prompts.repeat(repeat_times=n, interleave=True)


def unpadded(out: Any, i: int) -> tuple[list[int], list[int], list[int]]:
    """Sample ``i`` of verl's batch without its padding: prompt ids, response ids, response mask."""
    width = out.batch["prompts"].shape[1]
    attention = out.batch["attention_mask"][i].tolist()
    prompt = [t for t, a in zip(out.batch["prompts"][i].tolist(), attention[:width], strict=True) if a]
    kept = sum(attention[width:])
    return prompt, out.batch["responses"][i].tolist()[:kept], out.batch["response_mask"][i].tolist()[:kept]


def written(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]


async def test_a_prompts_samples_are_one_rollout_and_its_branches_and_gym_grpo_compares_them(tmp_path: Path) -> None:
    import torch
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from gym_runtime.trainers.rows import branched, sequence
    from gym_runtime.trainers.verl import GymAgentLoopManager
    from gym_runtime.trainers.verl_branch import BRANCH_GROUPS

    n = 3
    w = world(tmp_path, rows=2, tool_bias=20.0)  # the policy draws first: turn 1 makes the call
    worker = verl_worker(w, tmp_path, branch_at=1, failures={"retries": 0})
    out = await worker.generate_sequences(step(w.rows, n))
    metrics = out.meta_info.pop("metrics")
    assert len(out) == 2 * n and len(BRANCH_GROUPS) == 0  # every group forgotten once its members left
    rows = written(tmp_path)
    by_uid: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_uid.setdefault(r["train_group"], []).append(r)
    fields = out.non_tensor_batch
    for g, uid in enumerate(["prompt-0", "prompt-1"]):
        members = range(g * n, (g + 1) * n)
        assert [fields["uid"][i] for i in members] == [uid] * n
        (parent,) = [r for r in by_uid[uid] if "branch_of" not in r]
        kids = [r for r in by_uid[uid] if "branch_of" in r]
        assert len(kids) == n - 1 and "error_class" not in parent, by_uid[uid]
        point = fields["gym_branch_of"][g * n + 1]
        assert fields["gym_branch_of"][g * n] is None  # the first sample of the uid is the parent
        assert [fields["gym_branch_of"][i] for i in members][1:] == [point] * (n - 1)
        for kid in kids:
            assert kid["branch_of"] == point and kid["branch_turn"] == 1, kid
            assert kid["tool_calls"] >= 1.0  # the parent's draw, restored in its own session
            assert kid["response"]["output"][:2] == parent["response"]["output"][:2]  # turn 1, its token ids too
        prefix = branched(parent, 1).prompt_ids
        assert len(prefix) > len(sequence(parent).prompt_ids) and w.tool_token in prefix  # the draw is the prompt's
        left = [parent, *kids]
        for i in members:
            prompt, response, mask = unpadded(out, i)
            assert prompt == prefix  # one prefix, the prompt side: never trained
            # each sample is one of the group's rows, its ids contiguous: the prefix, then what it generated after
            row = next(r for r in left if sequence(r).prompt_ids + sequence(r).completion_ids == prompt + response)
            left.remove(row)  # two members may have generated the same ids: each row is matched once
            assert response == branched(row, 1).completion_ids and mask == branched(row, 1).env_mask
            assert out.batch["rm_scores"][i].sum().item() == row["reward"]
        assert not left
    # verl's advantage step, as its trainer runs it: gym_grpo by uid, each group's statistics its own members'
    out.batch["token_level_rewards"] = out.batch["rm_scores"]
    done = compute_advantage(out, adv_estimator="gym_grpo", config=None)
    for g in range(2):
        part = slice(g * n, (g + 1) * n)
        alone, _ = core_algos.compute_grpo_outcome_advantage(
            out.batch["rm_scores"][part], out.batch["response_mask"][part], fields["uid"][part]
        )
        assert torch.allclose(done.batch["advantages"][part], alone, atol=1e-4)
    timing = GymAgentLoopManager._performance_metrics(object.__new__(GymAgentLoopManager), [metrics], out)
    assert timing["gym_runtime/rollouts"] == 2 * n  # the legacy manager's figures of the batch


async def test_without_branch_at_each_sample_is_its_own_rollout_as_before(tmp_path: Path) -> None:
    from gym_runtime.trainers.rows import sequence

    w = world(tmp_path, rows=2, tool_bias=20.0)
    worker = verl_worker(w, tmp_path, failures={"retries": 0})
    out = await worker.generate_sequences(step(w.rows, 2))
    assert not [k for k in out.non_tensor_batch if k.startswith("gym_branch")]
    rows = written(tmp_path)
    assert len(rows) == 4 and not [r for r in rows if "branch_of" in r or "branch_turn" in r]
    for i in range(4):
        prompt, response, mask = unpadded(out, i)
        row = next(r for r in rows if sequence(r).prompt_ids + sequence(r).completion_ids == prompt + response)
        assert prompt == sequence(row).prompt_ids  # the task's prompt: the whole rollout is the response
        assert mask == sequence(row).env_mask


async def test_a_step_that_would_split_a_prompts_samples_between_workers_stops_at_the_start(tmp_path: Path) -> None:
    """verl's legacy manager splits a step's repeated batch into one equal chunk per worker: 3 prompts of 2 samples
    over 2 workers puts prompt 1's samples in both, each worker's first sample of it a parent (run here one chunk
    after the other, as two actors run them apart): two trees under one uid. ``GymAgentLoopManager`` refuses such a
    config when it is built, in one line; a batch size that splits evenly, or no ``branch_at``, is left alone."""
    from verl import DataProto

    from gym_runtime.errors import ClientError
    from gym_runtime.trainers.verl import GymAgentLoopManager

    w = world(tmp_path, rows=3, tool_bias=20.0)
    worker = verl_worker(w, tmp_path, branch_at=1, failures={"retries": 0})
    chunks = step(w.rows, 2).chunk(2)  # as AgentLoopManager.generate_sequences chunks it
    out = DataProto.concat([await worker.generate_sequences(c) for c in chunks])
    assert out.non_tensor_batch["uid"][2] == out.non_tensor_batch["uid"][3] == "prompt-1"
    assert out.non_tensor_batch["gym_branch_of"][2] is None and out.non_tensor_batch["gym_branch_of"][3] is None
    config = worker.config
    config.data.train_batch_size, config.actor_rollout_ref.rollout.agent.num_workers = 3, 2
    with pytest.raises(ClientError) as e:
        GymAgentLoopManager(config, None)
    said = str(e.value)
    assert "\n" not in said and "data.train_batch_size 3" in said and "num_workers 2" in said, said
    config.data.train_batch_size = 4
    GymAgentLoopManager(config, None)
    loops = Path(config.actor_rollout_ref.rollout.agent.agent_loop_config_path)
    loops.write_text(
        yaml.safe_dump([{k: v for k, v in e.items() if k != "branch_at"} for e in yaml.safe_load(loops.read_text())])
    )
    config.data.train_batch_size = 3
    GymAgentLoopManager(config, None)  # without branch_at: as before


async def test_a_prefix_longer_than_verls_prompt_length_is_one_line_naming_it(tmp_path: Path) -> None:
    """verl pads every prompt to ``rollout.prompt_length`` and cannot stack a longer one: a group whose prefix (the
    task's prompt and turn 1) does not fit fails the step in one line naming the key, rather than being cut."""
    from gym_runtime.errors import ClientError
    from tests.trainers.test_verl_loop import agent_loop

    w = world(tmp_path, rows=1, tool_bias=20.0)
    loop = agent_loop(w, served_by_verl(w), branch_at=1, failures={"retries": 0})
    loop.rollout_config.prompt_length = 8
    with pytest.raises(ClientError) as e:
        await loop.run({"temperature": 1.0}, extra_info={"gym_row": w.rows[0]}, uid="prompt-0")
    said = str(e.value)
    assert "\n" not in said and "actor_rollout_ref.rollout.prompt_length=8" in said and "uid prompt-0" in said, said
