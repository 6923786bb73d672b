"""``adapter: tests.envs.broken_model``: a model server that answers every call with an error (a TEST DOUBLE for
an LLM endpoint that is down): its callers see ``model_error``, a failure the runtime saw itself."""

from __future__ import annotations

from typing import Any

from gym_runtime.errors import ModelError
from gym_runtime.messages import CreateParams, Response
from gym_runtime.model import AdapterOptions


class Options(AdapterOptions, kw_only=True, forbid_unknown_fields=True):
    """``adapter: tests.envs.broken_model`` keys: none."""


class BrokenModel:
    def __init__(self, cfg: Options | None = None, **_: Any) -> None:
        self.cfg = cfg

    async def generate(self, params: CreateParams, *, rollout_key: str | None = None) -> Response:
        raise ModelError("the model server answered 503 (a test's)")

    async def aclose(self) -> None:
        return None


create = BrokenModel
