"""``gym-runtime export --format atif IN.jsonl -o OUT.jsonl``: rollouts in another format.

ATIF (Harbor's Agent Trajectory Interchange Format, v1.8): one trajectory document a line. Rewards, task
fields, cost and provenance ride in each document's ``extra``, so ``view`` and ``diff`` read the export
whole; NeMo Gym's JSONL stays the native format.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

from gym_runtime.cli._common import check_output, log_level_option


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write rollouts in another format (ATIF: Harbor's trajectory format v1.8)")
    p.add_argument("input", metavar="IN", help="rollouts JSONL")
    p.add_argument("-o", "--output", required=True, help="the exported file (ATIF: one trajectory a line)")
    p.add_argument("--format", choices=["atif"], default="atif", help="the format (default: atif)")
    log_level_option(p)


def main(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from gym_runtime.data.atif import to_atif
    from gym_runtime.data.sidecars import batch_path
    from gym_runtime.errors import UserError

    check_output(args.output, source=args.input)
    src = Path(args.input)
    if not src.is_file():
        raise UserError(f"{src}: no such file (export reads a rollouts JSONL or an ATIF file)")
    models = _model_names(batch_path(src))
    written = 0
    tmp = Path(args.output + ".tmp")
    with tmp.open("w") as out:
        for row in _rows(src):
            prov = row.get("provenance")
            turns = prov.get("turns") if isinstance(prov, dict) else None
            entry = str(turns[0]).partition("@")[0] if isinstance(turns, list) and turns else None
            out.write(json.dumps(to_atif(row, model_name=models.get(entry or "")), ensure_ascii=False) + "\n")
            written += 1
    tmp.replace(args.output)
    print(f"{written} trajectories written to {args.output} (ATIF-v1.8)")
    return 0


def _rows(src: object) -> Iterator[dict[str, Any]]:
    """The rows of ``src``: a rollouts JSONL's lines, or an ATIF file's documents read as ``view`` reads them
    (one reader: a foreign trajectory is a row with no reward)."""
    from pathlib import Path

    from gym_runtime.data.atif import from_atif, is_atif_file, read_atif
    from gym_runtime.data.jsonlines import json_value
    from gym_runtime.errors import UserError
    from gym_runtime.view.index import lines

    path = Path(str(src))
    if is_atif_file(path):
        for i, doc in enumerate(read_atif(path)):
            yield from_atif(doc, i)
        return
    for number, _, line in lines(path):
        row = json_value(line, f"{path}:{number}", "export reads a rollouts JSONL or an ATIF file")
        if not isinstance(row, dict):
            raise UserError(f"{path}:{number}: not a JSON object")
        yield row


def _model_names(batch_file: object) -> dict[str, str]:
    """Each model entry's model name, from the batch's sidecar (``run`` and ``collect`` write it), if there."""
    import json
    from pathlib import Path

    path = Path(str(batch_file))
    if not path.is_file():
        return {}
    try:
        models = (json.loads(path.read_text()).get("manifest") or {}).get("models") or {}
    except (ValueError, AttributeError):
        return {}
    return {k: v["model"] for k, v in models.items() if isinstance(v, dict) and v.get("model")}
