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

import hashlib
import json
import os
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from gym_runtime.config import Config
from gym_runtime.data.validation import AGENT_REF_TYPE, Report, TaskChecker, check_rows, read_jsonl

DATASETS_FILE_TYPES = {".parquet": "parquet", ".json": "json"}


class PrepareError(ValueError):
    """A user mistake in prepare's arguments or sources (one line, exit 2)."""


class InvalidRows(ValueError):
    """Rows failed validation; ``problems`` lists ``where: reason`` for each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(f"{len(problems)} problems in the input rows (nothing was written)")
        self.problems = problems


class Source(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One input as given on the command line, and what was read from it."""

    spec: str
    kind: str  # jsonl | parquet | json | hub | hub_file
    agent: str | None = None
    role: str | None = None  # "validation": every row goes to validation.jsonl (NeMo Gym's dataset types)
    split: str | None = None
    revision: str | None = None
    rows: int = 0


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


def parse_source(text: str) -> Source:
    """``[AGENT=]PATH`` or ``[AGENT=]hf:OWNER/NAME[@REV][:SPLIT]`` / ``hf:OWNER/NAME[@REV]/FILE``."""
    agent, sep, spec = text.partition("=")
    if not sep or "/" in agent or not agent:
        agent, spec = "", text
    path = Path(spec)
    if not spec.startswith("hf:") and (path.exists() or path.suffix in (".jsonl", *DATASETS_FILE_TYPES)):
        kind = "jsonl" if path.suffix == ".jsonl" else DATASETS_FILE_TYPES.get(path.suffix)
        if kind is None:
            raise PrepareError(f"{spec}: unsupported file type (use .jsonl, .json or .parquet)")
        return Source(spec=spec, kind=kind, agent=agent or None)
    repo = spec.removeprefix("hf:")
    parts = repo.split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise PrepareError(f"{spec}: no such file, and not a Hugging Face dataset id (OWNER/NAME)")
    repo_id, rest = "/".join(parts[:2]), "/".join(parts[2:])
    split = None
    if not rest and ":" in repo_id.split("/")[1]:
        repo_id, split = repo_id.rsplit(":", 1)
    revision = None
    if "@" in repo_id:
        repo_id, revision = repo_id.split("@", 1)
    if rest:
        return Source(spec=f"{repo_id}/{rest}", kind="hub_file", agent=agent or None, revision=revision)
    return Source(spec=repo_id, kind="hub", agent=agent or None, split=split or "train", revision=revision)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:  # the `data` extra is not installed
        raise PrepareError(
            "Parquet, JSON and Hugging Face sources need the `datasets` library: pip install 'gym-runtime[data]'"
        ) from None
    datasets.disable_progress_bars()  # stdout/stderr stay ours: one summary, problems as lines
    return datasets


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


def _through_datasets(src: Source) -> Iterator[tuple[str, Any]]:
    """Rows of a Parquet/JSON file or a hub dataset, loaded by ``datasets``."""
    ds_lib = _datasets()
    try:
        if src.kind == "hub":
            ds = ds_lib.load_dataset(src.spec, split=src.split, revision=src.revision, token=_token())
        else:
            with tempfile.TemporaryDirectory(prefix="gym-prepare-") as cache:
                ds = ds_lib.load_dataset(src.kind, data_files=src.spec, split="train", cache_dir=cache)
                rows = ds.to_list()
    except PrepareError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types (FileNotFound, Arrow, hub errors)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PrepareError(f"{src.spec}: cannot be read through datasets: {first}") from None
    if src.kind == "hub":
        rows = ds.to_list()
        src.revision = src.revision or _hub_commit(src.spec)
    for i, row in enumerate(rows):
        yield f"{src.spec}[{i}]", _drop_nulls(row)


def _hub_commit(repo_id: str) -> str | None:
    try:
        from huggingface_hub import HfApi

        return HfApi(token=_token()).dataset_info(repo_id).sha
    except Exception:  # noqa: BLE001 - the revision is informative; an offline lookup must not fail the run
        return None


def _hub_file(src: Source) -> Path:
    _datasets()
    from huggingface_hub import hf_hub_download

    repo_id, filename = "/".join(src.spec.split("/")[:2]), "/".join(src.spec.split("/")[2:])
    try:
        return Path(hf_hub_download(repo_id, filename, repo_type="dataset", revision=src.revision, token=_token()))
    except Exception as e:  # noqa: BLE001 - hub errors come in many types; the user gets one line
        raise PrepareError(f"{src.spec}: cannot download from the Hugging Face Hub: {str(e).splitlines()[0]}") from None


def read_source(src: Source) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each row; a JSONL line that is not JSON yields its decode error."""
    if src.kind in ("jsonl", "hub_file"):
        path = Path(src.spec) if src.kind == "jsonl" else _hub_file(src)
        if not path.is_file():
            raise PrepareError(f"{src.spec}: file not found")
        if src.kind == "jsonl":
            src.revision = _sha256(path)
        for n, row in read_jsonl(path):
            yield f"{src.spec}:{n}", row
        return
    if src.kind != "hub":
        if not Path(src.spec).is_file():
            raise PrepareError(f"{src.spec}: file not found")
        src.revision = _sha256(Path(src.spec))
    yield from _through_datasets(src)


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
        for where, row in read_source(src):
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
    for name in sorted(by_agent):
        rows = by_agent[name]
        rng.shuffle(rows)
        n_val = round(len(rows) * opts.val_fraction)
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
    return Result(train=blended, validation=validation, metadata=metadata, problems=report.problems)


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
    from gym_runtime.config import nemo as nemo_config

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
