"""Rows as a trainer reads them: one token sequence per rollout, and a dataset that finds each prompt's row.

``sequence`` rebuilds a rollout from the output items that carry token ids (TRL's NeMo Gym rule): the first
turn's prompt ids; then, turn after turn, the ids the environment added between two generations (tool output,
the chat template) with mask 0 and logprob 0, and each generation's ids with mask 1 and its logprobs. Every
turn's prompt must start with everything before it (the token-in adapters make it so).

``RowIndex`` is how a trainer that is handed only prompts (TRL's ``rollout_func``) gets the row back: the
dataset it builds carries each row's position in the prompt itself (``gym_row`` on every message), so two rows
whose text is the same are never confused; a prompt without the key is matched by its text, once.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gym_runtime.errors import ClientError

__all__ = [
    "BRANCH_KEEP_S",
    "ROW_KEY",
    "RowIndex",
    "TokenSequence",
    "branch_keep_s",
    "branched",
    "check_agent",
    "check_live",
    "components",
    "masked",
    "prompt_ids",
    "runs",
    "sequence",
]

ROW_KEY = "gym_row"  # the key on a dataset prompt's messages that names its row
BRANCH_KEEP_S = 600.0  # ``branch_at``: how long a group's parent is kept for its branches (and their retries)


@dataclass
class TokenSequence:
    """One rollout as token ids: what a trainer's loss needs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    env_mask: list[int]  # 1: the policy generated the token; 0: the environment or the template added it
    logprobs: list[float]  # the sampling policy's, per token (0.0 where env_mask is 0)
    policy_versions: list[int]  # of each generation, in order


def sequence(row: dict[str, Any]) -> TokenSequence:
    """A successful row's token sequence; ``ClientError`` when it has no token ids or they are not contiguous."""
    prompt: list[int] | None = None
    completion: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    versions: list[int] = []
    for item in (row.get("response") or {}).get("output", []):
        if "generation_token_ids" not in item:
            continue
        ids = list(item["prompt_token_ids"])
        if prompt is None:
            prompt = ids
        else:
            seen = prompt + completion
            if ids[: len(seen)] != seen:
                raise ClientError(
                    f"row of task {row.get('_ng_task_index')}: a turn's prompt token ids do not extend the turns "
                    "before it (use a token-in adapter: vllm, vllm_engine, transformers)"
                )
            env = ids[len(seen) :]
            completion += env
            mask += [0] * len(env)
            lps += [0.0] * len(env)
        gen = list(item["generation_token_ids"])
        completion += gen
        mask += [1] * len(gen)
        lps += [float(x) for x in item["generation_log_probs"]]
        if item.get("policy_version") is not None:
            versions.append(int(item["policy_version"]))
    if prompt is None:
        raise ClientError(
            f"row of task {row.get('_ng_task_index')} has no token ids: set return_token_ids: true on the policy's "
            "model entry (the transformers adapter has it on)"
        )
    return TokenSequence(prompt, completion, mask, lps, versions)


def branched(row: dict[str, Any], turn: int) -> TokenSequence:
    """A row's sequence split at model turn ``turn`` (a branch point, ``Client.branch``): its prompt is everything up
    to the next generation's (the task's prompt, turns 1 to ``turn``, their tool outputs: the prefix a branch point's
    rows share), its completion the rest; ``ClientError`` when the row has no generation after that turn."""
    seq = sequence(row)
    gens = [i for i in (row.get("response") or {}).get("output", []) if "generation_token_ids" in i]
    if len(gens) <= turn:
        raise ClientError(
            f"row of task {row.get('_ng_task_index')}: {len(gens)} model turns, none after the branch point {turn}"
        )
    cut = len(gens[turn]["prompt_token_ids"]) - len(seq.prompt_ids)
    done = sum(1 for g in gens[:turn] if g.get("policy_version") is not None)
    return TokenSequence(
        seq.prompt_ids + seq.completion_ids[:cut],
        seq.completion_ids[cut:],
        seq.env_mask[cut:],
        seq.logprobs[cut:],
        seq.policy_versions[done:],
    )


def branch_keep_s(checkpoint_ttl_s: float) -> float:
    """How long a trainer keeps a group's parent checkpoints for its branches: ``BRANCH_KEEP_S``, within the
    config's ``jetstream.checkpoint_ttl_s`` (0: no cap)."""
    return min(BRANCH_KEEP_S, checkpoint_ttl_s or BRANCH_KEEP_S)


def prompt_ids(row: dict[str, Any], tokenizer: Any) -> list[int]:
    """A task row's prompt as token ids through ``tokenizer``'s chat template (the prompt of a member that has no
    sequence of its own: it is masked, so only its length matters to the loss); ``[0]`` when it cannot be rendered."""
    given = row.get("input")
    messages = _messages(given if "error_class" in row and isinstance(given, dict) else row)
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return [int(x) for x in ids] or [0]
    except Exception:  # no tokenizer, or a template that cannot render the row: the prompt is masked out anyway
        return [0]


def masked(like: TokenSequence | None, row: dict[str, Any], tokenizer: Any) -> TokenSequence:
    """A member with no tokens to train on: one token, mask 0; its prompt its own group's (``like``: a member's
    sequence), else its row's (``prompt_ids``)."""
    if like is not None:
        return TokenSequence(like.prompt_ids, like.completion_ids[-1:] or [0], [0], [0.0], [])
    eos = getattr(tokenizer, "eos_token_id", None)
    return TokenSequence(prompt_ids(row, tokenizer), [eos if isinstance(eos, int) else 0], [0], [0.0], [])


def components(row: dict[str, Any]) -> dict[str, float]:
    """The reward and its named parts: the verifier's numeric top-level fields (NeMo Gym's verifier extras)."""
    out = {"reward": float(row.get("reward", 0.0))}
    for k, v in row.items():
        if k.startswith("_") or k == "reward" or isinstance(v, bool) or not isinstance(v, int | float):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


def check_agent(agents: Sequence[str], agent: str | None) -> None:
    """A trainer adapter's ``agent`` must be one of the config's (one line, before anything is submitted)."""
    if agent is not None and agent not in agents:
        raise ClientError(f"unknown agent {agent!r}: the config has {', '.join(agents) or 'no agents'}")


def check_live(models: Mapping[str, Any], live: str | None) -> None:
    """A trainer adapter's ``live`` must be the ``live`` name of one of the config's model entries, when it has any
    (one line naming the unknown one and the known ones, before anything is submitted: else every rollout fails for
    it). A config with no ``live`` entry serves its policy elsewhere: the name is then unused, not a mistake."""
    known = sorted({n for m in models.values() if isinstance(n := getattr(m.options, "live", None), str) and n})
    if live is not None and known and live not in known:
        entries = ", ".join(repr(n) for n in known)
        raise ClientError(
            f"unknown live model {live!r}: the config's model entries serve {entries} (set live= to one of them, "
            "or live=None when the policy is served elsewhere)"
        )


def runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive runs of one value: ``[3, 3, 5, 5, 3]`` -> ``[(3, 2), (5, 2), (3, 1)]`` (TRL's groups, in order)."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][0] == i:
            out[-1] = (i, out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _messages(row: dict[str, Any]) -> list[dict[str, str]]:
    given = (row.get("responses_create_params") or {}).get("input")
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if isinstance(given, list):
        return [
            {"role": str(m.get("role", "user")), "content": _text(m.get("content"))}
            for m in given
            if isinstance(m, dict) and "role" in m
        ]
    return [{"role": "user", "content": json.dumps(row, sort_keys=True, default=str)}]


def _key(messages: Any) -> str:
    if isinstance(messages, str):
        return messages
    return json.dumps([(m.get("role"), _text(m.get("content"))) for m in messages])


class RowIndex:
    """The rows a trainer trains on, and the way back from a prompt to its row."""

    def __init__(self, rows: Sequence[dict[str, Any]]) -> None:
        if not rows:
            raise ClientError("no rows: the trainer's dataset is built from the rows it trains on")
        self.rows = list(rows)
        self._by_text: dict[str, list[int]] = {}
        for i, row in enumerate(self.rows):
            self._by_text.setdefault(_key(_messages(row)), []).append(i)

    def dataset(self) -> list[dict[str, Any]]:
        """One ``{"prompt": messages}`` per row (``datasets.Dataset.from_list``): the row's own messages, each
        carrying ``gym_row`` (its position), which chat templates ignore."""
        return [{"prompt": [{**m, ROW_KEY: i} for m in _messages(row)]} for i, row in enumerate(self.rows)]

    def find(self, prompt: Any) -> int:
        """The position of the row ``prompt`` came from; ``ClientError`` when none, or several, match."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) and prompt[0].get(ROW_KEY) is not None:
            i = prompt[0][ROW_KEY]
            if isinstance(i, int) and 0 <= i < len(self.rows):
                return i
            raise ClientError(f"prompt names row {i!r}, but the dataset has {len(self.rows)} rows")
        found = self._by_text.get(_key(prompt), []) if isinstance(prompt, str | list) else []
        if len(found) == 1:
            return found[0]
        shown = _key(prompt)[:80] if isinstance(prompt, str | list) else repr(prompt)[:80]
        if not found:
            raise ClientError(f"no row has the prompt {shown!r}: build the trainer's dataset with .dataset()")
        raise ClientError(
            f"{len(found)} rows have the prompt {shown!r}: build the trainer's dataset with .dataset() (its prompts "
            f"carry {ROW_KEY!r}), so they are not confused"
        )
