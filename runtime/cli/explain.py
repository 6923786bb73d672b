"""``gym-runtime explain BATCH TASK [ROLLOUT]``: a rollout's history, attempt by attempt.

From each attempt's own records (where and when it ran, why it was given back), the results stored for the
slot (each call with its timing and tokens, the row, its cost) and the batch's manifest (model entries). Works
after the batch, from any node; on a ``server --secure`` bus with the publisher's credentials.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from gym_runtime.cli import _common as cli


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="a rollout's history: each attempt, its calls, redeliveries, result and cost")
    p.add_argument("batch", metavar="BATCH", help="batch id")
    p.add_argument("task", metavar="TASK", type=cli.non_negative_int, help="task index (the row's _ng_task_index)")
    p.add_argument(
        "rollout", metavar="ROLLOUT", type=cli.non_negative_int, nargs="?", help="rollout index (default: every repeat)"
    )
    cli.bus_options(p, "NATS URL(s), comma-separated")
    p.add_argument("--json", action="store_true", help="print the records as JSON instead of text")
    cli.log_level_option(p)


def main(args: argparse.Namespace) -> int:
    import msgspec

    from gym_runtime.cli._common import reach
    from gym_runtime.data.history import histories
    from gym_runtime.service.loop import run_async

    url = reach(cli.need_url(args, None), query=True)
    auth = cli.client_auth(args)

    async def go() -> Any:
        async with cli.connected(args, url, "explain", auth=auth) as bus:
            return await histories(bus, args.batch, args.task, args.rollout)

    manifest, found = run_async(go)
    if args.json:
        print(json.dumps(msgspec.to_builtins({"manifest": manifest, "rollouts": found}), indent=2))
        return 0
    for i, h in enumerate(found):
        if i:
            print()
        print("\n".join(cli.printable(line) for line in render(manifest, h)))  # (workers' messages: escaped)
    return 0


def render(manifest: Any, h: Any) -> list[str]:
    """A slot's history as lines of text."""
    import msgspec

    from gym_runtime.data.aggregate import cost_text, result_cost
    from gym_runtime.data.attribution import attribution_text
    from gym_runtime.data.intake import is_ok

    models = manifest.models or {}
    lines = [
        f"batch {h.batch}  task {h.task}  rollout {h.rollout}  agent {h.agent or '?'}"
        f"  (published {_when(manifest.created)}, input {manifest.input})"
    ]
    if not h.attempts:
        lines.append("  no attempt recorded yet (queued; or its records are past the attempts stream's limits)")
    for n, a in enumerate(h.attempts):
        s = a.start
        if s is not None:
            where = f"on node {s.node}, worker {s.worker} (pid {s.pid})"
            lines.append(f"attempt {a.number}  started {_when(s.at)} {where}")
        else:
            lines.append(f"attempt {a.number}  (no start record: its worker died within 0.5 s of taking it)")
        if a.number > 1 and (n == 0 or h.attempts[n - 1].number != a.number - 1 or s is not None):
            lines.append(f"  redelivered: {_why(h, n)}")
        calls = a.retried.calls if a.retried is not None else next((r.calls for r in a.results if r.calls), None)
        row = next((r.row for r in a.results if r.row is not None), None)
        since = next((r.calls_from for r in a.results if r.calls_from), None)
        if row is not None and row.get("resumed_how"):
            turn, how = row.get("resumed_from_turn"), row["resumed_how"]
            lines.append(
                f"  resumed at turn {turn} ({how}): the turns before it ran in earlier attempts"
                if how != "restarted"
                else "  restarted: its checkpoint's session could be neither reattached nor restored"
            )
        lines += _calls(calls or [], row or _trajectory(a, h), models, since or [0, 0])
        if a.retried is not None:
            e = a.retried.error
            lines.append(f"  given back at {_when(a.retried.at)}: {e.error_class}: {e.message} (runs again)")
        for r in a.results:
            kept = " (the slot's result: collect writes it)" if r is h.kept else " (not kept: the slot holds another)"
            if is_ok(r):
                lines.append(f"  result: reward {r.row.get('reward')!r}{kept}")
            else:
                lines.append(f"  failure row: {r.error.error_class}: {r.error.message}{kept}")
                lines.append(f"  caused by: {attribution_text(r)}")
            cost = result_cost(r)
            if cost is not None:
                lines.append(f"  cost: {cost_text(msgspec.to_builtins(cost))}")
            prov = r.row.get("provenance") if r.row else None
            if isinstance(prov, dict) and prov.get("workers"):
                served = ", ".join(f"{role} {' '.join(ids)}" for role, ids in sorted(prov["workers"].items()))
                lines.append(f"  served by: {served}")
        if s is not None and a.retried is None and not a.results:
            lines.append(
                "  no result: its worker was lost (killed, node gone, or hung past ack_wait)"
                + (", then the task was redelivered" if n + 1 < len(h.attempts) else "")
            )
    if h.kept is not None and not any(h.kept in a.results for a in h.attempts):  # a reader's record of a lost slot
        lines.append(f"  slot settled as {h.kept.error.error_class}: {h.kept.error.message}")
        lines.append(f"  caused by: {attribution_text(h.kept)}")
    return lines


def _trajectory(a: Any, h: Any) -> dict[str, Any] | None:
    """Where an attempt that stored no row finds its calls' names: its failure row's partial trajectory, else the
    slot's row when a later attempt resumed this one's trajectory (its calls, replayed there, are that row's
    first ones); None when neither holds them (a restarted rollout's calls are another trajectory's)."""
    import msgspec

    partial = next((r.partial for r in a.results if getattr(r, "partial", None) is not None), None)
    if partial is not None:
        return {"response": msgspec.to_builtins(partial)}
    kept = h.kept.row if h.kept is not None else None
    if isinstance(kept, dict) and kept.get("resumed_how") in ("reattached", "restored"):
        return kept
    return None


def _why(h: Any, n: int) -> str:
    """Why attempt ``n`` (an index into ``h.attempts``) was a redelivery: what became of the one before."""
    if n == 0:
        return "the earlier attempts left no record"
    prev = h.attempts[n - 1]
    if prev.retried is not None:
        return f"attempt {prev.number} failed with {prev.retried.error.error_class} (retryable)"
    if prev.results:
        return f"attempt {prev.number} stored a failure row"
    where = f" (worker {prev.start.worker} on {prev.start.node})" if prev.start else ""
    return f"attempt {prev.number}'s worker was lost{where}: killed, node gone, or hung past ack_wait"


def _calls(
    calls: list[list[int]], row: dict[str, Any] | None, models: dict[str, dict[str, str]], since: list[int]
) -> list[str]:
    """Each model and tool call: its start from the attempt's, its time, and a model call's tokens; model entries
    from the row's ``provenance.turns``, tool names from its response's function calls (a resumed attempt's
    from ``since``: the model and tool calls earlier attempts made), each numbered as the rollout's turn."""
    prov = row.get("provenance") if row else None
    turns = list(prov.get("turns") or []) if isinstance(prov, dict) else []
    response = row.get("response") if row else None
    output = response.get("output") if isinstance(response, dict) else None
    tools = [i.get("name", "?") for i in output or [] if isinstance(i, dict) and i.get("type") == "function_call"]
    out = []
    m, t = since[0], since[1]
    for c in calls:
        if len(c) >= 4:
            entry = turns[m] if m < len(turns) else "model"
            served = models.get(entry.partition("@")[0], {})
            if served:
                entry += f" ({served['adapter']}{':' + served['model'] if served.get('model') else ''})"
            out.append(f"  +{c[0]:>6} ms  model {entry:<32} {c[1]:>6} ms  {c[2]} in / {c[3]} out tokens")
            m += 1
        else:
            name = tools[t] if t < len(tools) else "?"
            out.append(f"  +{c[0]:>6} ms  tool  {name:<32} {c[1]:>6} ms")
            t += 1
    return out


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch)) + f".{int(epoch % 1 * 1000):03d} UTC"
