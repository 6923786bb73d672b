"""verl's agent loop running gym-runtime rollouts: ``GymAgentLoop``, registered as ``gym_runtime`` (verl 0.9.1).

verl runs agent loops inside its ``AgentLoopWorker`` Ray actors; each ``run`` here is one gym-runtime rollout of the
row the sample carries (``extra_info.gym_row``: the task row, as a dict or JSON), returned as verl's
``AgentLoopOutput``: the first turn's prompt ids, the response ids (every later turn: generations, and between them
the tool and template tokens), ``response_mask`` 0 on those tool and template tokens, the sampling policy's
logprobs, and the environment's reward as ``reward_score``.

Where things run: the bus is a NATS server the whole job reaches (``nats: URL``; ``embedded`` starts one in the
actor, for one actor); in each actor process, one ``Client`` (made by the first loop that runs there, kept for the
actor's life) runs a model worker whose adapter is ``verl_server`` (``gym_runtime.models.verl_server``): it sends
token ids to verl's ``server_manager`` (the loop registers it with verl's tokenizer as the live model ``policy``), so
generation stays on verl's rollout replicas, weight sync and all. The agent and environment workers run where the
config's ``workers`` says: in the actor too (``True``, the default), or elsewhere on the bus (``["models.policy"]``:
only the model worker here). A failed rollout is not raised into verl's step: it comes back as one masked token
(mask 0) with reward 0 and ``extra_fields["gym_error_class"]``.

verl's agent loop config names it::

    - name: gym_runtime
      _target_: gym_runtime.trainers.verl.GymAgentLoop
      gym_config: my_env/config.yaml
      nats: nats://head:4222
"""

from __future__ import annotations

import json
from typing import Any

import anyio
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from gym_runtime.client import Client
from gym_runtime.errors import ClientError, RolloutFailed
from gym_runtime.live_models import LIVE_MODELS
from gym_runtime.trainers.rows import sequence
from gym_runtime.trainers.train_rows import TrainRowsWriter

__all__ = ["GymAgentLoop", "LoopClients"]


class LoopClients:
    """One started ``Client`` per (config, bus, workers) in this process: verl builds an agent loop per sample, the
    workers must outlive them all (they stop with the actor's process)."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, str | None, str], Client] = {}
        self._lock = anyio.Lock()
        self._rows: dict[str, TrainRowsWriter] = {}

    def rows(self, path: str) -> TrainRowsWriter:
        """The actor's one writer of a training rows file (every loop of this process appends to it)."""
        writer = self._rows.get(path)
        if writer is None:
            writer = self._rows[path] = TrainRowsWriter(path)
        return writer

    async def get(self, config: str, nats: str | None, workers: bool | list[str]) -> Client:
        key = (config, nats, json.dumps(workers))
        async with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = Client(config, nats=nats, workers=workers)
                await client.__aenter__()
                self._clients[key] = client
            return client


# The actor process's clients: the one place agent loops of one process share their workers.
LOOP_CLIENTS = LoopClients()


@register("gym_runtime")
class GymAgentLoop(AgentLoopBase):
    """One gym-runtime rollout per ``run``; see the module docstring for where each part runs."""

    def __init__(
        self,
        *args: Any,
        gym_config: str = "",
        nats: str | None = None,
        workers: bool | list[str] = True,
        agent: str | None = None,
        live: str = "policy",
        rows_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not gym_config:
            raise ClientError("the gym_runtime agent loop needs gym_config: the gym-runtime config file to run")
        self.gym_config = gym_config
        self.nats = nats
        self.workers = workers
        self.agent = agent
        self.live = live
        self.last_row: dict[str, Any] | None = None
        self.rows_path = rows_path

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        row = (kwargs.get("extra_info") or {}).get("gym_row")
        if isinstance(row, str):
            row = json.loads(row)
        if not isinstance(row, dict):
            raise ClientError("a gym_runtime agent loop sample needs extra_info.gym_row: the task row (dict or JSON)")
        LIVE_MODELS.register(self.live, self.server_manager, self.tokenizer)
        client = await LOOP_CLIENTS.get(self.gym_config, self.nats, self.workers)
        try:
            result = await client.run(row, agent=self.agent)
        except RolloutFailed as e:
            self.last_row = e.row
            self._record(e.row, kwargs, 0.0)
            return self._masked(e.error_class)
        self.last_row = result
        self._record(result, kwargs, float(result.get("reward", 0.0)))
        seq = sequence(result)
        turns = sum(1 for item in result["response"]["output"] if "generation_token_ids" in item)
        return AgentLoopOutput(
            prompt_ids=seq.prompt_ids,
            response_ids=seq.completion_ids,
            response_mask=seq.env_mask,
            response_logprobs=seq.logprobs,
            reward_score=float(result.get("reward", 0.0)),
            num_turns=2 * turns,
            metrics=AgentLoopMetrics(),
            extra_fields={"gym_policy_versions": result.get("policy_versions")},
        )

    def _record(self, row: dict[str, Any], kwargs: dict[str, Any], reward: float) -> None:
        """The row in the training rows file (``rows_path``): its group is verl's ``uid`` (the sample's prompt, shared
        by its ``n`` rollouts), its step the policy version that made it (verl passes no step to a loop), and no
        advantage: verl computes it in the driver after every loop returned, where no loop reads it."""
        if self.rows_path is None:
            return
        versions = [v for v in row.get("policy_versions") or [] if isinstance(v, int)]
        uid = kwargs.get("uid")
        writer = LOOP_CLIENTS.rows(self.rows_path)
        group = str(uid) if uid is not None else writer.group()
        writer.write(row, step=max(versions) if versions else None, group=group, reward=reward)
        writer.flush()

    def _masked(self, error_class: str) -> AgentLoopOutput:
        eos = int(getattr(self.tokenizer, "eos_token_id", 0) or 0)
        return AgentLoopOutput(
            prompt_ids=[eos],
            response_ids=[eos],
            response_mask=[0],
            response_logprobs=[0.0],
            reward_score=0.0,
            num_turns=0,
            metrics=AgentLoopMetrics(),
            extra_fields={"gym_error_class": error_class},
        )
