"""The trainer tests' world: TRL (or a skip), the tiny policy, the say-word environment's config and rows.

The policy is ``gym_runtime.rigs.tiny_policy``'s random 2-layer model, generating in this process through the
``transformers`` adapter's ``live: policy`` entry; the environment is ``tests.envs.say_word`` (a tool that draws
the row's word, the reward for saying it). Every row has the same prompt text and its own word: a trainer that
confused two rows would score a rollout against the wrong word.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_runtime.rigs.tiny_policy import build, tool_call_text
from tests.envs.say_word import WORDS

PROMPT = "say the word"
TOOLS = [{"type": "function", "name": "draw_word", "parameters": {"type": "object", "properties": {}}}]
TOOL_CALL = tool_call_text("draw_word")
# the stallable variant's second tool (issue 66): ``wait`` sleeps the row's ``wait_s``, past the rollout's timeout_s
WAIT_TOOL = {"type": "function", "name": "wait", "parameters": {"type": "object", "properties": {}}}
WAIT_CALL = tool_call_text("wait")


def need(module: str, required_by: str = "GYM_REQUIRE_TRL") -> Any:
    """The trainer tier's dependencies: skipped without them, except where CI requires them (GYM_REQUIRE_TRL=1 in
    the TRL venv, GYM_REQUIRE_VERL=1 in verl's)."""
    if os.environ.get(required_by) == "1":
        return importlib.import_module(module)  # CI's trainer venvs: a missing or broken package is a failure
    return pytest.importorskip(module, reason=f"{module} is not installed (the trainer tier: docs/trainer.md)")


def row(word: str, *, tools: list[dict[str, Any]] = TOOLS, **extra: Any) -> dict[str, Any]:
    params = {"input": [{"role": "user", "content": PROMPT}], "tools": tools}
    return {"responses_create_params": params, "word": word, **extra}


@dataclass
class World:
    model: Any
    tokenizer: Any
    config: Path
    rows: list[dict[str, Any]]

    @property
    def tool_token(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(TOOL_CALL))


def world(
    tmp_path: Path,
    *,
    rows: int = 4,
    max_new_tokens: int = 4,
    seed: int = 0,
    tool_bias: float = 0.0,
    wait_s: float | None = None,
    **agent: Any,
) -> World:
    """A config file (embedded NATS, every worker in this process) and ``rows`` rows, one word each; with ``wait_s``
    the rows offer a second tool, ``wait``, that takes that long (a policy that calls it can stall)."""
    calls = [TOOL_CALL] if wait_s is None else [TOOL_CALL, WAIT_CALL]
    model, tokenizer = build([*WORDS, "say", "the", "word"], calls, seed=seed, tool_bias=tool_bias)
    stops = [int(tokenizer.convert_tokens_to_ids(c)) for c in calls]
    cfg = {
        "namespace": "trainer",
        "nats": "embedded",
        "models": {
            "policy": {
                "adapter": "transformers",
                "live": "policy",
                "max_new_tokens": max_new_tokens,
                "stop_token_ids": stops,  # a tool call ends the turn (a real model says <|im_end|> after it)
            }
        },
        "resources": {"env": {"server": "tests.envs.say_word"}},
        "agents": {
            "agent": {
                "agent": "agents.simple",
                "model": "policy",
                "resource": "env",
                "max_steps": 3,
                "max_attempts": 1,  # a failure row comes back at once: the trainer's group policy decides
                **agent,
            }
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    if wait_s is None:
        return World(model, tokenizer, path, [row(WORDS[i % len(WORDS)]) for i in range(rows)])
    stallable = [row(WORDS[i % len(WORDS)], tools=[*TOOLS, WAIT_TOOL], wait_s=wait_s) for i in range(rows)]
    return World(model, tokenizer, path, stallable)


def grpo(w: World, rollout_func: Any, dataset: list[dict[str, Any]], tmp_path: Path, **args: Any) -> Any:
    """TRL's GRPOTrainer on CPU over the world's model, rewarded by the environment (``env_reward``)."""
    trl = need("trl")
    datasets = need("datasets")
    from gym_runtime.trainers.trl import env_reward

    reward_funcs = args.pop("reward_funcs", env_reward)
    config = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=args.pop("batch", 4),
        num_generations=args.pop("generations", 2),
        max_steps=args.pop("steps", 2),
        learning_rate=args.pop("learning_rate", 1e-2),
        logging_steps=1,
        report_to=[],
        use_cpu=args.pop("use_cpu", True),
        save_strategy="no",
        bf16=args.pop("bf16", False),
        seed=0,
        **args,
    )
    return trl.GRPOTrainer(
        model=w.model,
        processing_class=w.tokenizer,
        args=config,
        train_dataset=datasets.Dataset.from_list(dataset),
        reward_funcs=reward_funcs,
        rollout_func=rollout_func,
    )


def spans(row: dict[str, Any]) -> list[int]:
    """The env_mask a row must give, from its items alone: 0 on each turn's prompt ids past the rollout so far."""
    mask: list[int] = []
    seen: list[int] | None = None
    for item in row["response"]["output"]:
        if "generation_token_ids" not in item:
            continue
        if seen is None:
            seen = list(item["prompt_token_ids"])
        else:
            mask += [0] * (len(item["prompt_token_ids"]) - len(seen))
            seen = list(item["prompt_token_ids"])
        mask += [1] * len(item["generation_token_ids"])
        seen += item["generation_token_ids"]
    return mask
