"""verl's server handle for actors: the tiny-policy double (``tests.trainers.test_verl_loop.TinyServer``) made from
files, so that it pickles into verl's ``AgentLoopWorker`` Ray actors as verl's own ``LLMServerClient`` does; each
actor loads the saved tiny model and tokenizer on its first call. The LLM is the only double here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class SavedTinyServer:
    """``LLMServerClient.generate``'s signature, answered by the tiny policy saved at ``model_dir``."""

    def __init__(self, model_dir: Path, tool: int) -> None:
        self.model_dir, self.tool = str(model_dir), tool
        self._server: Any = None
        self.calls = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"model_dir": self.model_dir, "tool": self.tool, "_server": None, "calls": 0}

    async def generate(self, request_id: str, **kwargs: Any) -> Any:
        if self._server is None:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            torch.manual_seed(0)  # each actor samples the same way on every run

            from tests.trainers.test_verl_loop import TinyServer

            model = AutoModelForCausalLM.from_pretrained(self.model_dir)
            self._server = TinyServer(model, AutoTokenizer.from_pretrained(self.model_dir), self.tool)
        self.calls += 1
        return await self._server.generate(request_id, **kwargs)


def verl_config(tmp: Path, model_dir: Path, loops: Path) -> Any:
    import verl
    from omegaconf import OmegaConf
    from transformers import LlamaConfig

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    LlamaConfig(
        vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, architectures=["LlamaForCausalLM"]
    ).save_pretrained(tmp / "hf_config")
    model = cfg.actor_rollout_ref.model
    model.path, model.hf_config_path = str(model_dir), str(tmp / "hf_config")
    rollout = cfg.actor_rollout_ref.rollout
    rollout.name, rollout.prompt_length, rollout.response_length = "vllm", 64, 64
    rollout.agent.agent_loop_config_path = str(loops)
    return cfg


def served_in_actors(w: Any, tmp: Path, nats: str) -> tuple[Path, dict[str, Any]]:
    """The world's tiny policy and tokenizer saved for the actors to load, and its config (returned) with the bus
    every actor reaches and the policy served by verl (the ``verl_server`` adapter)."""
    model_dir = tmp / "policy"
    w.model.save_pretrained(model_dir)
    w.tokenizer.save_pretrained(model_dir)
    cfg = yaml.safe_load(w.config.read_text())
    cfg["nats"] = nats
    cfg["models"]["policy"] = {
        "adapter": "verl_server",
        "live": "policy",
        "max_new_tokens": 4,
        "stop_token_ids": [w.tool_token],
    }
    w.config.write_text(yaml.safe_dump(cfg))
    return model_dir, cfg
