"""verl's agent loop (verl 0.9.1, in a venv of its own: it pins transformers<5.11) running gym-runtime rollouts:
``gym_runtime.trainers.verl.GymAgentLoop`` built as verl's ``AgentLoopWorker`` builds it, with real nats-server and
workers, generating through the ``verl_server`` adapter.

What is not run here (no GPU, no Ray cluster): verl's ``AgentLoopWorker`` Ray actor and ``AgentLoopManager``, its
vLLM/SGLang rollout replicas behind ``LLMServerClient``, and its PPO/GRPO trainer. verl's server handle is the one
test double: ``TinyServer``, whose ``generate`` has ``LLMServerClient.generate``'s signature and answers verl's
``TokenOutput`` from the tiny policy (``runtime/rigs/tiny_policy.py``) sampled in process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.trainers.world import TOOL_CALL, need, spans, world

verl = need("verl", "GYM_REQUIRE_VERL")


class TinyServer:
    """verl's ``LLMServerClient`` for the test: token ids in, token ids and logprobs out, from the tiny model."""

    def __init__(self, model: Any, tokenizer: Any, tool: int) -> None:
        from gym_runtime.live_models import LIVE_MODELS
        from gym_runtime.models.transformers import Engine, Options

        LIVE_MODELS.register("tiny-server", model, tokenizer)
        self.engine = Engine(Options(live="tiny-server", max_new_tokens=4, stop_token_ids=[tool]))
        self.requests: list[dict[str, Any]] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any
    ) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        self.requests.append({"prompt_ids": prompt_ids, "sampling_params": sampling_params})
        sp = {k: v for k, v in sampling_params.items() if k in ("temperature", "top_p", "top_k", "max_tokens")}
        async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, sp, request_id):
            last = out
        done = last.outputs[0]
        lps = [next(iter(step.values())).logprob for step in done.logprobs]
        return TokenOutput(token_ids=done.token_ids, log_probs=lps, stop_reason="completed")


def served_by_verl(w: Any) -> TinyServer:
    """The world's policy entry as verl's: the ``verl_server`` adapter, generating through verl's server handle."""
    cfg = yaml.safe_load(w.config.read_text())
    tool = w.tool_token
    cfg["models"]["policy"] = {
        "adapter": "verl_server",
        "live": "policy",
        "max_new_tokens": 4,
        "stop_token_ids": [tool],
    }
    w.config.write_text(yaml.safe_dump(cfg))
    return TinyServer(w.model, w.tokenizer, tool)


def agent_loop(w: Any, server: TinyServer, **options: Any) -> Any:
    """A ``GymAgentLoop`` as verl's worker builds one per sample (``hydra.utils.instantiate(config, ...)``)."""
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from gym_runtime.trainers.verl import GymAgentLoop

    trainer_config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"response_length": 64}}})
    return GymAgentLoop(
        trainer_config=DictConfigWrap(trainer_config),
        server_manager=server,
        tokenizer=w.tokenizer,
        processor=None,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(OmegaConf.create({})),
        gym_config=str(w.config),
        **options,
    )


async def test_the_gym_runtime_agent_loop_gives_verl_its_output(tmp_path: Path) -> None:
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    import gym_runtime.trainers.verl  # noqa: F401  (importing it registers the loop)

    assert _agent_loop_registry["gym_runtime"] == {"_target_": "gym_runtime.trainers.verl.GymAgentLoop"}
    w = world(tmp_path, rows=4, tool_bias=3.0)
    server = served_by_verl(w)
    outputs, rows = [], []
    written = tmp_path / "train_rows.jsonl"  # rows_path: what the loops handed verl
    for k, r in enumerate(w.rows):
        loop = agent_loop(w, server, rows_path=str(written))
        # verl's worker passes each sample's non-tensor fields: its ``uid`` names the prompt's group of n
        outputs.append(await loop.run({"temperature": 1.0}, extra_info={"gym_row": r}, uid=f"prompt-{k // 2}"))
        rows.append(loop.last_row)
    assert server.requests  # generation went through verl's server handle
    multi_turn = 0
    for out, row in zip(outputs, rows, strict=True):
        assert "error_class" not in row
        assert out.response_mask == spans(row)  # 0 on the tool and template tokens
        assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs)
        assert out.reward_score == row["reward"] and row["word"] in {x["word"] for x in w.rows}
        tensors = out.as_dict()  # what verl's worker stacks into its batch
        assert tensors["responses"].shape == tensors["response_mask"].shape
        multi_turn += 0 in out.response_mask
    assert multi_turn > 0
    assert TOOL_CALL in w.tokenizer.get_vocab()
    train = [json.loads(line) for line in written.read_text().splitlines()]
    assert [t["train_group"] for t in train] == ["prompt-0", "prompt-0", "prompt-1", "prompt-1"]
    assert [t["train_reward"] for t in train] == [out.reward_score for out in outputs]
    from gym_runtime.data.sampling import task_key

    for out, r, row in zip(outputs, w.rows, rows, strict=True):  # what the task sampler counts (verl_tasks)
        assert out.extra_fields["gym_task"] == task_key(r)
        assert out.extra_fields["gym_outcome"]["reward"] == row["reward"]
    for t in train:  # no advantage (verl computes it in the driver); the step: the row's policy version, if any
        assert t["train_advantage"] is None
        assert t["train_step"] == (max(t["policy_versions"]) if t.get("policy_versions") else None)


async def test_an_excluded_member_never_enters_verls_group_statistics(tmp_path: Path) -> None:
    """Issue 66: a failure the environment caused is retried, then excluded: one token with ``response_mask`` 0,
    which the registered ``gym_grpo`` estimator leaves out of the group's mean and std (advantage 0). verl's own GRPO
    would take its reward 0 into them (the pad this loop returned before)."""
    import numpy as np
    import torch
    from verl.trainer.ppo import core_algos

    from gym_runtime.errors import ClientError
    from gym_runtime.trainers.verl import check_bound, failure_metrics

    w = world(tmp_path, rows=3)
    w.rows[0]["fixed_reward"] = 1.0
    w.rows[1]["fixed_reward"] = 0.0
    w.rows[2]["explode"] = True  # every verify raises: retried once, then excluded
    server = served_by_verl(w)
    outputs = []
    for r in w.rows:
        loop = agent_loop(w, server, failures={"retries": 1})
        outputs.append(await loop.run({"temperature": 1.0}, extra_info={"gym_row": r}))
    excluded = outputs[2]
    assert excluded.response_mask == [0] and excluded.extra_fields["gym_failure"] == "excluded"
    assert (
        excluded.extra_fields["gym_failure_attribution"] == "environment" and excluded.extra_fields["gym_retried"] == 1
    )
    width = max(len(o.response_ids) for o in outputs)
    mask = torch.zeros(3, width)
    rewards = torch.zeros(3, width)
    for i, o in enumerate(outputs):  # as verl's batch holds them: the score on the last response token
        mask[i, : len(o.response_mask)] = torch.tensor(o.response_mask, dtype=torch.float32)
        rewards[i, len(o.response_ids) - 1] = o.reward_score
    uid = np.array(["g", "g", "g"], dtype=object)
    gym_grpo = core_algos.get_adv_estimator_fn("gym_grpo")
    adv, _ = gym_grpo(token_level_rewards=rewards, response_mask=mask, index=uid, config=None)
    assert torch.all(adv[2] == 0)  # the excluded member: advantage 0
    kept, _ = core_algos.compute_grpo_outcome_advantage(rewards[:2], mask[:2], uid[:2])  # verl's GRPO on the others
    assert torch.allclose(adv[:2], kept, atol=1e-4)  # the group's statistics are the others' alone
    padded, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, uid)  # a reward-0 member in them
    assert not torch.allclose(padded[0], kept[0], atol=1e-4)
    batch = {k: [o.extra_fields[k] for o in outputs] for k in outputs[0].extra_fields if k.startswith("gym_")}
    metrics = failure_metrics(batch)
    with pytest.raises(ClientError) as bound:  # 1 of 3 excluded, past max_excluded 0.25: one line, the step stops
        check_bound(batch)
    said = str(bound.value)
    assert "\n" not in said and "1 of 3 rollouts" in said and "verify_error 2" in said and "(verify_error)" in said
    check_bound({**batch, "gym_max_excluded": [0.5] * 3})  # within a looser bound
    assert metrics["gym_runtime/excluded"] == 1.0 and metrics["gym_runtime/retried"] == 1.0
    assert metrics["gym_runtime/failed/environment"] == 2.0  # both attempts of the excluded one
    assert metrics["gym_runtime/failed/verify_error"] == 2.0 and metrics["gym_runtime/rollouts"] == 3.0


async def test_the_failure_counts_reach_verls_validation_metrics(tmp_path: Path) -> None:
    """Issue 66: each sample's counts are verl's ``reward_extra_info`` (numbers, the same keys on every sample, as
    verl's worker stacks them), which verl 0.9.1's trainers turn into logged validation metrics with
    ``process_validation_metrics``: a step's share of excluded, retried and scored policy failures."""
    from verl.trainer.ppo.metric_utils import process_validation_metrics

    w = world(tmp_path, rows=2)
    w.rows[0]["fixed_reward"] = 1.0
    w.rows[1]["explode"] = True  # retried once, then excluded
    server = served_by_verl(w)
    outputs = []
    for r in w.rows:
        loop = agent_loop(w, server, failures={"retries": 1})
        outputs.append(await loop.run({"temperature": 1.0}, extra_info={"gym_row": r}))
    infos = [o.extra_fields["reward_extra_info"] for o in outputs]
    assert [sorted(i) for i in infos] == [sorted(infos[0])] * 2  # one key set: verl takes the first sample's
    columns = {key: [i[key] for i in infos] for key in infos[0]}
    logged = process_validation_metrics(["gym", "gym"], ["a", "b"], columns)["gym"]
    assert logged["gym_runtime/excluded"]["mean@1"] == 0.5  # one of the two samples
    assert logged["gym_runtime/retried"]["mean@1"] == 0.5
    assert logged["gym_runtime/failed/environment"]["mean@1"] == 1.0  # two attempts over two samples
    assert logged["gym_runtime/policy_failures"]["mean@1"] == 0.0


async def test_a_stalling_policy_is_scored_in_verl_like_a_wrong_answer(tmp_path: Path) -> None:
    """Issue 66's red team under verl: a policy that stalls on its hard task (its tool call runs the rollout's
    ``timeout_s`` out) is a policy failure, scored ``policy_failure_reward`` on the tokens it generated (mask 1),
    so ``gym_grpo`` takes it into its group's statistics like an honest wrong answer: the stall buys nothing."""
    import numpy as np
    import torch
    from verl.trainer.ppo import core_algos

    w = world(tmp_path, rows=2, tool_bias=20.0, timeout_s=4.0)
    w.rows[0]["fixed_reward"] = 1.0
    w.rows[1].update(fixed_reward=0.0, stall_s=600.0)  # the hard task: its tool never answers in time
    server = served_by_verl(w)
    outputs, rows = [], []
    for r in w.rows:
        loop = agent_loop(w, server)
        outputs.append(await loop.run({"temperature": 1.0}, extra_info={"gym_row": r}))
        rows.append(loop.last_row)
    stalled = outputs[1]
    assert rows[1]["error_class"] == "timeout" and rows[1]["failure_attribution"] == "policy", rows[1]
    assert stalled.extra_fields["gym_failure"] == "policy" and stalled.reward_score == 0.0
    generated = [t for item in rows[1]["response"]["output"] for t in item.get("generation_token_ids", [])]
    assert generated and stalled.response_ids == generated  # the tokens it generated (the tool call), trained on
    assert set(stalled.response_mask) == {1}
    assert stalled.extra_fields["reward_extra_info"]["gym_runtime/policy_failures"] == 1.0
    width = max(len(o.response_ids) for o in outputs)
    mask, rewards = torch.zeros(2, width), torch.zeros(2, width)
    for i, o in enumerate(outputs):
        mask[i, : len(o.response_mask)] = torch.tensor(o.response_mask, dtype=torch.float32)
        rewards[i, len(o.response_ids) - 1] = o.reward_score
    gym_grpo = core_algos.get_adv_estimator_fn("gym_grpo")
    adv, _ = gym_grpo(token_level_rewards=rewards, response_mask=mask, index=np.array(["g", "g"], dtype=object))
    honest, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, np.array(["g", "g"], dtype=object))
    assert torch.allclose(adv, honest, atol=1e-4)  # as verl's GRPO scores an honest 0 beside a 1
    assert adv[1][mask[1] > 0].max() < 0  # the stall's own tokens pushed down


def _sampled_data(tmp_path: Path, train: str, sampler: dict[str, Any]) -> dict[str, Any]:
    """verl's ``data`` config for ``GymTaskDataset`` over ``train`` with ``gym_sampler`` set to ``sampler``."""
    return {
        "train_files": [train],
        "train_batch_size": 4,
        "dataloader_num_workers": 0,
        "shuffle": True,
        "seed": 1,
        "cache_dir": str(tmp_path / "cache"),
        "filter_overlong_prompts": False,
        "custom_cls": {"path": "pkg://gym_runtime.trainers.verl_tasks", "name": "GymTaskDataset"},
        "gym_sampler": sampler,
    }


def _verl_data(tmp_path: Path, rows: list[dict[str, Any]], name: str) -> str:
    """A parquet file as verl reads one: the prompt's messages, the task row in ``extra_info.gym_row``."""
    import datasets

    data = [
        {
            "data_source": "gym",
            "prompt": [{"role": "user", "content": f"say the word {r['word']} ({r['kind']})"}],
            "extra_info": {"index": i, "gym_row": json.dumps(r)},
        }
        for i, r in enumerate(rows)
    ]
    path = str(tmp_path / name)
    datasets.Dataset.from_list(data).to_parquet(path)
    return path


def test_verls_dataloader_follows_the_task_sampler_and_each_prompt_is_its_rows(tmp_path: Path) -> None:
    """Issue 79: verl 0.9.1 takes no sampler class from its config, but both trainers take the dataset's
    (``data.custom_cls``). ``GymTaskDataset`` in verl's own dataloader, built as its trainers build it
    (``create_rl_dataset``, ``create_rl_sampler``, ``StatefulDataLoader``, ``collate_fn``): the batches follow the
    sampler, each sample's prompt is its own row's, the outcomes counted through ``observe_batch`` (as the agent loop
    manager and the v1 replay buffer call it) move the picks to the learnable third, and its metrics come back. The
    validation set is read as verl's; worker processes are one line."""
    from omegaconf import OmegaConf
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler
    from verl.utils.dataset.rl_dataset import collate_fn

    from gym_runtime.data.sampling import task_key
    from gym_runtime.errors import ClientError
    from gym_runtime.trainers import verl_tasks

    w = world(tmp_path, rows=1)
    kinds = ["solved", "impossible", "learnable"]
    rows = [{"word": f"w{i}", "kind": kinds[i % 3]} for i in range(12)]
    train, val = _verl_data(tmp_path, rows, "train.parquet"), _verl_data(tmp_path, rows[:3], "val.parquet")
    config = OmegaConf.create(
        {**_sampled_data(tmp_path, train, {"score": "learnability", "floor": 0.0}), "val_files": [val]}
    )
    dataset = create_rl_dataset(config.train_files, config, w.tokenizer, None)
    assert isinstance(dataset, verl_tasks.GymTaskDataset) and verl_tasks.active() is dataset.sampler
    loader = StatefulDataLoader(
        dataset=dataset,
        batch_size=4,
        num_workers=0,
        drop_last=True,
        collate_fn=collate_fn,
        sampler=create_rl_sampler(config, dataset),
    )
    picked: list[str] = []
    reward = {"solved": lambda k: 1.0, "impossible": lambda k: 0.0, "learnable": lambda k: float(k % 2)}
    metrics: dict[str, float] = {}
    for _ in range(5):  # verl's dataloader runs out after an epoch: 3 batches of 4 each time
        for batch in loader:
            fields: dict[str, list[Any]] = {"gym_task": [], "gym_outcome": []}
            for info, prompt in zip(batch["extra_info"], batch["raw_prompt"], strict=True):
                row = json.loads(info["gym_row"])
                assert prompt[0]["content"] == f"say the word {row['word']} ({row['kind']})"  # its own prompt
                picked.append(row["kind"])
                for k in range(4):  # the sample's n rollouts, as the agent loops return them
                    fields["gym_task"].append(task_key(row))
                    fields["gym_outcome"].append({"reward": reward[row["kind"]](k)})
            assert len({json.dumps(i["gym_row"]) for i in batch["extra_info"]}) == 4  # distinct tasks in a batch
            metrics = verl_tasks.observe_batch(fields)
    assert len(picked) == 60
    late = picked[24:]
    assert late.count("learnable") / len(late) > 0.6, picked  # uniform: a third
    assert metrics["gym_runtime/sampler/groups"] == 4 and "gym_runtime/sampler/zero_spread_share" in metrics
    validation = create_rl_dataset(config.val_files, config, w.tokenizer, None)
    assert validation.sampler is None and json.loads(validation[2]["extra_info"]["gym_row"]) == rows[2]
    assert verl_tasks.active() is dataset.sampler
    with pytest.raises(ClientError, match="dataloader_num_workers: 8"):
        create_rl_dataset(config.train_files, OmegaConf.merge(config, {"dataloader_num_workers": 8}), w.tokenizer, None)


def _dead_set(tmp_path: Path, **knobs: Any) -> tuple[Any, Any]:
    """12 rows, half always solved and half never, in ``GymTaskDataset`` with ``skip_below`` and verl's dataloader
    as its trainers build it (``create_rl_dataset``, ``create_rl_sampler``, ``StatefulDataLoader``)."""
    from omegaconf import OmegaConf
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler
    from verl.utils.dataset.rl_dataset import collate_fn

    tmp_path.mkdir()
    w = world(tmp_path, rows=1)
    rows = [{"word": f"w{i}", "kind": ("solved", "impossible")[i % 2]} for i in range(12)]
    sampler = {"score": "learnability", "floor": 0.1, "skip_below": 0.08, "run": "verl7", **knobs}
    config = OmegaConf.create(_sampled_data(tmp_path, _verl_data(tmp_path, rows, "train.parquet"), sampler))
    dataset = create_rl_dataset(config.train_files, config, w.tokenizer, None)
    loader = StatefulDataLoader(
        dataset, batch_size=4, num_workers=0, drop_last=True, collate_fn=collate_fn,
        sampler=create_rl_sampler(config, dataset),
    )  # fmt: skip
    return dataset, loader


def _legacy_fit(loader: Any, epochs: int) -> list[int]:
    """verl's legacy trainer's loop (``RayPPOTrainer.fit``: ``for epoch ...: for batch_dict in train_dataloader``),
    each batch's outcomes counted as its agent loop manager counts them; the batches each epoch took."""
    from gym_runtime.data.sampling import task_key
    from gym_runtime.trainers import verl_tasks

    taken = []
    for _ in range(epochs):
        taken.append(0)
        for batch in loader:
            taken[-1] += 1
            fields: dict[str, list[Any]] = {"gym_task": [], "gym_outcome": []}
            for info in batch["extra_info"]:
                row = json.loads(info["gym_row"])
                for _ in range(4):  # the prompt's n = 4 rollouts
                    fields["gym_task"].append(task_key(row))
                    fields["gym_outcome"].append({"reward": 1.0 if row["kind"] == "solved" else 0.0})
            verl_tasks.observe_batch(fields)
    return taken


def test_verls_run_ends_when_no_task_can_teach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 79: with ``skip_below``, once every task was solved or failed every time lately, ``GymTaskDataset``
    ends verl's dataloader before the next batch is generated: the legacy trainer's epoch ends there and each later
    one at once, so its ``fit`` returns (one ``trainer.stopped`` line naming the run) rather than generating its 20
    epochs of groups with no advantage. ``stop_when_exhausted: false`` goes on at the floor's exploration."""
    from gym_runtime.errors import ClientError
    from gym_runtime.trainers import verl_tasks

    monkeypatch.setattr(
        verl_tasks, "_BY_STEPS", [], raising=False
    )  # no v1 replay buffer in this process: the legacy trainer
    dataset, loader = _dead_set(tmp_path / "stops")
    taken = _legacy_fit(loader, epochs=20)
    assert dataset.sampler.exhausted
    assert 0 < sum(taken) < 30 and taken[-10:] == [0] * 10, taken  # without the stop: 3 batches every epoch
    out, err = capfd.readouterr()  # structlog's own lines, or stdlib logging's once a client configured it
    stopped = [line for line in (caplog.text + out + err).splitlines() if "trainer.stopped" in line]
    assert len(stopped) == 1 and "verl7" in stopped[0], stopped
    _, loader = _dead_set(tmp_path / "goes_on", stop_when_exhausted=False)
    assert _legacy_fit(loader, epochs=20) == [3] * 20
    with pytest.raises(ClientError, match="stop_when_exhausted: 'no'"):
        _dead_set(tmp_path / "bad", stop_when_exhausted="no")


async def test_a_loop_with_no_model_worker_fails_verls_step_at_its_bound_naming_it(tmp_path: Path) -> None:
    from gym_runtime.errors import ClientError

    w = world(tmp_path, rows=1)
    server = served_by_verl(w)
    # the agents and the environment run in the actor; nothing serves the policy (issue 77 item 3)
    loop = agent_loop(w, server, workers=["agents.agent", "resources.env"], waits={"say_after_s": 2, "bound_s": 8})
    with pytest.raises(ClientError) as e:
        await loop.run({"temperature": 1.0}, extra_info={"gym_row": w.rows[0]})
    text = str(e.value)
    assert "look at models.policy" in text and "gave up at WaitPolicy(bound_s=8)" in text and "\n" not in text, text
    assert not server.requests
