"""``transformers``: generation in process with a Hugging Face ``transformers`` model, a trainer's live one.

Two ways to name the model:

* ``live: NAME`` — the model and tokenizer a trainer registered in this process
  (``gym_runtime.live_models.LIVE_MODELS.register``; ``gym_runtime.trainers.trl`` does it for TRL): the weights
  being trained generate, so a trainer step is the weight sync (TRL's colocated way). The model worker must run
  in the trainer's process (``Client(workers=True)``).
* ``model: DIR`` — a local model directory, loaded once (``from_pretrained``, no hub download).

Everything between the conversation and the token ids is ``vllm_engine``'s (the same chat-template rendering
with tools, Hermes tool-call parsing, token-contiguous later turns, ``return_token_ids`` items, interruptible
generations for ``pause(mode="interrupt")``); only the engine differs: ``Engine`` here samples token by token
from the model's forward pass with a KV cache, and each token's logprob is the log-softmax of the logits it was
sampled from (at the request's temperature). Tool calls are Hermes blocks in the generated text
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``).

Sampling keys: ``temperature``, ``top_p``, ``top_k``, ``seed``, the output limit (``max_output_tokens``, capped
by ``max_new_tokens``); any other (penalties, stop strings, structured outputs) fails the call with its name.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import msgspec

from gym_runtime.errors import ModelError
from gym_runtime.live_models import LIVE_MODELS, LiveModel
from gym_runtime.model import AdapterOptions
from gym_runtime.models.tokens import TOKEN_FIELDS
from gym_runtime.models.vllm_engine import EngineCompletion, EngineOutput, VLLMEngineModel, interrupt_problem

__all__ = ["Engine", "Options", "TransformersModel", "create", "interrupt_problem"]

# the training fields are on by default here: this adapter exists to feed a trainer
_TOKEN_FIELDS = [("return_token_ids", bool, True) if f[0] == "return_token_ids" else f for f in TOKEN_FIELDS]

Options = msgspec.defstruct(
    "Options",
    [
        ("live", str | None, None),  # a registered live model (gym_runtime.live_models)
        ("model", str | None, None),  # or a local model directory
        ("max_new_tokens", int, 256),  # the most tokens one call generates
        ("stop_token_ids", list[int], msgspec.field(default_factory=list)),  # end a generation too (kept in it)
        ("extra_body", dict[str, Any], msgspec.field(default_factory=dict)),  # sampling keys merged in
        ("chat_template", str | None, None),  # a Jinja file overriding the tokenizer's
        *_TOKEN_FIELDS,
    ],
    bases=(AdapterOptions,),
    module=__name__,
    kw_only=True,
    forbid_unknown_fields=True,
)

_SUPPORTED = {"temperature", "top_p", "top_k", "seed", "max_tokens"}


class Engine:
    """vLLM's ``AsyncLLM`` surface that ``vllm_engine`` calls, over a ``transformers`` model in this process."""

    def __init__(self, cfg: Any, *, base_dir: str | None = None) -> None:
        if bool(cfg.live) == bool(cfg.model):
            raise ValueError("transformers adapter: set one of live (a registered model) or model (a directory)")
        if cfg.reasoning_parser or cfg.tool_call_parser not in (None, "none", "hermes"):
            raise ValueError("transformers adapter: tool_call_parser is hermes or none, and no reasoning_parser")
        if cfg.max_new_tokens < 1:
            raise ValueError(f"transformers adapter: max_new_tokens must be at least 1, got {cfg.max_new_tokens}")
        self.cfg = cfg
        self._path = None if cfg.model is None else Path(cfg.model)
        if self._path is not None and not self._path.is_absolute() and base_dir:
            self._path = Path(base_dir) / self._path
        self._loaded: LiveModel | None = None

    def _live(self) -> LiveModel:
        if self.cfg.live:
            return LIVE_MODELS.get(self.cfg.live)
        if self._loaded is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            path = str(self._path)
            self._loaded = LiveModel(AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path))
        return self._loaded

    @property
    def model_config(self) -> Any:
        config = self._live().model.config
        return SimpleNamespace(max_model_len=int(getattr(config, "max_position_embeddings", 0) or 0) or 1 << 62)

    def get_tokenizer(self) -> Any:
        return self._live().tokenizer

    def sampling_params(self, **sampling: Any) -> dict[str, Any]:
        unsupported = sorted(k for k in sampling if k not in _SUPPORTED and k != "logprobs")
        if unsupported:
            raise ModelError(f"the transformers adapter does not support {', '.join(unsupported)}")
        sampling["max_tokens"] = min(int(sampling["max_tokens"]), self.cfg.max_new_tokens)
        return sampling

    async def generate(
        self, prompt: dict[str, Any], sp: dict[str, Any], request_id: str
    ) -> AsyncIterator[EngineOutput]:
        """One token per step, each computed in a worker thread (the event loop keeps serving): cumulative
        outputs, as vLLM streams them; closing the stream stops the generation (``abort``)."""
        live = await anyio.to_thread.run_sync(self._live)
        ids = list(prompt["prompt_token_ids"])
        sampler = _Sampler(live, ids, sp, self._stop_ids(live))
        out = EngineOutput(prompt_token_ids=ids, outputs=[EngineCompletion()])
        while not out.finished:
            token, logprob, finish = await anyio.to_thread.run_sync(sampler.step)
            done = out.outputs[0]
            done.token_ids.append(token)
            done.logprobs.append({token: SimpleNamespace(logprob=logprob)})
            if finish is not None:
                done.finish_reason = finish
                done.text = live.tokenizer.decode(done.token_ids, skip_special_tokens=True)
                out.finished = True
            yield out

    def _stop_ids(self, live: LiveModel) -> set[int]:
        stops = {self.cfg.eos_token_id, getattr(live.tokenizer, "eos_token_id", None)}
        generation = getattr(live.model, "generation_config", None)
        extra = getattr(generation, "eos_token_id", None)
        stops.update(extra if isinstance(extra, list) else [extra])
        return {int(t) for t in stops if t is not None} | set(self.cfg.stop_token_ids)


class _Sampler:
    """The token loop of one generation: a forward pass per token over the KV cache, under the model's lock."""

    def __init__(self, live: LiveModel, prompt: list[int], sp: dict[str, Any], stops: set[int]) -> None:
        import torch

        self.torch = torch
        self.live = live
        self.pending = prompt
        self.cache: Any = None
        self.left = int(sp["max_tokens"])
        self.temperature = float(sp.get("temperature", 1.0) if sp.get("temperature") is not None else 1.0)
        self.top_p = sp.get("top_p")
        self.top_k = sp.get("top_k")
        self.stops = stops
        self.generator: Any = None
        if sp.get("seed") is not None:
            self.generator = torch.Generator().manual_seed(int(sp["seed"]))

    def step(self) -> tuple[int, float, str | None]:
        torch = self.torch
        model = self.live.model
        with self.live.lock, torch.no_grad():
            device = next(model.parameters()).device
            ids = torch.tensor([self.pending], device=device)
            out = model(input_ids=ids, **{_cache_key(model): self.cache}, use_cache=True)
            self.cache = getattr(out, "cache", None) or out.past_key_values
            logits = out.logits[0, -1].float()
        logprobs, token = self._sample(logits)
        self.pending = [token]
        self.left -= 1
        finish = "stop" if token in self.stops else "length" if self.left <= 0 else None
        return token, logprobs, finish

    def _sample(self, logits: Any) -> tuple[float, int]:
        torch = self.torch
        if self.temperature <= 0:  # greedy: the logprob of the distribution at temperature 1
            token = int(torch.argmax(logits))
            return float(torch.log_softmax(logits, -1)[token]), token
        logprobs = torch.log_softmax(logits / self.temperature, -1)
        probs = logprobs.exp()
        if self.top_k:
            kth = torch.topk(probs, min(int(self.top_k), probs.numel())).values[-1]
            probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
        if self.top_p is not None and float(self.top_p) < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            cut = torch.cumsum(ordered, 0) - ordered > float(self.top_p) * ordered.sum()
            probs = probs.clone()
            probs[order[cut]] = 0.0
        token = int(torch.multinomial(probs.cpu() / probs.sum(), 1, generator=self.generator))
        return float(logprobs[token]), token


def _cache_key(model: Any) -> str:
    """The forward pass's KV-cache argument: ``cache`` (transformers >= 5.24), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class TransformersModel(VLLMEngineModel):
    """``vllm_engine``'s adapter over ``Engine``: same prompts, parsing and token-id items."""

    def __init__(self, cfg: Any, *, concurrency: int = 64, base_dir: str | None = None) -> None:
        super().__init__(cfg, concurrency=concurrency, base_dir=base_dir, engine=Engine(cfg, base_dir=base_dir))

    def __repr__(self) -> str:
        return f"TransformersModel(live={self.cfg.live!r}, model={self.cfg.model!r})"


create = TransformersModel
