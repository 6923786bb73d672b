"""verl's agent loop (verl 0.9.1, in a venv of its own: it pins transformers<5.11) running gym-runtime rollouts:
``gym_runtime.trainers.verl.GymAgentLoop`` built as verl's ``AgentLoopWorker`` builds it, with real nats-server and
workers, generating through the ``verl_server`` adapter.

What is not run here (no GPU, no Ray cluster): verl's ``AgentLoopWorker`` Ray actor and ``AgentLoopManager``, its
vLLM/SGLang rollout replicas behind ``LLMServerClient``, and its PPO/GRPO trainer. verl's server handle is the one
test double: ``TinyServer``, whose ``generate`` has ``LLMServerClient.generate``'s signature and answers verl's
``TokenOutput`` from the tiny policy (``tests/trainers/tiny_lm.py``) sampled in process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


async def test_the_gym_runtime_agent_loop_gives_verl_its_output(tmp_path: Path) -> None:
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from gym_runtime.trainers.verl import GymAgentLoop

    assert _agent_loop_registry["gym_runtime"] == {"_target_": "gym_runtime.trainers.verl.GymAgentLoop"}
    w = world(tmp_path, rows=4, tool_bias=3.0)
    cfg = yaml.safe_load(w.config.read_text())
    tool = w.tool_token
    cfg["models"]["policy"] = {
        "adapter": "verl_server",
        "live": "policy",
        "max_new_tokens": 4,
        "stop_token_ids": [tool],
    }
    w.config.write_text(yaml.safe_dump(cfg))
    server = TinyServer(w.model, w.tokenizer, tool)
    trainer_config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"response_length": 64}}})
    outputs, rows = [], []
    written = tmp_path / "train_rows.jsonl"  # rows_path: what the loops handed verl
    for k, r in enumerate(w.rows):
        loop = GymAgentLoop(  # as verl's worker builds one per sample: hydra.utils.instantiate(config, ...)
            trainer_config=DictConfigWrap(trainer_config),
            server_manager=server,
            tokenizer=w.tokenizer,
            processor=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(OmegaConf.create({})),
            gym_config=str(w.config),
            rows_path=str(written),
        )
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
    for t in train:  # no advantage (verl computes it in the driver); the step: the row's policy version, if any
        assert t["train_advantage"] is None
        assert t["train_step"] == (max(t["policy_versions"]) if t.get("policy_versions") else None)
