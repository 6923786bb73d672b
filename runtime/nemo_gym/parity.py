"""Parity: replay a NeMo Gym server's recorded rollouts through its hosted code and compare.

The recorded policy (every model call, tool calls included) is answered by the replay
model, so the server re-executes the recorded tool calls in order; recorded judge
outputs (``judge_responses_create_params`` + ``judge_response``, or
``judge_evaluations[]``) answer its judge calls through a second replay model.
Input rows are joined as NeMo Gym's own reverify builds them:
``example_rollouts_materialized_inputs.jsonl`` by task index, else ``example.jsonl``
by prompt, else the rollout row's own task fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gym_runtime.data.drift import Drift
from gym_runtime.errors import UserError
from gym_runtime.nemo_gym.hosting.env import HostedEnv
from gym_runtime.nemo_gym.hosting.host import MODELS_DOMAIN, server_configs

_NOT_TASK = {"response", "reward", "judge_response", "judge_evaluations", "agent_ref"}


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The file's JSON-object lines (a recording may hold placeholder lines: ``<PLACEHOLDER ROW>``). Lines end
    at ``\n`` only: ``str.splitlines`` also cuts at U+2028 and other separators JSON leaves inside strings."""
    rows = []
    for line in path.read_text().split("\n"):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _prompt(row: dict[str, Any]) -> str:
    """The prompt by role, text and media only (recordings add ``type``, ids and nulls to the input items)."""
    items = (row.get("responses_create_params") or {}).get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    return json.dumps(
        [(m.get("role"), _text(m.get("content")), _media(m.get("content"))) for m in items or [] if isinstance(m, dict)]
    )


def _media(content: Any) -> list[str]:
    """A message's images and files: gui_coordinate's tasks 0 and 1 ask the same text over different images."""
    if not isinstance(content, list):
        return []
    keys = ("image_url", "file_data", "file_url", "file_id")
    return [
        str(next((p[k] for k in keys if p.get(k)), ""))
        for p in content
        if isinstance(p, dict) and p.get("type") in ("input_image", "input_file")
    ]


def _text(content: Any) -> Any:
    """A message's content as text: recordings write content parts with their keys in another order
    (``{"text", "type"}`` vs ``{"type", "text"}``), which made string_match's rows join nothing."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return content


def inputs(sdir: Path, rollouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One input row per rollout, joined as NeMo Gym's reverify does."""
    data = sdir / "data"
    mat = data / "example_rollouts_materialized_inputs.jsonl"
    by_index: dict[Any, dict[str, Any]] = {}
    if mat.is_file():
        by_index = {(r.get("_ng_task_index"), r.get("_ng_rollout_index")): r for r in read_rows(mat)}
    examples = read_rows(data / "example.jsonl") if (data / "example.jsonl").is_file() else []
    by_prompt: dict[str, list[dict[str, Any]]] = {}
    for r in examples:
        by_prompt.setdefault(_prompt(r), []).append(r)
    task_keys = {k for r in examples for k in r} | {"responses_create_params"} if examples else set()
    out = []
    for rec in rollouts:
        row = by_index.get((rec.get("_ng_task_index"), rec.get("_ng_rollout_index"))) or _same_task(
            rec, by_prompt.get(_prompt(rec), [])
        )
        # the joined input row as it is; the rollout's own fields only when nothing joins (they include the
        # verifier's outputs, which a server's response model may refuse to receive twice)
        if row is not None:
            row = dict(row)
        elif task_keys:  # only the fields tasks have (iheval refuses its own `row_id` output sent back to it)
            row = {k: v for k, v in rec.items() if k in task_keys}
        else:
            row = {k: v for k, v in rec.items() if k not in _NOT_TASK}
        row.pop("agent_ref", None)
        out.append(row)  # line i: its replayed row's _ng_task_index is i
    return out


def _same_task(rec: dict[str, Any], tasks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Of the tasks with the rollout's prompt, the first whose own fields the rollout row holds unchanged
    (two tasks may share a prompt and differ in their answer), else the first."""
    for task in tasks:
        if all(rec.get(k, v) == v for k, v in task.items() if k not in ("responses_create_params", "agent_ref")):
            return task
    return tasks[0] if tasks else None


def judge_recordings(rollouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Recorded judge calls as replay rows (request → response)."""
    found = []
    for r in rollouts:
        if isinstance(r.get("judge_responses_create_params"), dict) and isinstance(r.get("judge_response"), dict):
            found.append(
                {"responses_create_params": r["judge_responses_create_params"], "response": r["judge_response"]}
            )
        # any other field holding a call (request + response) or a list of them: `judge_evaluations` (most
        # judge servers), `judge_evaluation` (aegis_v4_safety), `games` (arena's pairwise judgements)
        for key, value in r.items():
            if key in ("responses_create_params", "response"):
                continue
            for ev in value if isinstance(value, list) else [value]:
                if isinstance(ev, dict) and isinstance(ev.get("responses_create_params"), dict) and ev.get("response"):
                    found.append({"responses_create_params": ev["responses_create_params"], "response": ev["response"]})
    return found


def judge_option(sdir: Path) -> str | None:
    """The server's judge config key (``judge_model_server`` ...), from its own YAML, if it has one; else
    ``judge_base_url`` where its own OpenAI client takes the judge's URL from that field (verifif)."""
    for path in sorted((sdir / "configs").glob("*.yaml")):
        text = path.read_text()
        for line in text.splitlines():
            key = line.strip().split(":")[0]
            if key.endswith("_model_server") and key != "model_server":
                return key
    app = sdir / "app.py"
    return "judge_base_url" if app.is_file() and "judge_base_url" in app.read_text() else None


def judge_options(sdir: Path, model: str = "judge") -> dict[str, Any]:
    """The server option that points its judge at our model entry ``model``: a server reference, or for
    a base URL option that model's URL, which the host routes to its workers (``host.MODELS_DOMAIN``)."""
    key = judge_option(sdir)
    if key is None:
        return {}
    if key.endswith("_base_url"):
        return {key: f"http://{model}.{MODELS_DOMAIN}/v1"}
    return {key: {"type": "responses_api_models", "name": model}}


def recorded_options(sdir: Path, rollouts: list[dict[str, Any]]) -> dict[str, Any]:
    """The server's fields from the config file its recordings were made with: the YAML that defines the
    agent the rows name (``agent_ref.name``), or one of its instances by prefix. A server may ship several
    (arena: lmarena_v2 and lmarena_v3, whose judge prompts differ); the host's defaults come from the first."""
    names = {str(r["agent_ref"].get("name")) for r in rollouts if isinstance(r.get("agent_ref"), dict)}
    for _, data in server_configs(sdir):
        # the agent itself, or an instance whose name starts the agent's (lmarena_v3 → lmarena_v3_benchmark_agent)
        if not any(n == k or n.startswith(f"{k}_") for n in names for k in data):
            continue
        for inst in data.values():
            block = inst.get("resources_servers", {}).get(sdir.name) if isinstance(inst, dict) else None
            if isinstance(block, dict):
                return {k: v for k, v in block.items() if k != "entrypoint" and "${" not in json.dumps(v, default=str)}
    return {}


def agent_settings(sdir: Path) -> tuple[str, dict[str, Any], int | None]:
    """The agent NeMo Gym recorded with, as ours: (module, options, max_steps) from the server's own YAML."""
    gym = "GymnasiumServer" in (sdir / "app.py").read_text()
    max_steps = None
    for _, data in server_configs(sdir):
        for inst in data.values():
            agents = inst.get("responses_api_agents") if isinstance(inst, dict) else None
            for body in agents.values() if isinstance(agents, dict) else []:
                if isinstance(body, dict) and isinstance(body.get("max_steps"), int):
                    max_steps = body["max_steps"]
        if max_steps is not None:
            break
    if gym:  # NeMo Gym's gymnasium_agent: max_steps counts environment steps
        return "agents.multi_turn", {"user": "env", "max_turns": max_steps or 10}, 8
    return "agents.simple", {}, max_steps or 50


# NeMo Gym agents that make one model call and verify it without running its tool calls (the call is the
# answer): replayed by their own code, hosted, since agents.simple would run the call and ask again.
NON_EXECUTING = ("tool_simulation_agent", "non_executing_simple_agent")
# NeMo Gym agents that speak their server's own protocol (toolsandbox_agent: env_id, /step, /close), hosted.
OWN_PROTOCOL = ("toolsandbox_agent",)


def recorded_agent(sdir: Path) -> str | None:
    """The NeMo Gym agent the recordings were made with, from the server's YAML: the instance the rows
    name (``agent_ref.name``), else one in the YAML named for the server, else the first defined."""
    rollouts = sdir / "data" / "example_rollouts.jsonl"
    rows = read_rows(rollouts) if rollouts.is_file() else []
    names = {str(r["agent_ref"].get("name")) for r in rows if isinstance(r.get("agent_ref"), dict)}
    found: list[tuple[int, str]] = []
    for path, data in server_configs(sdir):
        for inst_name, inst in data.items():
            agents = inst.get("responses_api_agents") if isinstance(inst, dict) else None
            for impl in agents if isinstance(agents, dict) else []:
                found.append((0 if inst_name in names else 1 if path.stem == sdir.name else 2, str(impl)))
    return min(found, key=lambda f: f[0])[1] if found else None


def run_config(server: str, sdir: Path, models: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """A run config hosting ``server`` under the agent NeMo Gym recorded it with, its policy model ``policy``."""
    resources = {"env": {"nemo_gym": server, **({"options": options} if options else {})}}
    impl = recorded_agent(sdir)
    agent: dict[str, Any]
    if impl in NON_EXECUTING or impl in OWN_PROTOCOL:
        agent = {"nemo_gym": impl, "model": "policy", "resource": "env"}
    else:
        module, agent_options, max_steps = agent_settings(sdir)
        agent = {
            "agent": module,
            "model": "policy",
            "resource": "env",
            "max_steps": max_steps,
            **({"options": agent_options} if agent_options else {}),
        }
    return {"models": models, "resources": resources, "agents": {"env_agent": agent}}


def parity_config(env: HostedEnv, work: Path) -> tuple[Path, Path, list[dict[str, Any]]]:
    """A run config (replayed policy, replayed judge) and its input file for ``env``'s server."""
    sdir = Path(env.server_dir)
    rollouts = [r for r in read_rows(sdir / "data" / "example_rollouts.jsonl") if isinstance(r.get("response"), dict)]
    if not rollouts:
        raise UserError(f"{env.server}: example_rollouts.jsonl holds no recorded responses")
    models: dict[str, Any] = {
        "policy": {"adapter": "replay", "rollouts": str(sdir / "data" / "example_rollouts.jsonl")}
    }
    options: dict[str, Any] = recorded_options(sdir, rollouts)
    judged = judge_recordings(rollouts)
    judge = judge_options(sdir)
    if judge:
        jpath = work / "judge.jsonl"
        jpath.write_text("".join(json.dumps(r) + "\n" for r in judged) or "")
        models["judge"] = {"adapter": "replay", "rollouts": str(jpath)} if judged else {"adapter": "scripted"}
        options.update(judge)
    cfg = run_config(env.server, sdir, models, options)
    cfg_path = work / "parity.yaml"
    cfg_path.write_text(json.dumps(cfg))
    in_path = work / "inputs.jsonl"
    in_path.write_text("".join(json.dumps(r) + "\n" for r in inputs(sdir, rollouts)))
    return cfg_path, in_path, rollouts


@dataclass
class ParityReport:
    server: str
    rows: list[tuple[int, float | None, float | None, int, int]] = field(default_factory=list)  # i, rec, got, same, n
    drift: Drift = field(default_factory=Drift)  # recordings made by gym-runtime with another code or grader
    # rows whose replay called the judge where no judge call is recorded (answered by a scripted judge): not
    # compared, since their reward is that judge's (i, recorded reward)
    refused: list[tuple[int, float | None]] = field(default_factory=list)
    judge_unrecorded: bool = False

    @property
    def matched(self) -> int:
        return sum(
            1 for _, rec, got, _, _ in self.rows if rec is not None and got is not None and abs(rec - got) < 1e-6
        )

    @property
    def ok(self) -> bool:
        return bool(self.rows) and self.matched == len(self.rows)

    def lines(self) -> list[str]:
        out = [f"{'rollout':>7}  {'recorded':>8}  {'replayed':>8}  tool outputs"]
        for i, rec, got, same, n in self.rows:
            tools = f"{same}/{n} identical" if n else "-"
            out.append(f"{i:>7}  {_fmt(rec):>8}  {_fmt(got):>8}  {tools}")
        out.extend(
            f"{i:>7}  {_fmt(rec):>8}  {'refused':>8}  (its reward needs a judge call)" for i, rec in self.refused
        )
        drift = sum(n - same for *_, same, n in self.rows)
        out.append(f"{self.server}: parity {self.matched}/{len(self.rows)} rewards; tool-output drift {drift}")
        if self.judge_unrecorded:
            out.append(
                f"{self.server}: {len(self.rows)} rows replayed, {len(self.refused)} refused (a row whose reward"
                " needed a judge call: the server has a judge and no call of it is recorded)"
            )
        out.extend(self.drift.lines(self.server))
        return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def _tool_outputs(row: dict[str, Any]) -> list[str]:
    return [
        o.get("output")
        for o in (row.get("response") or {}).get("output", [])
        if o.get("type") == "function_call_output"
    ]


def _same(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except (TypeError, ValueError):
        return a == b


def _judge_calls(row: dict[str, Any], judge: str = "judge") -> int:
    """How many calls the row's rollout made to the judge entry (its ``cost``)."""
    models = (row.get("cost") or {}).get("models") or {}
    calls = (models.get(judge) or {}).get("calls", 0)
    return calls if isinstance(calls, int) else 0


def compare(
    server: str, rollouts: list[dict[str, Any]], replayed: list[dict[str, Any]], *, judge_unrecorded: bool = False
) -> ParityReport:
    """Recorded against replayed rewards, row by row; ``judge_unrecorded``: the server has a judge and no call
    of it is recorded, so a row whose replay called it is refused, not compared."""
    got = {r.get("_ng_task_index"): r for r in replayed}
    report = ParityReport(server, judge_unrecorded=judge_unrecorded)
    for i, rec in enumerate(rollouts):
        row = got.get(i)
        if judge_unrecorded and row is not None and _judge_calls(row):
            report.refused.append((i, rec.get("reward")))
            continue
        want, have = _tool_outputs(rec), _tool_outputs(row or {})
        same = sum(1 for a, b in zip(want, have, strict=False) if _same(a, b))
        report.rows.append((i, rec.get("reward"), None if row is None else row.get("reward"), same, len(want)))
        # a recording gym-runtime wrote names its environment and grader: the replay's may differ (drift)
        now = (row or {}).get("provenance")
        if isinstance(now, dict):
            report.drift.check(rec.get("provenance"), now.get("env"), now.get("grader"))
    return report
