"""TRL's ``GRPOTrainer(rollout_func=...)`` fed by gym-runtime: ``TRLRollouts``.

    rollouts = TRLRollouts(client, rows, live="policy")          # a SyncClient whose workers run here
    trainer = GRPOTrainer(model=model, processing_class=tok, args=GRPOConfig(...),
                          train_dataset=Dataset.from_list(rollouts.dataset()),
                          reward_funcs=env_reward, rollout_func=rollouts)

What TRL hands over, and what comes back (trl 1.16, measured, not its docstring):

* TRL's ``RepeatSampler`` has already repeated each prompt ``num_generations`` times, in a row: the function gets
  ``batch`` prompts and must return exactly one completion per prompt, in order. Each run of one prompt is one
  group here: one task submitted with ``repeats`` = the run's length.
* Only the prompts come: each is matched back to its row by ``RowIndex`` (``.dataset()``'s prompts carry the row's
  position, so two rows with the same text are not confused).
* Back: ``prompt_ids``, ``completion_ids``, ``logprobs`` and ``env_mask`` (0 on tool and template tokens between
  turns) per rollout (``rows.sequence``), and, as extra fields TRL passes to the reward functions, ``gym_reward``
  and each named part of it as ``gym_<name>`` (``env_reward`` reads ``gym_reward``).
* Weights: TRL trains the model it generates with; with ``live=NAME`` the adapter registers ``trainer.model`` for
  the ``transformers`` adapter's ``live: NAME`` entry, so every call generates with the current weights, and stamps
  the version (``trainer.state.global_step``) with ``set_policy_version`` first: rows say which weights made them.

Failure rows never raise into the step; ``GroupPolicy`` decides (and counts into TRL's logged metrics,
``gym_runtime/*``): a failed rollout runs again (a new task: a fresh environment) up to ``retries`` times; a group
still short is dropped and replaced by the group of the next row of the dataset (same size), up to ``refills``
times; with ``on_failure="mask"`` it is kept instead, its failed members as one masked token each (reward 0,
mask 0). Mistakes (a prompt with no row, an unknown agent, a bus that is gone) are one ``ClientError`` line, raised
before anything is submitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gym_runtime.errors import ClientError
from gym_runtime.live_models import LIVE_MODELS
from gym_runtime.observability import logs
from gym_runtime.sync_client import SyncBatch, SyncClient
from gym_runtime.trainers.rows import RowIndex, TokenSequence, check_agent, components, runs, sequence
from gym_runtime.trainers.train_rows import TRLTrainRows

__all__ = ["GroupPolicy", "TRLRollouts", "env_reward"]

log = logs.get("gym.trainers.trl")
ON_FAILURE = ("drop", "mask")


class GroupPolicy(msgspec.Struct, kw_only=True, frozen=True):
    """What a group with failure rows becomes (chosen per run)."""

    retries: int = 2  # a failed rollout is run again, each time as a new task (a fresh environment)
    on_failure: str = "drop"  # "drop": the group is replaced by the next row's; "mask": kept, failures masked
    refills: int = 4  # at most this many replacement groups per call (a systematic failure raises past it)

    def __post_init__(self) -> None:
        if self.retries < 0 or self.refills < 0:
            raise ClientError(f"GroupPolicy: retries and refills are >= 0, got {self.retries}, {self.refills}")
        if self.on_failure not in ON_FAILURE:
            raise ClientError(f"GroupPolicy: on_failure is one of {', '.join(ON_FAILURE)}, got {self.on_failure!r}")


def env_reward(prompts: Any = None, completions: Any = None, *, gym_reward: list[float], **_: Any) -> list[float]:
    """A TRL reward function: the environment's reward of each rollout, as its verifier gave it."""
    return list(gym_reward)


@dataclass
class _Group:
    """One group: ``size`` rollouts of row ``row``; ``rows`` fills as results come (None: failed)."""

    row: int
    size: int
    rows: list[dict[str, Any] | None] = field(default_factory=list)
    tries: int = 0
    failures: dict[int, dict[str, Any]] = field(default_factory=dict)  # a failed member's last failure row

    @property
    def failed(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r is None]


@dataclass
class Counts:
    """What the group policy did in one call (``TRLRollouts.counts``: the last call's; ``totals``: all calls)."""

    rollouts: int = 0
    failed: int = 0  # failure rows received
    retried: int = 0
    dropped_groups: int = 0
    refilled_groups: int = 0
    masked: int = 0

    def add(self, other: Counts) -> None:
        for k in vars(self):
            setattr(self, k, getattr(self, k) + getattr(other, k))


class TRLRollouts:
    """TRL's ``rollout_func``: ``trainer.rollout_func(prompts, trainer)`` runs gym-runtime rollouts.

    ``client``: a ``SyncClient`` (workers in this process for ``live``); ``rows``: the task rows trained on (the
    dataset is ``.dataset()``); ``agent``: the config's agent that runs them (needed when it has several);
    ``live``: the name of the ``transformers`` adapter entry's ``live`` model to register ``trainer.model`` under
    (None: the policy is served elsewhere); ``max_staleness``: passed to ``submit``; ``rows_path``: a file the
    rows handed to TRL are appended to, with their step, group, reward and TRL's advantage (``train_rows``).
    """

    def __init__(
        self,
        client: SyncClient,
        rows: Sequence[dict[str, Any]],
        *,
        agent: str | None = None,
        live: str | None = "policy",
        policy: GroupPolicy | None = None,
        max_staleness: int | None = None,
        rows_path: str | None = None,
    ) -> None:
        check_agent(list(client.client.config.agents), agent)
        self.client = client
        self.index = RowIndex(rows)
        self.agent = agent
        self.live = live
        self.policy = policy or GroupPolicy()
        self.max_staleness = max_staleness
        self.counts = Counts()
        self.totals = Counts()
        self.last_rows: list[dict[str, Any] | None] = []  # the last call's rows, in TRL's order (None: masked)
        self.train_rows = TRLTrainRows(rows_path) if rows_path is not None else None

    def dataset(self) -> list[dict[str, Any]]:
        """The trainer's dataset (``datasets.Dataset.from_list``): one prompt per row, carrying its row."""
        return self.index.dataset()

    def close(self) -> None:
        """The training rows still held written, and the file closed (TRL's end of training writes them too)."""
        if self.train_rows is not None:
            self.train_rows.close()

    # ------------------------------------------------------------------------------------------ the call

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        found = [self.index.find(p) for p in prompts]  # every prompt's row, before anything is submitted
        self._sync(trainer)
        self.counts = Counts()
        groups = [_Group(row, size) for row, size in runs(found)]
        self._run(groups)
        self._retry(groups)
        groups = self._settle(groups, taken={g.row for g in groups})
        out = self._output(groups)
        if self.train_rows is not None:
            self.train_rows.hold([_written(g) for g in groups], out["gym_reward"], trainer)
        self.totals.add(self.counts)
        self._log(trainer)
        return out

    def _sync(self, trainer: Any) -> None:
        """The trainer's model for the ``live`` entry, and its step as the policy version (versions only go up)."""
        if self.live is not None and trainer is not None:
            LIVE_MODELS.register(self.live, trainer.model, trainer.processing_class)
        step = getattr(getattr(trainer, "state", None), "global_step", None)
        if isinstance(step, int) and (self.client.policy_version is None or step > self.client.policy_version):
            self._guard(lambda: self.client.set_policy_version(step))

    def _guard(self, call: Any) -> Any:
        """A call to the cluster; what is not already a ``ClientError`` (a closed connection) becomes one line."""
        try:
            return call()
        except ClientError:
            raise
        except Exception as e:
            raise ClientError(f"rollout_func: the cluster cannot be reached ({type(e).__name__}: {e})") from None

    def _submit(self, groups: list[_Group], sizes: list[int]) -> list[tuple[SyncBatch, list[int]]]:
        """Submit ``sizes[i]`` rollouts of each group's row: one batch per distinct size (every group a task of
        it, ``repeats`` = the size), so one call usually is one batch; returns each batch and its groups."""
        by_size: dict[int, list[int]] = {}
        for i, n in enumerate(sizes):
            if n:
                by_size.setdefault(n, []).append(i)
        batches = []
        for n, members in by_size.items():
            rows = [self.index.rows[groups[i].row] for i in members]
            batch = self._guard(
                lambda rows=rows, n=n: self.client.submit(
                    rows, repeats=n, agent=self.agent, max_staleness=self.max_staleness
                )
            )
            batches.append((batch, members))
        return batches

    def _gather(self, submitted: list[tuple[SyncBatch, list[int]]], sizes: list[int]) -> dict[int, list[Any]]:
        """Each group's rows of one round (``aabb`` order within a batch)."""
        out: dict[int, list[Any]] = {}
        for batch, members in submitted:
            rows = self._guard(batch.gather)
            n = sizes[members[0]]
            for k, i in enumerate(members):
                out[i] = rows[k * n : (k + 1) * n]
        return out

    def _run(self, groups: list[_Group]) -> None:
        sizes = [g.size for g in groups]
        got = self._gather(self._submit(groups, sizes), sizes)
        for i, g in enumerate(groups):
            g.rows = [self._ok(r) for r in got[i]]
            g.failures = {k: r for k, r in enumerate(got[i]) if g.rows[k] is None}

    def _ok(self, row: dict[str, Any]) -> dict[str, Any] | None:
        self.counts.rollouts += 1
        if "error_class" in row:
            self.counts.failed += 1
            log.info("trainer.rollout_failed", error_class=row["error_class"], error=str(row.get("error"))[:200])
            return None
        return row

    def _retry(self, groups: list[_Group]) -> None:
        """Run each group's failed rollouts again (new tasks), up to ``retries`` rounds; all groups at once."""
        for _ in range(self.policy.retries):
            sizes = [len(g.failed) for g in groups]
            if not any(sizes):
                return
            self.counts.retried += sum(sizes)
            got = self._gather(self._submit(groups, sizes), sizes)
            for i, rows in got.items():
                for slot, row in zip(groups[i].failed, rows, strict=True):
                    groups[i].rows[slot] = self._ok(row)
                    groups[i].failures[slot] = row

    def _settle(self, groups: list[_Group], *, taken: set[int]) -> list[_Group]:
        """Groups still short after their retries: masked, or replaced by the next rows' groups (retried too)."""
        if self.policy.on_failure == "mask":
            self.counts.masked += sum(len(g.failed) for g in groups)
            return groups
        refills = self.policy.refills
        while True:
            short = [i for i, g in enumerate(groups) if g.failed]
            if not short:
                return groups
            if refills < len(short):
                errors = "; ".join(str(r) for r in self._errors(groups, short))
                raise ClientError(
                    f"rollout_func: {len(short)} groups still failed after {self.policy.retries} retries and "
                    f"{self.policy.refills} refills (a systematic failure, not one bad rollout): {errors}"
                )
            refills -= len(short)
            fresh = []
            for i in short:
                row = self._next_row(groups[i].row, taken)
                taken.add(row)
                fresh.append(_Group(row, groups[i].size))
            self.counts.dropped_groups += len(short)
            self.counts.refilled_groups += len(short)
            self._run(fresh)
            self._retry(fresh)
            for i, g in zip(short, fresh, strict=True):
                groups[i] = g

    def _errors(self, groups: list[_Group], short: list[int]) -> list[str]:
        return [f"row {groups[i].row}: {len(groups[i].failed)} of {groups[i].size} failed" for i in short]

    def _next_row(self, after: int, taken: set[int]) -> int:
        """The next row of the dataset after ``after`` not in this call yet (cyclic; any row if all are)."""
        n = len(self.index.rows)
        for k in range(1, n + 1):
            candidate = (after + k) % n
            if candidate not in taken:
                return candidate
        return (after + 1) % n

    # ------------------------------------------------------------------------------------------ the answer

    def _output(self, groups: list[_Group]) -> dict[str, list[Any]]:
        rows = [r for g in groups for r in g.rows]
        self.last_rows = rows
        seqs = [sequence(r) if r is not None else None for r in rows]
        fallback = next((s for s in seqs if s is not None), None)
        parts = [components(r) if r is not None else {"reward": 0.0} for r in rows]
        names = sorted({k for p in parts for k in p if k != "reward"})
        out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
        for s in seqs:
            s = s if s is not None else _masked(fallback)
            out["prompt_ids"].append(s.prompt_ids)
            out["completion_ids"].append(s.completion_ids)
            out["logprobs"].append(s.logprobs)
            out["env_mask"].append(s.env_mask)
        out["gym_reward"] = [p["reward"] for p in parts]
        for name in names:
            out[f"gym_{name}"] = [p.get(name) for p in parts]
        return out

    def _log(self, trainer: Any) -> None:
        c = self.counts
        log.info("trainer.rollouts", **vars(c))
        metrics = getattr(trainer, "_metrics", None)  # TRL averages these into its logs at each logging step
        if metrics is not None:
            train = metrics["train"]
            for k in ("failed", "retried", "dropped_groups", "refilled_groups", "masked"):
                train[f"gym_runtime/{k}"].append(float(getattr(c, k)))


def _masked(like: TokenSequence | None) -> TokenSequence:
    """A failed member kept under ``on_failure="mask"``: one token, mask 0 (no loss), reward 0."""
    prompt = like.prompt_ids if like is not None else [0]
    token = like.completion_ids[-1] if like is not None and like.completion_ids else 0
    return TokenSequence(prompt, [token], [0], [0.0], [])


def _written(g: _Group) -> list[dict[str, Any]]:
    """A group's rows as the training rows file has them: a masked member as its last failure row."""
    return [r if r is not None else g.failures.get(k, {}) for k, r in enumerate(g.rows)]
