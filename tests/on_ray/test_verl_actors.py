"""verl's agent loop run the way verl runs it: ``GymAgentLoop`` inside verl's own ``AgentLoopWorker(config,
llm_client)`` Ray actors (verl 0.9.1), two of them on two raylets of a real local Ray cluster, sharing one bus (a
real nats-server), each running gym-runtime's workers in its process as the loop's ``Client`` does, generating
through the ``verl_server`` adapter.

verl's config is its own generated PPO config with the tiny policy saved to disk (``model.path``: the actors load
the tokenizer there) and the agent loop registered from a YAML file, as a verl user registers it. The server handle
is the one double: the tiny policy (``verl_double.SavedTinyServer``, picklable into the actors). One departure:
``model.hf_config_path`` names a Llama config, since verl picks its token builder by the config's ``model_type``
and its Qwen builder needs a Qwen tokenizer (a newline token), which the tiny word-level one is not.

Not run here (no GPU): verl's rollout replicas (vLLM/SGLang) behind a real ``LLMServerClient``, its
``AgentLoopManager`` and its trainer (docs/trainer.md)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.helpers import REPO
from tests.on_ray.cluster import local_cluster, need_ray, results_stored
from tests.on_ray.verl_double import SavedTinyServer, served_in_actors, verl_config
from tests.trainers.world import need, world

ray = need_ray()
verl = need("verl", "GYM_REQUIRE_VERL")

PER_ACTOR = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    # the actors import the test double (tests.on_ray.verl_double) by name, as verl's actors import its classes
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    with local_cluster([{"num_cpus": 0}, {"num_cpus": 1}, {"num_cpus": 1}]) as c:
        yield c


def batch(rows: list[dict[str, Any]]) -> Any:
    import numpy as np
    from verl import DataProto

    def column(values: list[Any]) -> Any:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    return DataProto(
        batch=None,
        non_tensor_batch={
            "agent_name": column(["gym_runtime"] * len(rows)),
            "extra_info": column([{"gym_row": r} for r in rows]),
            "raw_prompt": column([r["responses_create_params"]["input"] for r in rows]),
            "index": np.arange(len(rows)),
        },
        meta_info={},
    )


def test_the_gym_runtime_agent_loop_runs_in_verls_agent_loop_worker_actors_sharing_one_bus(
    cluster: Any, tmp_path: Path
) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    w = world(tmp_path, rows=2 * PER_ACTOR, tool_bias=5.0)  # the tiny policy calls the tool often
    w.rows[-1]["explode"] = True  # its verify raises: excluded (issue 66), counted into verl's logged metrics
    with EmbeddedServer(store_dir=str(tmp_path / "store"), http_port=0) as srv:
        model_dir, cfg = served_in_actors(w, tmp_path, srv.url)
        loops = tmp_path / "agent_loops.yaml"  # how a verl user registers an agent loop with its options
        entry = {"name": "gym_runtime", "_target_": "gym_runtime.trainers.verl.GymAgentLoop"}
        options = {"gym_config": str(w.config), "nats": srv.url, "failures": {"retries": 0}}
        loops.write_text(yaml.safe_dump([{**entry, **options}]))
        config = verl_config(tmp_path, model_dir, loops)
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
        assert len(nodes) == 2
        actors = [
            ray.remote(num_cpus=1)(AgentLoopWorker)
            .options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(config, SavedTinyServer(model_dir, w.tool_token))
            for node in nodes
        ]
        parts = [w.rows[:PER_ACTOR], w.rows[PER_ACTOR:]]
        outputs = ray.get([a.generate_sequences.remote(batch(p)) for a, p in zip(actors, parts)], timeout=400)
        for out, part in zip(outputs, parts):
            assert len(out) == PER_ACTOR
            assert out.batch["responses"].shape == out.batch["response_mask"].shape == (PER_ACTOR, 64)
            scores = out.batch["rm_scores"].sum(-1).tolist()  # verl's reward: the environment's, on the last token
            assert all(s in (0.0, 1.0) for s in scores)
            assert [x["gym_row"]["word"] for x in out.non_tensor_batch["extra_info"]] == [r["word"] for r in part]
        masks = [m for out in outputs for m in out.batch["response_mask"].tolist()]
        assert any(1 in m[m.index(0) :] for m in masks if 0 in m)  # a tool turn (0s) between two generations (1s)
        assert (
            results_stored(srv, namespace=cfg["namespace"]) == 2 * PER_ACTOR
        )  # every rollout of both actors stored on the one bus
        # verl's AgentLoopManager.generate_sequences on its workers' outputs, with GymAgentLoopManager's own
        # _performance_metrics (agent_loop_manager_class), then the step's logged names (compute_timing_metrics)
        from verl import DataProto
        from verl.trainer.ppo.metric_utils import compute_timing_metrics

        from gym_runtime.trainers.verl import GymAgentLoopManager

        output = DataProto.concat(outputs)
        per_sample = [o.meta_info.pop("metrics") for o in outputs]
        timing = GymAgentLoopManager._performance_metrics(object.__new__(GymAgentLoopManager), per_sample, output)
        logged = compute_timing_metrics(output, {"step": 1.0, **timing})
        assert logged["timing_s/gym_runtime/rollouts"] == 2 * PER_ACTOR
        assert logged["timing_s/gym_runtime/excluded"] == 1 and logged["timing_s/gym_runtime/failed/environment"] == 1
        assert logged["timing_s/gym_runtime/failed/verify_error"] == 1
        assert output.non_tensor_batch["gym_runtime/excluded"].tolist() == [0.0] * (2 * PER_ACTOR - 1) + [1.0]
        for a in actors:
            ray.kill(a)
