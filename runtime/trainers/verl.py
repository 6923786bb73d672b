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
only the model worker here). A failed rollout is not raised into verl's step (verl 0.9.1's ``AgentLoopWorker``
gathers its loops without ``return_exceptions``: one raise fails the whole step); it follows the failure policy
(``trainers.failures.FailurePolicy``, ``failures=`` in the loop's config, the same as TRL's adapters):

* a policy failure is scored: its real tokens (mask 1 on what the policy generated) and ``policy_failure_reward``
  (with no completed turn: one end-of-sequence token, mask 1: the stall's cost lands on something);
* an environment or infrastructure failure is run again (``retries`` times, each a new task), then excluded: one
  token with ``response_mask`` 0 (``reward_score`` 0.0, which no statistic reads). verl's own GRPO would take that 0
  into the group's mean and std, so the advantage estimator this module registers, ``gym_grpo``
  (``algorithm.adv_estimator: gym_grpo``; the trainer's process must import this module), reads a response with no
  policy token as the per-sample flag: out of the group's mean and std, advantage 0. (verl's v1 whole-group failure
  path is not used: it fails a group for one member.)

Each output's ``extra_fields`` say what happened (``gym_failure``: scored, policy or excluded; ``gym_error_class``;
``gym_failure_attribution``; ``gym_retried``; ``gym_tally``: the counts of every attempt), and its
``reward_extra_info`` holds the ``gym_runtime/*`` counts (``SAMPLE_COUNTS``) as numbers. Where they reach verl's
logged metrics (verl 0.9.1): ``reward_extra_info`` becomes its validation metrics (``val-aux/<source>/gym_runtime/
excluded/mean@N``...) in both trainers and the training batch's columns; a training step's counts come through
``GymAgentLoopManager`` in the legacy trainer (``trainer.use_v1: false``: ``timing_s/gym_runtime/*``) and through
``gym_runtime.trainers.verl_v1.GymReplayBuffer`` in the v1 trainer (verl's default, which runs this loop unchanged in
its ``AgentLoopWorkerTQ``: ``training/gym_runtime/*/total``). Each also bounds its batch: more than the loops'
``max_excluded`` excluded is one ``ClientError`` line (``check_bound``).

A loop's wait for its rollout is said and bounded (``waits``: ``trainers.waiting.WaitPolicy``, the TRL adapters'):
after ``say_after_s`` one line per actor names what the slowest rollouts wait on; at ``bound_s`` the loop raises
that line as a ``ClientError``, which fails verl's step rather than leaving it waiting forever.

verl's agent loop config names it::

    - name: gym_runtime
      _target_: gym_runtime.trainers.verl.GymAgentLoop
      gym_config: my_env/config.yaml
      nats: nats://head:4222
      failures: {policy_failure_reward: 0.0, retries: 2}
      waits: {say_after_s: 60, bound_s: 3600}
      branch_at: 2  # optional: each prompt's n samples one rollout and n - 1 branches of it at turn 2 (verl_branch)
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import msgspec
import numpy as np
import torch
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopManager,
    AgentLoopMetrics,
    AgentLoopOutput,
    _agent_loop_registry,
    register,
)
from verl.trainer.ppo.core_algos import register_adv_est
from verl.utils.import_utils import resolve_config_path

from gym_runtime.client import Client
from gym_runtime.data.sampling import task_key
from gym_runtime.errors import ClientError, RolloutFailed
from gym_runtime.live_models import LIVE_MODELS
from gym_runtime.trainers.arguments import count
from gym_runtime.trainers.failures import FailurePolicy, Kind, Tally, has_tokens, reward_of
from gym_runtime.trainers.rows import TokenSequence, masked, sequence
from gym_runtime.trainers.train_rows import TrainRowsWriter
from gym_runtime.trainers.verl_branch import BRANCH_GROUPS, Point, branch, check_workers, cut, parent_rollout
from gym_runtime.trainers.verl_tasks import observe_batch, sample_fields
from gym_runtime.trainers.waiting import Once, StepWait, WaitPolicy, wait_policy, watched

__all__ = [
    "GymAgentLoop",
    "GymAgentLoopManager",
    "LoopClients",
    "batch_tally",
    "check_bound",
    "failure_metrics",
    "gym_grpo_advantage",
]

# The failure policy's counts each sample carries as verl's reward_extra_info: the same keys on every sample (verl's
# worker takes the first sample's keys for the whole chunk), numbers only (verl's validation metrics average them).
SAMPLE_COUNTS = (
    "gym_runtime/rollouts",
    "gym_runtime/policy_failures",
    "gym_runtime/retried",
    "gym_runtime/excluded",
    "gym_runtime/failed/policy",
    "gym_runtime/failed/environment",
    "gym_runtime/failed/infrastructure",
)


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
# The actor's loops wait for one step: one line says why for them all
SAID = Once()


# verl's AgentLoopWorker reads the agent loop config (``gym_config``, ``nats``...) into its registry before the first
# loop imports this module; ``register`` would then replace that entry with a bare ``_target_`` for every later
# sample (seen in verl's own actors: the second sample had no gym_config). A configured entry is kept.
_CONFIGURED = _agent_loop_registry.get("gym_runtime")


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
        failures: FailurePolicy | Mapping[str, Any] | None = None,
        rows_path: str | None = None,
        waits: WaitPolicy | Mapping[str, Any] | None = None,
        branch_at: int | None = None,
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
        self.failures = (
            failures if isinstance(failures, FailurePolicy) else msgspec.convert(dict(failures or {}), FailurePolicy)
        )
        self.last_row: dict[str, Any] | None = None
        self.tally = Tally()  # the last run's counts
        self.rows_path = rows_path
        self.waits = wait_policy(dict(waits) if isinstance(waits, Mapping) else waits)
        self.branch_at = None if branch_at is None else count("branch_at", branch_at, 1)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        row = (kwargs.get("extra_info") or {}).get("gym_row")
        if isinstance(row, str):
            row = json.loads(row)
        if not isinstance(row, dict):
            raise ClientError("a gym_runtime agent loop sample needs extra_info.gym_row: the task row (dict or JSON)")
        LIVE_MODELS.register(self.live, self.server_manager, self.tokenizer)
        client = await LOOP_CLIENTS.get(self.gym_config, self.nats, self.workers)
        tally = Tally()
        watch = StepWait(self.waits)  # the whole wait, retries in: said, and bounded
        branched: dict[str, Any] = {}  # branch_at: the group's fields
        if self.branch_at is None:
            result, k = await self._attempts(lambda: client.run(row, agent=self.agent), client, tally, watch)
            seq = self._sequence(result, k, row)
        else:
            result, k, seq, branched = await self._branched(client, row, kwargs.get("uid"), tally, watch)
        index = (kwargs.get("extra_info") or {}).get("index")
        tally.ended(result, k, f"dataset row {index}" if index is not None else None)
        counts = tally.metrics()
        self.last_row = result
        self._record(result, kwargs, reward_of(result, self.failures), task_key(row))
        self.tally = tally
        reward = reward_of(result, self.failures)
        turns = sum(1 for item in (result.get("response") or {}).get("output", []) if "generation_token_ids" in item)
        return AgentLoopOutput(
            prompt_ids=seq.prompt_ids,
            response_ids=seq.completion_ids,
            response_mask=seq.env_mask,
            response_logprobs=seq.logprobs,
            reward_score=float(reward) if reward is not None else 0.0,  # excluded: read by no statistic (gym_grpo)
            num_turns=2 * turns,
            metrics=AgentLoopMetrics(),
            extra_fields={
                "gym_policy_versions": result.get("policy_versions"),
                "gym_failure": k,
                "gym_error_class": result.get("error_class"),
                "gym_failure_attribution": result.get("failure_attribution"),
                "gym_retried": tally.retried,
                "gym_tally": tally.plain(),  # every attempt's (retries too): what failure_metrics sums
                "gym_max_excluded": self.failures.max_excluded,  # the step's bound (GymAgentLoopManager)
                **sample_fields(row, result),  # gym_task, gym_outcome: what the task sampler counts (verl_tasks)
                # verl's own per-sample channel: its batch columns and dumps, its validation metrics
                "reward_extra_info": {key: counts.get(key, 0.0) for key in SAMPLE_COUNTS},
                **branched,
            },
        )

    async def _attempts(
        self, one: Callable[[], Awaitable[dict[str, Any]]], client: Client, tally: Tally, watch: StepWait
    ) -> tuple[dict[str, Any], Kind]:
        """``one()`` until its row is not excluded, ``retries`` more times at most (each a new task)."""
        for attempt in range(self.failures.retries + 1):
            try:  # every loop's rollout is in the client's one run batch: the line reads the namespace's
                result = await watched(one, bus=client.bus, watch=watch, batches=lambda: None, once=SAID)
            except RolloutFailed as e:
                result = e.row
            k = tally.saw(result)
            if k != "excluded" or attempt == self.failures.retries:
                break
            tally.retried += 1
        return result, k

    def _sequence(
        self, result: dict[str, Any], k: Kind, row: dict[str, Any], point: Point | None = None
    ) -> TokenSequence:
        """What verl trains on of ``result`` (``point``: cut at its branch point): its tokens; else one token, mask
        0 (a policy failure's: mask 1, its cost lands on something), its prompt the group's prefix if known."""
        own = None
        if k != "excluded" and has_tokens(result):
            own = sequence(result) if point is None else cut(result, point.turn)
        if own is not None:
            if point is not None and point.seq is not None and own.prompt_ids != point.seq.prompt_ids:
                raise ClientError(f"branch_at: a branch of rollout {point.parent} does not share its prefix")
            return own
        seq = masked(point.seq if point is not None else None, row, self.tokenizer)
        if k == "policy":  # scored with nothing generated: one token carries its cost
            seq.env_mask = [1]
        return seq

    async def _branched(
        self, client: Client, row: dict[str, Any], uid: Any, tally: Tally, watch: StepWait
    ) -> tuple[dict[str, Any], Kind, TokenSequence, dict[str, Any]]:
        """``branch_at``: this sample as a member of its uid's group (``verl_branch``): the parent's rollout, or a
        continuation of it; its sequence cut at the branch point, and the group's fields."""
        turn = self.branch_at
        assert turn is not None
        if uid is None:
            raise ClientError("branch_at: a gym_runtime agent loop sample needs verl's uid (its prompt's group)")
        with BRANCH_GROUPS.joined(str(uid)) as (group, parent):
            if parent:
                ran: list[str] = []
                result, k = await self._attempts(
                    lambda: parent_rollout(client, row, self.agent, ran), client, tally, watch
                )
                point = Point(ran[-1], turn, result, cut(result, turn) if has_tokens(result) else None)
                self._fits(point.seq, uid)  # too long a prefix: its branches fail at once, none is run
                group.point = point
                group.ready.set()
            else:
                point = await group.wait()
                result, k = await self._attempts(
                    lambda: branch(client, row, point.parent, turn, self.agent), client, tally, watch
                )
        seq = self._sequence(result, k, row, point)
        self._fits(seq, uid)
        return result, k, seq, {"gym_branch_of": None if parent else point.parent}

    def _fits(self, seq: TokenSequence | None, uid: Any) -> None:
        """A branch group's prefix (its prompt ids) within verl's ``prompt_length``: verl pads prompts to it and
        cannot stack a longer one; one ``ClientError`` line naming it, rather than cutting the prefix."""
        limit = self.rollout_config.get("prompt_length") if hasattr(self.rollout_config, "get") else None
        if seq is not None and isinstance(limit, int) and len(seq.prompt_ids) > limit:
            raise ClientError(
                f"branch_at={self.branch_at}: the prefix of uid {uid} is {len(seq.prompt_ids)} tokens, past "
                f"actor_rollout_ref.rollout.prompt_length={limit} (data.max_prompt_length): raise it to hold the "
                f"task's prompt and {self.branch_at} turns with their tool outputs"
            )

    def _record(self, row: dict[str, Any], kwargs: dict[str, Any], reward: float | None, task: str) -> None:
        """The row in the training rows file (``rows_path``): its group is verl's ``uid`` (the sample's prompt, shared
        by its ``n`` rollouts), its step the policy version that made it (verl passes no step to a loop), and no
        advantage: verl computes it in the driver after every loop returned, where no loop reads it. An excluded
        member's reward is None (``gym_grpo`` leaves it out)."""
        if self.rows_path is None:
            return
        versions = [v for v in row.get("policy_versions") or [] if isinstance(v, int)]
        uid = kwargs.get("uid")
        writer = LOOP_CLIENTS.rows(self.rows_path)
        group = str(uid) if uid is not None else writer.group()
        writer.write(row, step=max(versions) if versions else None, group=group, reward=reward, task=task)
        writer.flush()


@register_adv_est("gym_grpo")
def gym_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GRPO outcome advantage (``compute_grpo_outcome_advantage``: the group's mean and unbiased std, a group
    of one 0 and 1, ``epsilon``) with the excluded members left out: a response with no policy token
    (``response_mask`` all 0: an environment or infrastructure failure, ``GymAgentLoop``) is in no group's mean or
    std and gets advantage 0. Scores are divided by the group's largest magnitude before any square (no overflow).
    ``algorithm.adv_estimator: gym_grpo``."""
    if config is not None and hasattr(config, "get"):
        norm_adv_by_std_in_grpo = bool(config.get("norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo))
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).tolist()
        kept = (response_mask.sum(dim=-1) > 0).tolist()
        groups: dict[Any, list[int]] = {}
        for i, uid in enumerate(index):
            if kept[i]:
                groups.setdefault(uid, []).append(i)
        scalars = [0.0] * len(scores)
        for members in groups.values():
            values = [float(scores[i]) for i in members]
            if len(values) == 1:
                mean, std = 0.0, 1.0
            else:
                top = max(abs(v) for v in values) or 1.0
                scaled = [v / top for v in values]
                m = math.fsum(scaled) / len(scaled)
                mean = m * top
                std = top * math.sqrt(math.fsum((x - m) ** 2 for x in scaled) / (len(scaled) - 1))
            for i, v in zip(members, values, strict=True):
                scalars[i] = (v - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else v - mean
        out = torch.tensor(scalars, dtype=token_level_rewards.dtype, device=token_level_rewards.device)
        adv = out.unsqueeze(-1) * response_mask
    return adv, adv


def batch_tally(batch: Any) -> Tally:
    """The failure policy's counts of a verl batch: the ``gym_tally`` each ``GymAgentLoop`` sample carries in its
    ``non_tensor_batch`` (or a mapping of such columns), summed."""
    fields: Mapping[str, Any] = getattr(batch, "non_tensor_batch", batch)
    tally = Tally()
    for plain in fields.get("gym_tally", []):
        tally.add(Tally.of_plain(plain or {}))
    return tally


def failure_metrics(batch: Any) -> dict[str, float]:
    """``batch_tally``'s counts as TRL's adapters log them: ``gym_runtime/rollouts``, ``policy_failures``,
    ``retried``, ``excluded``, and ``failed/<attribution>`` and ``failed/<class>`` over every attempt."""
    return {**{key: 0.0 for key in SAMPLE_COUNTS}, **batch_tally(batch).metrics()}


def check_bound(batch: Any) -> None:
    """More than ``max_excluded`` (the loops' failure policy) of a generated batch's rollouts excluded: one
    ``ClientError`` line naming the tasks and classes, as TRL's adapters stop a call or a step."""
    fields: Mapping[str, Any] = getattr(batch, "non_tensor_batch", batch)
    bounds = [float(b) for b in fields.get("gym_max_excluded", []) if b is not None]
    if bounds:
        batch_tally(batch).check(FailurePolicy(max_excluded=min(bounds)), "verl's generated batch")


class GymAgentLoopManager(AgentLoopManager):
    """verl's ``AgentLoopManager`` with the failure policy's counts of each generated batch in its metrics:
    ``actor_rollout_ref.rollout.agent.agent_loop_manager_class:
    gym_runtime.trainers.verl.GymAgentLoopManager``. The manager's timing dict (what ``_performance_metrics``
    returns, ``meta_info["timing"]``) is the one place verl 0.9.1's legacy trainer takes a generation's own figures
    into the step's logged metrics (as ``timing_s/<key>``: ``timing_s/gym_runtime/excluded``...); no agent loop
    field reaches them otherwise. The v1 trainer: ``gym_runtime.trainers.verl_v1``."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        agent = self.rollout_config.agent  # branch_at: each prompt's samples in one worker
        path = agent.get("agent_loop_config_path")
        entries = OmegaConf.load(resolve_config_path(path)) if path else []
        check_workers(entries, config.data.get("gen_batch_size") or config.data.train_batch_size, agent.num_workers)

    def _performance_metrics(self, metrics: list[list[dict[str, str]]], output: Any) -> dict[str, float]:
        check_bound(output)  # a systematic failure stops the step in one line (the loops' max_excluded)
        timing: dict[str, float] = super()._performance_metrics(metrics, output)
        timing.update(failure_metrics(output))
        timing.update(observe_batch(getattr(output, "non_tensor_batch", output)))  # the task sampler's (verl_tasks)
        return timing


if _CONFIGURED is not None:
    _agent_loop_registry["gym_runtime"] = _CONFIGURED
