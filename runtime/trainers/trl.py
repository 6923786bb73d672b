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

Failure rows never raise into the step; the failure policy decides (``trainers.failures.FailurePolicy``, the same
for the three adapters, docs/trainer.md "Failures in training"): a policy failure is scored with its real tokens and
``policy_failure_reward``; an environment or infrastructure failure runs again (a new task: a fresh environment) up
to ``retries`` rounds, then is excluded: ``gym_reward`` None (TRL's "unscorable": out of the group's nan-aware
mean and std, advantage 0), its tokens masked, ``gym_excluded`` True. Wrap any other reward function with
``excluding`` (it must return None for those rows too: TRL excludes a completion only when every reward function
does). A group keeps its own prompt; more than ``max_excluded`` of a call's rollouts excluded is one ``ClientError``
line naming the tasks and classes. Counts reach TRL's logged metrics (``gym_runtime/*``). Mistakes (a prompt with no
row, an unknown agent or live model, a bus that is gone) are one ``ClientError`` line, raised before anything is
submitted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from gym_runtime.client.sampler import TaskSampler
from gym_runtime.client.sync import SyncBatch, SyncClient
from gym_runtime.data.rowkeys import is_runtime_key
from gym_runtime.data.sampling import task_key
from gym_runtime.errors import ClientError
from gym_runtime.live_models import LIVE_MODELS
from gym_runtime.observability import logs
from gym_runtime.trainers.arguments import checked, count, failure_policy
from gym_runtime.trainers.exhausted import stop_callback, stops
from gym_runtime.trainers.failures import FailurePolicy, Kind, Tally, has_tokens, reward_of
from gym_runtime.trainers.rows import (
    RowIndex,
    TokenSequence,
    branch_keep_s,
    branched,
    check_agent,
    check_live,
    components,
    masked,
    runs,
    sequence,
)
from gym_runtime.trainers.train_rows import TRLTrainRows
from gym_runtime.trainers.waiting import StepWait, WaitPolicy, wait_policy, watched

__all__ = ["FailurePolicy", "TRLRollouts", "TaskRepeats", "WaitPolicy", "env_reward", "excluding"]

log = logs.get("gym.trainers.trl")
# what TRL passes its reward functions itself: a refill's columns never take these names
_TRL_NAMES = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"})


def env_reward(
    prompts: Any = None, completions: Any = None, *, gym_reward: list[float | None], **_: Any
) -> list[float | None]:
    """A TRL reward function: the environment's reward of each rollout, as its verifier gave it (a policy failure's
    ``policy_failure_reward``; None for an excluded one: TRL leaves it out of the group's statistics)."""
    return list(gym_reward)


def excluding(fn: Callable[..., list[float | None]]) -> Callable[..., list[float | None]]:
    """A user's TRL reward function that returns None for the rollouts the failure policy excluded
    (``gym_excluded``): TRL leaves a completion out only when every reward function returns None for it."""

    @functools.wraps(fn)
    def wrapped(*args: Any, gym_excluded: list[bool] | None = None, **kwargs: Any) -> list[float | None]:
        got = fn(*args, gym_excluded=gym_excluded, **kwargs)
        if gym_excluded is None:
            return got
        return [None if out else r for r, out in zip(got, gym_excluded, strict=True)]

    return wrapped


@dataclass
class _Group:
    """One group: ``size`` rollouts of row ``row``; ``rows`` fills as results come, ``kinds`` says each one's."""

    row: int
    size: int
    parent: str = ""  # ``branch_at``: the rollout its members branch from (``batch:task:rollout``)
    rows: list[dict[str, Any]] = field(default_factory=list)
    kinds: list[Kind] = field(default_factory=list)

    @property
    def excluded(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "excluded"]


class TRLRollouts:
    """TRL's ``rollout_func``: ``trainer.rollout_func(prompts, trainer)`` runs gym-runtime rollouts.

    ``client``: a ``SyncClient`` (workers in this process for ``live``); ``rows``: the task rows trained on (the
    dataset is ``.dataset()``); ``agent``: the config's agent that runs them (needed when it has several);
    ``live``: the name of the ``transformers`` adapter entry's ``live`` model to register ``trainer.model`` under
    (None: the policy is served elsewhere); ``failures``: the failure policy; ``max_staleness``: passed to ``submit``;
    ``rows_path``: a file the rows handed to TRL are appended to, with their step, group, reward and TRL's advantage
    (``train_rows``); ``branch_at``: each group a tree (``_run_branched``): one rollout of its row, then the rest of
    the group branched from it at that model turn, so every member shares the prefix and TRL's advantages are
    computed among the continuations (the prefix is each member's prompt); ``waits``: how long a call waits for its
    rollouts (``trainers.waiting.WaitPolicy``: a line naming what the slowest wait on after ``say_after_s``, the call
    failed with it at ``bound_s``).
    """

    @checked
    def __init__(
        self,
        client: SyncClient,
        rows: Sequence[dict[str, Any]],
        *,
        agent: str | None = None,
        live: str | None = "policy",
        failures: FailurePolicy | None = None,
        max_staleness: int | None = None,
        rows_path: str | None = None,
        sampler: TaskSampler | None = None,
        branch_at: int | None = None,
        waits: WaitPolicy | None = None,
    ) -> None:
        self.failures = failure_policy(failures)
        self.branch_at = None if branch_at is None else count("branch_at", branch_at, 1)
        self.waits = wait_policy(waits)
        self._watch = StepWait(self.waits)  # the call's wait for its rollouts: every round's, retries' and refills'
        self.max_staleness = None if max_staleness is None else count("max_staleness", max_staleness, 0)
        config = client.client.config
        check_agent(list(config.agents), agent)
        check_live(config.models, live)
        self.client = client
        self.index = RowIndex(rows)
        self.agent = agent
        self.live = live
        self.counts = Tally()  # the last call's
        self.totals = Tally()  # all calls'
        self.last_rows: list[dict[str, Any]] = []  # the last call's rows, in TRL's order (failure rows included)
        self.train_rows = TRLTrainRows(rows_path) if rows_path is not None else None
        if sampler is not None and len(sampler.keys) != len(self.index.rows):
            raise ClientError(f"sampler: made for {len(sampler.keys)} rows, the trainer's dataset has {len(rows)}")
        self.sampler = sampler  # learns from every group; ``use_sampler`` makes it choose TRL's prompts too

    def use_sampler(self, trainer: Any, *, stop_when_exhausted: bool = True) -> None:
        """TRL's train sampler replaced by ``TaskRepeats``: each generation batch's prompts chosen by ``sampler``
        (in TRL's ``RepeatSampler`` order, so each prompt still gets its own ``num_generations`` completions).
        With the sampler's ``skip_below``, training ends at the first step after which no task can teach
        (``stop_when_exhausted=False``: it goes on at the floor's exploration). Call it after building the trainer,
        before ``trainer.train()``."""
        if self.sampler is None:
            raise ClientError("use_sampler: give TRLRollouts(..., sampler=TaskSampler...) first")
        sampler = self.sampler
        if stops(sampler, stop_when_exhausted):
            trainer.add_callback(stop_callback(sampler, "trl"))

        def train_sampler(dataset: Any = None) -> TaskRepeats:
            data = trainer.train_dataset if dataset is None else dataset
            return TaskRepeats(
                sampler,
                size=len(data),
                mini_repeat_count=trainer.num_generations,
                batch_size=trainer.args.generation_batch_size // trainer.num_generations,
                repeat_count=trainer.num_iterations * trainer.args.steps_per_generation,
            )

        trainer._get_train_sampler = train_sampler

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
        self.counts = Tally()
        self._watch = StepWait(self.waits)
        groups = [_Group(row, size) for row, size in runs(found)]
        self._run(groups)
        if self.failures.refill:
            groups = self._refill(groups, taken={g.row for g in groups})
        for g in groups:
            for r, k in zip(g.rows, g.kinds, strict=True):
                self.counts.ended(r, k, f"dataset row {g.row}")
        self.totals.add(self.counts)
        if (sampler := self.sampler) is not None:  # every group's final rows (retries in), stored in the KV
            for g in groups:
                sampler.saw(g.row, g.rows)
            self._guard(lambda: self.client.spawn(sampler.flush).result())
        self._log(trainer)
        self.counts.check(self.failures, "rollout_func")
        out = self._output(groups, trainer)
        if self.train_rows is not None:  # each member's row as handed over (a failure row for a failed one)
            tasks = [task_key(self.index.rows[g.row]) for g in groups]  # the sampler's keys: view follows tasks by them
            self.train_rows.hold([g.rows for g in groups], out["gym_reward"], trainer, tasks)
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
        gathered = self._wait_for([batch for batch, _ in submitted])
        out: dict[int, list[Any]] = {}
        for (_, members), rows in zip(submitted, gathered, strict=True):
            n = sizes[members[0]]
            for k, i in enumerate(members):
                out[i] = rows[k * n : (k + 1) * n]
        return out

    def _wait_for(self, batches: list[SyncBatch]) -> list[list[dict[str, Any]]]:
        """Every batch's rows, the wait said and bounded (``waits``): the one way this call waits for rollouts."""
        handles = [batch.handle for batch in batches]

        async def every() -> list[list[dict[str, Any]]]:
            return [await h.gather() for h in handles]

        async def cancel() -> None:
            for h in handles:
                await h.cancel()

        bus = self.client.client.bus
        wait = functools.partial(
            watched, every, bus=bus, watch=self._watch, batches=lambda: {h.batch for h in handles}, cancel=cancel
        )
        return cast(list[list[dict[str, Any]]], self._guard(lambda: self.client.spawn(wait).result()))

    def _run(self, groups: list[_Group]) -> None:
        """Each group's rollouts, then its excluded members again (new tasks), up to ``retries`` rounds, all
        groups at once."""
        if self.branch_at is not None:
            self._run_branched(groups)
            return
        sizes = [g.size for g in groups]
        got = self._gather(self._submit(groups, sizes), sizes)
        for i, g in enumerate(groups):
            g.rows = list(got[i])
            g.kinds = [self._saw(r) for r in g.rows]
        for _ in range(self.failures.retries):
            sizes = [len(g.excluded) for g in groups]
            if not any(sizes):
                return
            self.counts.retried += sum(sizes)
            got = self._gather(self._submit(groups, sizes), sizes)
            for i, rows in got.items():
                for slot, row in zip(groups[i].excluded, rows, strict=True):
                    groups[i].rows[slot] = row
                    groups[i].kinds[slot] = self._saw(row)

    def _run_branched(self, groups: list[_Group]) -> None:
        """``branch_at``: one rollout of each group's row, its checkpoints kept (``BRANCH_KEEP_S``), then ``size - 1``
        branches of it at turn ``branch_at`` (``Client.branch``): the parent and its branches are the group, one
        prefix and ``size`` continuations of it. An excluded member is branched again from the same parent, up to
        ``retries`` rounds (a parent that never reached the turn with a tool call leaves its branches excluded)."""
        rows = [self.index.rows[g.row] for g in groups]
        keep = branch_keep_s(self.client.client.config.jetstream.checkpoint_ttl_s)
        batch = self._guard(
            lambda: self.client.submit(
                rows, agent=self.agent, max_staleness=self.max_staleness, keep_checkpoints_s=keep
            )
        )
        for i, (g, p) in enumerate(zip(groups, self._wait_for([batch])[0], strict=True)):
            g.parent, g.rows, g.kinds = f"{batch.batch}:{i}:0", [p], [self._saw(p)]
        self._branches(groups, [g.size - 1 for g in groups])
        for _ in range(self.failures.retries):
            sizes = [len(g.excluded) for g in groups]
            if not any(sizes):
                return
            self.counts.retried += sum(sizes)
            self._branches(groups, sizes, again=True)

    def _branches(self, groups: list[_Group], sizes: list[int], *, again: bool = False) -> None:
        """``sizes[i]`` branches of each group's parent, added to the group (``again``: in its excluded slots)."""
        submitted = [
            (g, self._guard(lambda g=g, n=n: self.client.branch(self.index.rows[g.row], **self._point(g), m=n)))
            for g, n in zip(groups, sizes, strict=True)
            if n
        ]
        for (g, _), got in zip(submitted, self._wait_for([batch for _, batch in submitted]), strict=True):
            slots = g.excluded if again else list(range(len(g.rows), len(g.rows) + len(got)))
            for slot, row in zip(slots, got, strict=True):
                if slot == len(g.rows):
                    g.rows.append(row)
                    g.kinds.append(self._saw(row))
                else:
                    g.rows[slot], g.kinds[slot] = row, self._saw(row)

    def _point(self, g: _Group) -> dict[str, Any]:
        return {
            "parent": g.parent,
            "turn": self.branch_at,
            "agent": self.agent,
            "max_staleness": self.max_staleness,
        }

    def _sequence(self, row: dict[str, Any]) -> TokenSequence | None:
        """What TRL trains on of a row: its sequence (``branch_at``: past the branch point; None: a row with no
        turn after it, masked as an excluded one is)."""
        if self.branch_at is None:
            return sequence(row)
        try:
            return branched(row, self.branch_at)
        except ClientError:
            return None

    def _saw(self, row: dict[str, Any]) -> Kind:
        k = self.counts.saw(row)
        if k != "scored":
            log.info(
                "trainer.rollout_failed",
                error_class=row.get("error_class"),
                attribution=row.get("failure_attribution"),
                then="scored" if k == "policy" else "retried or excluded",
                error=str(row.get("error"))[:200],
            )
        return k

    def _refill(self, groups: list[_Group], *, taken: set[int]) -> list[_Group]:
        """``refill=True`` only: each group with an excluded member replaced by the next row's group (run and
        retried the same way), once; what it still excludes stays excluded."""
        short = [i for i, g in enumerate(groups) if g.excluded]
        if not short:
            return groups
        fresh = []
        for i in short:
            row = self._next_row(groups[i].row, taken)
            taken.add(row)
            fresh.append(_Group(row, groups[i].size))
        self.counts.refilled_groups += len(short)
        self._run(fresh)
        for i, g in zip(short, fresh, strict=True):
            groups[i] = g
        return groups

    def _next_row(self, after: int, taken: set[int]) -> int:
        """The next row of the dataset after ``after`` not in this call yet (cyclic; any row if all are)."""
        n = len(self.index.rows)
        for k in range(1, n + 1):
            candidate = (after + k) % n
            if candidate not in taken:
                return candidate
        return (after + 1) % n

    # ------------------------------------------------------------------------------------------ the answer

    def _output(self, groups: list[_Group], trainer: Any) -> dict[str, list[Any]]:
        rows = [r for g in groups for r in g.rows]
        self.last_rows = rows
        out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
        rewards: list[float | None] = []
        parts: list[dict[str, float]] = []
        excluded: list[bool] = []
        for g in groups:
            seqs = [self._sequence(r) if k != "excluded" and has_tokens(r) else None for r, k in zip(g.rows, g.kinds)]
            own = next((s for s in seqs if s is not None), None)
            if self.branch_at is not None and len({tuple(s.prompt_ids) for s in seqs if s is not None}) > 1:
                raise ClientError(f"rollout_func: the branches of dataset row {g.row} do not share their prefix")
            for r, k, s in zip(g.rows, g.kinds, seqs, strict=True):
                tok = getattr(trainer, "processing_class", None)
                seq = s if s is not None else masked(own, self.index.rows[g.row], tok)
                out["prompt_ids"].append(seq.prompt_ids)
                out["completion_ids"].append(seq.completion_ids)
                out["logprobs"].append(seq.logprobs)
                out["env_mask"].append(seq.env_mask)
                rewards.append(reward_of(r, self.failures))
                parts.append(components(r) if k == "scored" else {})
                excluded.append(k == "excluded")
        out["gym_reward"] = rewards
        out["gym_excluded"] = excluded
        for name in sorted({k for p in parts for k in p if k != "reward"}):
            out[f"gym_{name}"] = [p.get(name) for p in parts]
        if self.failures.refill:  # each completion's own row's columns, over the dataset's (TRL merges them)
            task_rows = [self.index.rows[g.row] for g in groups for _ in g.rows]
            names = {k for t in task_rows for k in t if _column(k)}
            for name in sorted(names):
                out[name] = [t.get(name) for t in task_rows]
        return out

    def _log(self, trainer: Any) -> None:
        c = self.counts.metrics()
        if self.sampler is not None:
            c.update(self.sampler.metrics())
        log.info("trainer.rollouts", **c)
        metrics = getattr(trainer, "_metrics", None)  # TRL averages these into its logs at each logging step
        if metrics is not None:
            train = metrics["train"]
            for k, v in c.items():
                train[k].append(v)


class TaskRepeats:
    """TRL's train sampler with its prompts chosen by a ``TaskSampler``: TRL's ``RepeatSampler`` order (a chunk of
    ``batch_size`` distinct prompts, each ``mini_repeat_count`` times in a row, the chunk ``repeat_count`` times),
    each chunk picked when the dataloader reaches it, so from what the groups before it taught."""

    def __init__(
        self, sampler: TaskSampler, *, size: int, mini_repeat_count: int, batch_size: int, repeat_count: int
    ) -> None:
        if batch_size > size:
            raise ClientError(f"sampler: a generation batch of {batch_size} prompts needs as many rows ({size} given)")
        self.sampler = sampler
        self.size = size
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count

    def __iter__(self) -> Any:
        for _ in range(self.size // self.batch_size):
            chunk = self.sampler.pick(self.batch_size)
            for _ in range(self.repeat_count):
                for index in chunk:
                    yield from [index] * self.mini_repeat_count

    def __len__(self) -> int:
        return (self.size // self.batch_size) * self.batch_size * self.mini_repeat_count * self.repeat_count


def _column(name: str) -> bool:
    """A task row's key that is a dataset column a refill carries: not the runtime's, TRL's or ours."""
    return not (is_runtime_key(name) or name in _TRL_NAMES or name.startswith("gym_") or name == "prompt")
