"""Turn raw or Hugging Face data into validated, ``agent_ref``-tagged train/validation JSONL.

The steps, in order (each deterministic for a given ``seed``):

1. **Read** every source. A ``.jsonl`` file is read line by line (rows exactly as
   written, problems as ``file:line``); ``.parquet`` / ``.json`` files and Hugging
   Face dataset ids go through the ``datasets`` library (extra ``data``; hub
   downloads use ``HF_TOKEN``). Arrow fills a key that some rows lack with null,
   so null values are dropped from those rows (a real null in such a source is
   dropped too). ``hf:OWNER/NAME[@REV]/path/file.jsonl`` downloads that one file
   and reads it as JSONL, as NeMo Gym's ``artifact_fpath`` does.
2. **Validate** each row against the environment it routes to (``validation``);
   a source given as ``AGENT=SRC`` routes its rows without ``agent_ref`` to AGENT.
3. **Tag** each row with ``agent_ref: {type: responses_api_agents, name}``.
4. **Deduplicate** per agent on the row's canonical JSON (the first copy stays).
5. **Split** per agent: shuffled with the seed, ``round(n * val_fraction)`` rows
   go to validation, so every environment is represented in both.
6. **Blend** the train rows by ``weights`` (keyed by agent name): the largest
   set whose mix matches the weights without repeating a row, i.e. every agent
   is downsampled to ``floor(N * w)`` with ``N = min(available / w)``.
7. **Shuffle** each output deterministically and write ``train.jsonl``,
   ``validation.jsonl`` and ``metadata.json`` (counts per agent, seed, weights,
   sources with their revisions: a sha256 for local files, the commit for the hub).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from gym_runtime.config import Config
from gym_runtime.config import nemo_gym as nemo_config
from gym_runtime.data.routing import AGENT_REF_TYPE
from gym_runtime.data.sources import PrepareError, Source, read_source
from gym_runtime.data.validation import Report, TaskChecker, check_rows
from gym_runtime.errors import UserError


class InvalidRows(UserError):
    """Rows failed validation; ``problems`` lists ``where: reason`` for each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(f"{len(problems)} problems in the input rows (nothing was written)")
        self.problems = problems


class Options(msgspec.Struct, kw_only=True):
    val_fraction: float = 0.0
    seed: int = 0
    weights: dict[str, float] | None = None
    drop_invalid: bool = False  # write the valid rows anyway (the problems are still reported)


@dataclass(slots=True)
class Result:
    train: list[dict[str, Any]]
    validation: list[dict[str, Any]]
    metadata: dict[str, Any]
    problems: list[str] = field(default_factory=list)


def parse_weights(text: str) -> dict[str, float]:
    """``a=0.7,b=0.3`` → ``{"a": 0.7, "b": 0.3}``."""
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            w = float(value)
        except ValueError:
            w = -1.0
        if not sep or not name or w < 0:
            raise PrepareError(f"--weights {text!r}: expected AGENT=WEIGHT[,AGENT=WEIGHT...] with weights >= 0")
        weights[name.strip()] = w
    if not weights or sum(weights.values()) <= 0:
        raise PrepareError(f"--weights {text!r}: at least one weight must be positive")
    return weights


def _canonical(row: dict[str, Any]) -> bytes:
    return json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def blend_counts(available: dict[str, int], weights: dict[str, float]) -> dict[str, int]:
    """Rows to take per agent: the largest mix matching ``weights`` without repeating rows."""
    total_w = sum(weights.values())
    share = {a: weights.get(a, 0.0) / total_w for a in available}
    n = min((available[a] / s for a, s in share.items() if s > 0), default=0.0)
    return {a: min(available[a], int(n * s + 1e-9)) for a, s in share.items()}


def prepare(cfg: Config, sources: list[Source], opts: Options, *, agent: str | None = None) -> Result:
    """Read, validate, tag, dedupe, split, blend and shuffle; nothing is written here."""
    if not 0.0 <= opts.val_fraction < 1.0:
        raise PrepareError(f"--val-fraction {opts.val_fraction}: must be at least 0 and below 1")
    if opts.weights is not None:
        unknown = [a for a in opts.weights if a not in cfg.agents]
        if unknown:
            raise PrepareError(f"--weights: {', '.join(unknown)} not agents of this config ({', '.join(cfg.agents)})")
    for s in sources:
        if s.agent is not None and s.agent not in cfg.agents:
            raise PrepareError(
                f"{s.agent}={s.spec}: {s.agent!r} is not an agent of this config ({', '.join(cfg.agents)})"
            )
    by_agent: dict[str, list[dict[str, Any]]] = {}
    fixed_val: dict[str, list[dict[str, Any]]] = {}
    seen: dict[str, set[bytes]] = {}
    duplicates: dict[str, int] = {}
    report = Report()
    invalid = 0
    for src in sources:
        checker = TaskChecker(cfg, agent=agent or src.agent)
        for where, row in read_source(src, cfg):
            src.rows += 1
            before = len(report.problems)
            one = check_rows(checker, [(where, row)], Report())
            report.rows += 1
            report.problems += one.problems
            if len(report.problems) > before or not one.agents:
                invalid += 1
                continue
            (name,) = one.agents
            row = dict(row)
            row["agent_ref"] = {"type": AGENT_REF_TYPE, "name": name}
            key = _canonical(row)
            if key in seen.setdefault(name, set()):
                duplicates[name] = duplicates.get(name, 0) + 1
                continue
            seen[name].add(key)
            (fixed_val if src.role == "validation" else by_agent).setdefault(name, []).append(row)
    if report.problems and not opts.drop_invalid:
        raise InvalidRows(report.problems)
    if not by_agent and not fixed_val:
        raise PrepareError("no valid rows in the sources")
    for name in fixed_val:
        by_agent.setdefault(name, [])

    rng = random.Random(opts.seed)
    train: dict[str, list[dict[str, Any]]] = {}
    validation: list[dict[str, Any]] = []
    notes: list[str] = []
    for name in sorted(by_agent):
        rows = by_agent[name]
        rng.shuffle(rows)
        n_val = round(len(rows) * opts.val_fraction)
        if opts.val_fraction and not n_val:  # a small input: one row, rather than a validation split with none
            n_val = 1 if len(rows) > 1 else 0
            if not n_val:
                notes.append(f"{name}: 1 row, none left for validation (--val-fraction {opts.val_fraction:g})")
        validation += rows[:n_val] + fixed_val.get(name, [])
        train[name] = rows[n_val:]
    available = {a: len(r) for a, r in train.items()}
    if opts.weights is not None:
        missing = [a for a in available if a not in opts.weights]
        if missing:
            raise PrepareError(f"--weights: no weight for {', '.join(missing)} (give 0 to leave an agent out)")
        take = blend_counts(available, opts.weights)
    else:
        take = available
    blended = [row for a in sorted(train) for row in train[a][: take[a]]]
    rng.shuffle(blended)
    rng.shuffle(validation)
    counts = {
        a: {
            "rows": len(by_agent[a]) + len(fixed_val.get(a, [])) + duplicates.get(a, 0),
            "duplicates_dropped": duplicates.get(a, 0),
            "train": take[a],
            "train_available": available[a],
            "validation": len(by_agent[a]) + len(fixed_val.get(a, [])) - available[a],
        }
        for a in sorted(by_agent)
    }
    metadata = {
        "seed": opts.seed,
        "val_fraction": opts.val_fraction,
        "weights": opts.weights,
        "train": len(blended),
        "validation": len(validation),
        "invalid_rows_dropped": invalid,
        "agents": counts,
        "sources": [msgspec.to_builtins(s) for s in sources],
    }
    return Result(train=blended, validation=validation, metadata=metadata, problems=report.problems + notes)


def write(result: Result, out_dir: str | Path) -> list[Path]:
    """``train.jsonl``, ``validation.jsonl`` and ``metadata.json`` under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in (("train.jsonl", result.train), ("validation.jsonl", result.validation)):
        path = out / name
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        paths.append(path)
    meta = out / "metadata.json"
    meta.write_text(json.dumps(result.metadata, indent=2) + "\n")
    paths.append(meta)
    return paths


def nemo_sources(config_path: str | Path, types: tuple[str, ...] = ("train", "validation")) -> list[Source]:
    """A NeMo Gym config's ``datasets:`` entries as sources, the way ``ng_prepare_data`` takes them.

    Each entry of a selected ``type`` is routed to its agent; ``validation`` entries go
    to ``validation.jsonl`` whole. Its ``jsonl_fpath`` is used when that file exists
    (relative to the current directory, NeMo Gym's root, or the config's directory
    and its parents); else its Hugging Face source (``huggingface_identifier`` or
    ``source: {type: huggingface}``: ``repo_id`` and ``artifact_fpath`` when given).
    """
    base = Path(config_path).resolve().parent
    sources: list[Source] = []
    for agent, entries in nemo_config.datasets(config_path).items():
        for e in entries:
            if not isinstance(e, dict) or e.get("type") not in types:
                continue
            role = "validation" if e.get("type") == "validation" else None
            what = f"{agent} dataset {e.get('name')!r}"
            local = e.get("jsonl_fpath")
            if isinstance(local, str):
                found = next(
                    (c for c in (Path.cwd() / local, base / local, *(p / local for p in base.parents)) if c.is_file()),
                    None,
                )
                if found is not None:
                    sources.append(Source(spec=str(found), kind="jsonl", agent=agent, role=role))
                    continue
            hub = e.get("huggingface_identifier")
            if hub is None and isinstance(e.get("source"), dict) and e["source"].get("type") == "huggingface":
                hub = e["source"]
            if not isinstance(hub, dict) or not hub.get("repo_id"):
                raise PrepareError(f"{what}: {local or 'no jsonl_fpath'} not found and no Hugging Face source")
            artifact = hub.get("artifact_fpath")
            if artifact:
                sources.append(
                    Source(
                        spec=f"{hub['repo_id']}/{artifact}",
                        kind="hub_file",
                        agent=agent,
                        role=role,
                        revision=hub.get("revision"),
                    )
                )
            else:
                sources.append(
                    Source(
                        spec=hub["repo_id"],
                        kind="hub",
                        agent=agent,
                        role=role,
                        split="validation" if role else "train",
                        revision=hub.get("revision"),
                    )
                )
    if not sources:
        raise PrepareError(f"{config_path}: no datasets entries of type {', '.join(types)}")
    return sources
