"""A user's own environment, agent and model adapter, in a package outside the repository.

The package is written to a temporary folder and named by module path in a config
(``server: mygym.env``, ``agent: mygym.agent``, ``adapter: mygym.echo_model``);
``gym-runtime run`` runs it end to end with only the public ``gym_runtime`` API.
The adapter is a scripted policy (the LLM stand-in) with an option of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gym_runtime.config import load_config, resolve_config
from gym_runtime.errors import ConfigError
from tests import helpers
from tests.helpers import REPO, read_jsonl

ENV = '''
from typing import Any

from gym_runtime import Resource, Response, output_text, tool


class Shout(Resource):
    """One tool; the reward is whether the final answer carries the tool's result."""

    @tool
    async def shout(self, word: str) -> str:
        """The word in capitals."""
        return word.upper()

    async def verify(self, task: dict[str, Any], response: Response) -> float:
        return 1.0 if task["expected"] in output_text(response.output) else 0.0
'''

AGENT = '''
import msgspec

from gym_runtime import AgentContext, FunctionCall, FunctionCallOutput, Outcome, create_params


async def run(ctx: AgentContext) -> Outcome:
    """Call the model until it stops calling tools (at most three times), then verify."""
    params = create_params(ctx.row["responses_create_params"])
    base, outputs = params.input, []
    async with await ctx.open_session() as session:
        for _ in range(3):
            params.input = base + outputs
            resp = await ctx.generate(params)
            outputs += resp.output
            calls = [o for o in resp.output if isinstance(o, FunctionCall)]
            if not calls:
                break
            for c in calls:
                reply = await session.call(c.name, c.arguments)
                outputs.append(FunctionCallOutput(call_id=c.call_id, output=reply.output))
        response = msgspec.structs.replace(resp, output=outputs)
        return Outcome(response=response, verdict=await session.verify(ctx.row, response))
'''

ADAPTER = '''
import json
from typing import ClassVar

from gym_runtime import (
    AdapterOptions, CreateParams, FunctionCall, FunctionCallOutput, Message, Response, assistant_message,
)


class Options(AdapterOptions, kw_only=True, forbid_unknown_fields=True):
    prefix: str = "answer"
    token: str | None = None  # a secret: never printed
    secret_fields: ClassVar[tuple[str, ...]] = ("token",)


class EchoModel:
    """Scripted policy: first calls ``shout`` with the user's text, then answers with its output."""

    def __init__(self, options: Options) -> None:
        self.options = options

    async def generate(self, params: CreateParams, *, rollout_key: str | None = None) -> Response:
        results = [i.output for i in params.input if isinstance(i, FunctionCallOutput)]
        if not results:
            text = next(i.content for i in params.input if isinstance(i, Message) and i.role == "user")
            call = FunctionCall(name="shout", arguments=json.dumps({"word": text}), call_id="call_1")
            return Response(id="r1", created_at=0.0, output=[call])
        return Response(id="r2", created_at=0.0, output=[assistant_message(f"{self.options.prefix}: {results[-1]}")])

    async def aclose(self) -> None:
        pass


def create(options: Options, *, concurrency: int, base_dir: str | None) -> EchoModel:
    return EchoModel(options)
'''

CONFIG = """\
models:
  policy: {adapter: mygym.echo_model, prefix: shouted, token: tok-SECRET-1, concurrency: 4}
resources:
  shout: {server: mygym.env}
agents:
  shout_agent: {agent: mygym.agent, model: policy, resource: shout}
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "mygym"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in (("env", ENV), ("agent", AGENT), ("echo_model", ADAPTER)):
        (pkg / f"{name}.py").write_text(textwrap.dedent(text))
    (tmp_path / "config.yaml").write_text(CONFIG)
    rows = [{"responses_create_params": {"input": w}, "expected": w.upper()} for w in ("hello", "gym", "nats")]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def cli(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(project)}
    return subprocess.run(
        [sys.executable, "-m", "gym_runtime.cli", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_user_environment_agent_and_adapter_run_end_to_end(project: Path) -> None:
    res = cli(project, "run", "config.yaml", "-i", "tasks.jsonl", "-o", "out.jsonl", "--no-progress")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (project / "out.jsonl").read_text().splitlines()]
    assert sorted(r["expected"] for r in rows) == ["GYM", "HELLO", "NATS"]
    assert all(r["reward"] == 1.0 for r in rows)
    for r in rows:  # the adapter's own option reached it; the tool ran in the user's environment
        assert r["response"]["output"][-1]["content"][0]["text"].startswith("shouted: ")
        call_output = r["response"]["output"][1]
        assert call_output["type"] == "function_call_output" and r["expected"] in call_output["output"]
    assert "tok-SECRET-1" not in res.stdout + res.stderr + (project / "out.jsonl").read_text()


def test_user_adapter_options_are_validated_at_load_and_secrets_redacted(project: Path) -> None:
    cfg = resolve_config(load_config(project / "config.yaml"))
    policy = cfg.models["policy"]
    assert (policy.adapter, policy.concurrency, policy.options.prefix) == ("mygym.echo_model", 4, "shouted")
    assert "tok-SECRET-1" not in repr(cfg) and "token='***'" in repr(policy.options)
    # --set paths are checked against the adapter's own options (nearest valid key named)
    with pytest.raises(ConfigError, match=r"models\.policy\.prefx: no key .*did you mean models\.policy\.prefix\?"):
        resolve_config(load_config(project / "config.yaml", ["models.policy.prefx=x"]))
    with pytest.raises(ConfigError, match=r"models\.policy\.adapter: no such adapter module 'mygym\.nope'"):
        resolve_config(load_config(project / "config.yaml", ["models.policy.adapter=mygym.nope"]))
    res = cli(project, "run", "config.yaml", "-i", "tasks.jsonl", "-o", "o.jsonl", "--set", "models.policy.prefx=1")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "did you mean models.policy.prefix?" in res.stderr


def test_environments_agents_and_adapters_resolve_names_by_one_rule(tmp_path: Path) -> None:
    """Bare bundled names work for all three kinds (``server: weather``, ``agent: simple``,
    ``adapter: scripted``) and give the same rows as the folder paths; a mistyped one names the
    nearest bundled plugin in one line, exit 2."""
    rows = REPO / "resources" / "weather" / "data" / "example.jsonl"
    base = (REPO / "resources" / "weather" / "config.yaml").read_text()
    bare = base.replace("server: resources.weather", "server: weather").replace("agent: agents.simple", "agent: simple")
    assert bare != base
    (tmp_path / "bare.yaml").write_text(bare)
    for name in ("bare", "folder"):
        config = tmp_path / "bare.yaml" if name == "bare" else REPO / "resources" / "weather" / "config.yaml"
        res = helpers.cli("run", str(config), "-i", str(rows), "-o", str(tmp_path / f"{name}.jsonl"), "--quiet")
        assert res.returncode == 0, res.stderr
    strip = ("response",)
    got = [
        {k: v for k, v in helpers.without_run_identity(r).items() if k not in strip}
        for r in read_jsonl(tmp_path / "bare.jsonl")
    ]
    want = [
        {k: v for k, v in helpers.without_run_identity(r).items() if k not in strip}
        for r in read_jsonl(tmp_path / "folder.jsonl")
    ]
    assert got == want and len(got) > 0

    (tmp_path / "typo.yaml").write_text(bare.replace("server: weather", "server: wether"))
    res = helpers.cli("validate", str(tmp_path / "typo.yaml"), "-i", str(rows))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "gym-runtime: error: resources.weather.server: no such resource module 'wether'; did you mean 'weather'?"
    ]
