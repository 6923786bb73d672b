"""verl's server handle for actors: the tiny-policy double (``tests.trainers.test_verl_loop.TinyServer``) made from
files, so that it pickles into verl's ``AgentLoopWorker`` Ray actors as verl's own ``LLMServerClient`` does; each
actor loads the saved tiny model and tokenizer on its first call. The LLM is the only double here."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
