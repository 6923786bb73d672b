"""``verl_server``: generation through verl's server handle, for a gym-runtime model worker inside verl's agent loop.

verl runs agent loops inside its ``AgentLoopWorker`` Ray actor and serves the policy through an ``LLMServerClient``
(``server_manager``: token ids in, token ids and logprobs out, on verl's vLLM or SGLang replicas, with sticky
sessions). ``gym_runtime.trainers.verl.GymAgentLoop`` registers that handle and verl's tokenizer as the live model
``live: NAME`` (``gym_runtime.live_models``), and this adapter, in a model worker in the same actor process, renders
each turn with the tokenizer's chat template and the environment's tools, sends the prompt's token ids to
``server_manager.generate`` and parses the generated text (Hermes tool calls), as ``vllm_engine`` does: later
turns are token-contiguous, and the last output item of each call carries ``prompt_token_ids``,
``generation_token_ids`` and ``generation_log_probs``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any
from uuid import uuid4

import msgspec

from gym_runtime.errors import ModelError
from gym_runtime.live_models import LIVE_MODELS
from gym_runtime.model import AdapterOptions
from gym_runtime.models.tokens import TOKEN_FIELDS
from gym_runtime.models.vllm_engine import EngineCompletion, EngineOutput, VLLMEngineModel, interrupt_problem

__all__ = ["Options", "ServerEngine", "VerlServerModel", "create", "interrupt_problem"]

_TOKEN_FIELDS = [("return_token_ids", bool, True) if f[0] == "return_token_ids" else f for f in TOKEN_FIELDS]

Options = msgspec.defstruct(
    "Options",
    [
        ("live", str, "policy"),  # the name GymAgentLoop registers verl's server handle under
        ("model", str | None, None),  # unused (the server serves the model): vllm_engine's key
        ("max_new_tokens", int, 1024),  # the most tokens one call generates
        ("max_model_len", int | None, None),  # the prompt + generation limit (verl's rollout config)
        ("stop_token_ids", list[int], msgspec.field(default_factory=list)),  # end a generation too
        ("extra_body", dict[str, Any], msgspec.field(default_factory=dict)),  # sampling keys merged in
        ("chat_template", str | None, None),
        *_TOKEN_FIELDS,
    ],
    bases=(AdapterOptions,),
    module=__name__,
    kw_only=True,
    forbid_unknown_fields=True,
)


class ServerEngine:
    """vLLM's ``AsyncLLM`` surface that ``vllm_engine`` calls, over verl's ``server_manager.generate``."""

    def __init__(self, cfg: Any) -> None:
        if cfg.reasoning_parser or cfg.tool_call_parser not in (None, "none", "hermes"):
            raise ValueError("verl_server adapter: tool_call_parser is hermes or none, and no reasoning_parser")
        self.cfg = cfg
        self.model_config = SimpleNamespace(max_model_len=cfg.max_model_len or 1 << 62)

    def get_tokenizer(self) -> Any:
        return LIVE_MODELS.get(self.cfg.live).tokenizer

    def sampling_params(self, **sampling: Any) -> dict[str, Any]:
        sampling.pop("logprobs", None)
        sampling["max_tokens"] = min(int(sampling["max_tokens"]), self.cfg.max_new_tokens)
        return sampling

    async def generate(
        self, prompt: dict[str, Any], sp: dict[str, Any], request_id: str
    ) -> AsyncIterator[EngineOutput]:
        live = LIVE_MODELS.get(self.cfg.live)
        ids = list(prompt["prompt_token_ids"])
        out = await live.model.generate(
            request_id or uuid4().hex, prompt_ids=ids, sampling_params={**sp, "logprobs": True}
        )
        gen = list(out.token_ids)
        lps = list(out.log_probs or [])
        if len(lps) != len(gen):
            raise ModelError(f"verl's server returned {len(lps)} logprobs for {len(gen)} tokens")
        stops = {
            int(t) for t in (getattr(live.tokenizer, "eos_token_id", None), *self.cfg.stop_token_ids) if t is not None
        }
        if self.cfg.eos_token_id is not None:
            stops.add(self.cfg.eos_token_id)
        finish = "stop" if gen and gen[-1] in stops else "length" if len(gen) >= int(sp["max_tokens"]) else "stop"
        done = EngineCompletion(
            token_ids=gen,
            logprobs=[{t: SimpleNamespace(logprob=float(lp))} for t, lp in zip(gen, lps, strict=True)],
            text=live.tokenizer.decode(gen, skip_special_tokens=True),
            finish_reason=finish,
        )
        yield EngineOutput(prompt_token_ids=ids, outputs=[done], finished=True)


class VerlServerModel(VLLMEngineModel):
    """``vllm_engine``'s adapter over verl's server handle."""

    def __init__(self, cfg: Any, *, concurrency: int = 64, base_dir: str | None = None) -> None:
        super().__init__(cfg, concurrency=concurrency, base_dir=base_dir, engine=ServerEngine(cfg))

    def __repr__(self) -> str:
        return f"VerlServerModel(live={self.cfg.live!r})"


create = VerlServerModel
