"""Where rows come from besides JSONL: Parquet and JSON files and Hugging Face dataset ids.

``prepare`` reads its sources here, and ``validate`` checks rows read the same way, so both
take exactly the same arguments. ``datasets`` (the ``data`` extra) is imported on first use.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from gym_runtime.config import Config
from gym_runtime.errors import UserError
from gym_runtime.plugins import load_plugin

_decoder = msgspec.json.Decoder()


def read_jsonl(path: Path) -> Iterator[tuple[int, Any | msgspec.DecodeError]]:
    """(line number, row or the decode error) for each non-blank line."""
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, _decoder.decode(line)
            except msgspec.DecodeError as e:
                yield lineno, e


DATASETS_FILE_TYPES = {".parquet": "parquet", ".json": "json"}


class PrepareError(UserError):
    """A user mistake in prepare's arguments or sources (one line, exit 2)."""


class Source(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One input as given on the command line, and what was read from it."""

    spec: str
    kind: str  # jsonl | parquet | json | hub | hub_file | env (an agent's environment's own dataset)
    agent: str | None = None
    role: str | None = None  # "validation": every row goes to validation.jsonl (NeMo Gym's dataset types)
    split: str | None = None
    revision: str | None = None
    rows: int = 0


def parse_source(text: str) -> Source:
    """``[AGENT=]PATH`` or ``[AGENT=]hf:OWNER/NAME[@REV][:SPLIT]`` / ``hf:OWNER/NAME[@REV]/FILE``,
    or ``AGENT=env[:SPLIT]``: the dataset of the environment the agent runs (e.g. a verifiers environment's)."""
    agent, sep, spec = text.partition("=")
    if not sep or "/" in agent or not agent:
        agent, spec = "", text
    if spec == "env" or spec.startswith("env:"):
        if not agent:
            raise PrepareError(f"{spec}: name the agent whose environment's dataset to read (AGENT=env[:SPLIT])")
        return Source(spec=spec, kind="env", agent=agent, split=spec.partition(":")[2] or "train")
    path = Path(spec)
    if not spec.startswith("hf:") and (path.exists() or path.suffix in (".jsonl", *DATASETS_FILE_TYPES)):
        kind = "jsonl" if path.suffix == ".jsonl" else DATASETS_FILE_TYPES.get(path.suffix)
        if kind is None:
            raise PrepareError(f"{spec}: unsupported file type (use .jsonl, .json or .parquet)")
        return Source(spec=spec, kind=kind, agent=agent or None)
    repo = spec.removeprefix("hf:")
    parts = repo.split("/")
    if len(parts) < 2 or not all(parts[:2]):
        env = f"; {agent}=env[:SPLIT] reads the dataset of the agent's environment (a verifiers one's)" if agent else ""
        raise PrepareError(f"{spec}: no such file, and not a Hugging Face dataset id (OWNER/NAME){env}")
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


def read_source(src: Source, cfg: Config | None = None) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each row; a JSONL line that is not JSON yields its decode error."""
    if src.kind == "env":
        yield from _env_rows(src, cfg)
        return
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


def _env_rows(src: Source, cfg: Config | None) -> Iterator[tuple[str, Any]]:
    """The rows of an agent's environment's own dataset: its module's ``dataset_rows(options, split)``, or
    its resource's (an environment that lists its own tasks, an ORS one's) with that resource's options."""
    if cfg is None or src.agent not in cfg.agents:
        raise PrepareError(f"{src.agent}={src.spec}: needs a config naming the agent {src.agent!r}")
    entry = cfg.agents[src.agent]
    rows_of = getattr(load_plugin("agent", entry.agent, f"agents.{src.agent}.agent"), "dataset_rows", None)
    options = entry.options
    res = cfg.resources.get(entry.resource) if entry.resource else None
    if rows_of is None and res is not None and res.server:
        where = f"resources.{entry.resource}.server"
        rows_of = getattr(load_plugin("resource", res.server, where), "dataset_rows", None)
        options = res.options
    if rows_of is None:
        raise PrepareError(
            f"{src.agent}={src.spec}: neither agent {entry.agent} nor its resource has a dataset of its own"
            " (no dataset_rows)"
        )
    try:
        rows = rows_of(options, src.split or "train")
    except ValueError as e:
        raise PrepareError(f"{src.agent}={src.spec}: {e}") from None
    for i, row in enumerate(rows):
        yield f"{src.agent}={src.spec}[{i}]", row
