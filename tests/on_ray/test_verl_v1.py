"""verl 0.9.1's default v1 trainer (``trainer.use_v1: true``) with gym-runtime's agent loop: ``GymAgentLoop`` in
verl's own ``AgentLoopWorkerTQ`` Ray actor, its outputs in a real TransferQueue (controller and storage unit as Ray
actors of a local cluster), and the replay buffer a v1 trainer builds from its config
(``PPOTrainer._build_replay_buffer`` with ``trainer.v1.sampler.custom_sampler`` naming
``gym_runtime.trainers.verl_v1.GymReplayBuffer``) sampling a step's batch, its metrics reduced by the step's own
``MetricsAggregator``: what the trainer logs. Issue 66: every failure count reaches a v1 step's logged metrics.

The policy is the tiny-policy double (``verl_double.SavedTinyServer``), as in ``test_verl_actors.py``. Not run here
(no GPU): verl's rollout replicas, the actor and critic workers, and the rest of ``PPOTrainer.step``."""

from __future__ import annotations

import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.helpers import REPO
from tests.on_ray.cluster import local_cluster, need_ray
from tests.on_ray.verl_double import SavedTinyServer, served_in_actors, verl_config
from tests.trainers.world import need, world

ray = need_ray()
verl = need("verl", "GYM_REQUIRE_VERL")
tq = need("transfer_queue", "GYM_REQUIRE_VERL")

# the sampler class per v1 trainer mode (docs/trainer.md names GymReplayBufferAsync for the async ones)
SAMPLERS = {"sync": "GymReplayBuffer", "colocate_async": "GymReplayBufferAsync"}


def documented_sampler() -> dict[str, Any]:
    """docs/trainer.md's ``trainer.v1.sampler.custom_sampler``, as written there."""
    page = (REPO / "docs/trainer.md").read_text()
    blocks = [b.split("```", 1)[0] for b in page.split("```yaml\n")[1:]]
    (block,) = [b for b in blocks if "custom_sampler" in b]
    sampler: dict[str, Any] = yaml.safe_load(block)["trainer"]["v1"]["sampler"]["custom_sampler"]
    return sampler


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    # the actor imports the test double (tests.on_ray.verl_double) by name, as verl's actors import its classes
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    # TransferQueue's controller and storage unit take a CPU each, verl's worker one. One node: TransferQueue places
    # its storage units round-robin over every alive node, a node without CPUs too (where they cannot start)
    with local_cluster([{"num_cpus": 4}]) as c:
        from omegaconf import OmegaConf

        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
        try:
            yield c
        finally:
            tq.close()


def submit(worker: Any, rows: list[dict[str, Any]], step: int) -> None:
    """What a v1 trainer does with a dataloader batch (``_submit_batch_to_rollout``): each prompt registered in
    TransferQueue as pending, then the batch handed to the agent loop workers."""
    import uuid

    import numpy as np
    from verl.utils import tensordict_utils as tu

    def column(values: list[Any]) -> Any:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    uids = [str(uuid.uuid4()) for _ in rows]
    batch = tu.get_tensordict(
        {
            "agent_name": column(["gym_runtime"] * len(rows)),
            "extra_info": column([{"gym_row": r, "index": i} for i, r in enumerate(rows)]),
            "raw_prompt": column([r["responses_create_params"]["input"] for r in rows]),
            "index": np.arange(len(rows)),
            "uid": column(uids),
        }
    )
    tu.assign_non_tensor_data(batch, "global_steps", step)
    tags = [{"is_prompt": True, "status": "pending", "global_steps": step} for _ in rows]
    tq.kv_batch_put(keys=uids, partition_id="train", tags=tags)
    # the first call of a module also starts the actor's imports (torch, verl, TransferQueue's client): over 60 s on
    # the 2-core machine at load 7-15, where both modes timed out while first; a hang still fails, in 5 minutes
    ray.get(worker.generate_sequences.remote(batch), timeout=300)


@pytest.mark.parametrize("mode", sorted(SAMPLERS))
def test_every_failure_count_reaches_a_v1_training_steps_logged_metrics(
    cluster: Any, tmp_path: Path, mode: str
) -> None:
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.trainer.ppo.v1.utils import MetricsAggregator

    from gym_runtime.errors import ClientError

    w = world(tmp_path, rows=3)
    w.rows[0]["fixed_reward"] = 1.0
    w.rows[1]["explode"] = True  # every verify raises: excluded (both of its group's members)
    w.rows[2]["explode"] = True  # the next step's one prompt: all excluded, past the bound
    with EmbeddedServer(store_dir=str(tmp_path / "store"), http_port=0) as srv:
        model_dir, _ = served_in_actors(w, tmp_path, srv.url)
        loops = tmp_path / "agent_loops.yaml"
        options = {"gym_config": str(w.config), "nats": srv.url, "failures": {"retries": 0, "max_excluded": 0.5}}
        loops.write_text(
            yaml.safe_dump([{"name": "gym_runtime", "_target_": "gym_runtime.trainers.verl.GymAgentLoop", **options}])
        )
        config = verl_config(tmp_path, model_dir, loops)
        config.actor_rollout_ref.rollout.n = 2  # a group of two per prompt
        config.trainer.v1.trainer_mode = mode
        sampler = {**documented_sampler(), "name": SAMPLERS[mode]}
        assert documented_sampler()["name"] == SAMPLERS["sync"]
        config.trainer.v1.sampler.custom_sampler = OmegaConf.create(sampler)
        worker = AgentLoopWorkerTQ.options(num_cpus=1).remote(config, SavedTinyServer(model_dir, w.tool_token))
        try:
            # the replay buffer as the v1 trainer builds it from its config (the custom sampler)
            trainer = types.SimpleNamespace(config=config, trainer_mode=mode, _add_prompts_to_generate=None)
            replay_buffer = PPOTrainer._build_replay_buffer(trainer)  # type: ignore[arg-type]
            replay_buffer.poll_interval = 0.2
            submit(worker, w.rows[:2], step=1)
            batch, iter_metrics = replay_buffer.sample(global_steps=1, partition_id="train", batch_size=2)
            assert len(batch.keys) == 4  # two prompts, two sessions each: every output in TransferQueue
            stored = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["extra_fields"])
            kinds = sorted(getattr(e, "data", e)["gym_failure"] for e in stored["extra_fields"])
            assert kinds == ["excluded", "excluded", "scored", "scored"]
            aggregator = MetricsAggregator()  # PPOTrainer.step: the metrics it logs for the step
            aggregator.add_step_metrics(iter_metrics, sample_count=len(batch.keys))
            logged = aggregator.get_aggregated_metrics()
            assert logged["training/gym_runtime/rollouts/total"] == 4
            assert logged["training/gym_runtime/excluded/total"] == 2
            assert logged["training/gym_runtime/failed/environment/total"] == 2
            assert logged["training/gym_runtime/failed/verify_error/total"] == 2
            assert logged["training/gym_runtime/policy_failures/total"] == 0
            assert logged["training/gym_runtime/retried/total"] == 0
            # the bound: a step whose every rollout is excluded is one line, not a batch of nothing
            submit(worker, w.rows[2:], step=2)
            with pytest.raises(ClientError) as bound:
                replay_buffer.sample(global_steps=2, partition_id="train", batch_size=1)
            said = str(bound.value)
            assert "\n" not in said and "2 of 2 rollouts" in said and "verify_error" in said
        finally:
            ray.kill(worker)


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_a_sampler_of_the_other_trainer_mode_is_one_line_naming_the_right_one(mode: str) -> None:
    """verl builds whichever sampler class the config names, in any trainer mode: the sync one under an async
    trainer would sample with the wrong semantics, silently."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from gym_runtime.errors import ClientError

    config = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    config.trainer.v1.trainer_mode = mode
    right = SAMPLERS["sync"] if mode == "sync" else SAMPLERS["colocate_async"]
    wrong = SAMPLERS["colocate_async"] if mode == "sync" else SAMPLERS["sync"]
    config.trainer.v1.sampler.custom_sampler = OmegaConf.create({**documented_sampler(), "name": wrong})
    trainer = types.SimpleNamespace(config=config, trainer_mode=mode, _add_prompts_to_generate=None)
    with pytest.raises(ClientError) as said:
        PPOTrainer._build_replay_buffer(trainer)  # type: ignore[arg-type]
    needs = f"trainer.v1.trainer_mode: {mode} needs trainer.v1.sampler.custom_sampler.name: {right}"
    assert str(said.value) == f"{needs} (gym_runtime.trainers.verl_v1)"
    config.trainer.v1.sampler.custom_sampler.name = right
    assert type(PPOTrainer._build_replay_buffer(trainer)).__name__ == right  # type: ignore[arg-type]


def test_a_v1_run_ends_at_the_step_that_left_nothing_to_teach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 79 under v1: its loop refetches once when the dataloader ends and fails on a second end, so there the
    dataset never ends the data; ``GymReplayBuffer``, which counts each step's outcomes, brings the trainer's
    ``total_training_steps`` (what v1's ``fit`` checks before each step) down to the step after which no task can
    teach, with one ``trainer.stopped`` line naming the run. The trainer is a real ``PPOTrainerSync`` (its replay buffer
    built as its ``__init__`` builds it); verl's own ``ReplayBuffer.sample`` (TransferQueue: the cluster test above
    runs it) hands back an empty batch, the step's outcomes counted as ``step_metrics`` counts them."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from gym_runtime.trainers import verl_tasks
    from tests.trainers.test_verl_loop import _dead_set, _legacy_fit

    monkeypatch.setattr(verl_tasks, "_BY_STEPS", [], raising=False)
    config = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    config.trainer.v1.trainer_mode = "sync"
    config.trainer.v1.sampler.custom_sampler = OmegaConf.create(documented_sampler())
    trainer = PPOTrainerSync.__new__(PPOTrainerSync)  # what v1's fit reads of it: its replay buffer and its steps
    trainer.config, trainer.trainer_mode = config, "sync"
    trainer.replay_buffer = trainer._build_replay_buffer()
    trainer.total_training_steps = 100
    monkeypatch.setattr(ReplayBuffer, "sample", lambda *a, **kw: (types.SimpleNamespace(keys=[]), {}))
    _, loader = _dead_set(tmp_path / "data")  # built after the replay buffer, as v1 builds them
    trainer.global_steps = 1
    while trainer.global_steps <= trainer.total_training_steps:  # v1's fit, one step a batch of the dataloader
        assert _legacy_fit(loader, epochs=1)[0] == 3  # the data never ends under v1
        trainer.replay_buffer.sample(global_steps=trainer.global_steps, partition_id="train", batch_size=4)
        trainer.global_steps += 1
    assert verl_tasks.active() is not None and verl_tasks.active().exhausted  # type: ignore[union-attr]
    assert trainer.total_training_steps == trainer.global_steps - 1 < 20, trainer.total_training_steps
    out, err = capfd.readouterr()
    stopped = [line for line in (caplog.text + out + err).splitlines() if "trainer.stopped" in line]
    assert len(stopped) == 1 and "verl7" in stopped[0] and "verl_v1" in stopped[0], stopped
