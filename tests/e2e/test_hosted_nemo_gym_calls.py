"""Calls hosted NeMo Gym servers make: to models (Chat Completions, their own clients on a base URL) and to
other resources servers, all over the bus through gym-runtime's workers (issue 24, item 3).

Real parts only: the real `gym-runtime` CLI in subprocesses, a real nats-server (secured with per-pool
credentials where permissions are the point), the servers' own code in their built environments; the
judge LLM is the local OpenAI stub behind one of our model entries (the only test double).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.nemo_gym.parity import inputs
from gym_runtime.ops.permissions import Reach, permissions
from gym_runtime.ops.security import ensure_auth_dir
from tests.helpers import REPO, cli, read_jsonl, write_jsonl
from tests.hosting import catalogue_root
from tests.stub_openai import RecordedRequest, StubOpenAI, StubReply, chat_completion

CALLER = REPO / "tests" / "data" / "nemo_servers" / "caller"


@pytest.fixture(scope="module")
def catalogue() -> Path:
    return catalogue_root("--server", "example_session_state_mgmt")


def spans(trace: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]


def model_worker_spans(trace: Path, model: str) -> list[dict[str, Any]]:
    """Spans of model calls a model worker served for ``model`` (the GenAI attributes it sets)."""
    return [s for s in spans(trace) if (s.get("attributes") or {}).get("gen_ai.request.model") == model]


def judge_model(base_url: str) -> dict[str, Any]:
    """Our model entry for a judge: the openai adapter, chat API, on the stub."""
    return {"adapter": "openai", "api": "chat", "base_url": base_url, "model": "judge-llm"}


def build_and_run(tmp_path: Path, config: dict[str, Any], data: Path) -> Path:
    """Build the config's hosted environments, run it on ``data``; the trace file of the run."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(json.dumps(config))
    r = cli("env", "build", str(cfg), timeout=600)
    assert r.returncode == 0, r.stderr
    trace = tmp_path / "trace.jsonl"
    r = cli("run", str(cfg), "-i", str(data), "-o", str(tmp_path / "out.jsonl"), "--trace-file", str(trace))
    assert r.returncode == 0, r.stderr
    return trace


def test_chat_completions_judge_calls_are_served_by_our_model_workers(catalogue: Path, tmp_path: Path) -> None:
    """omniscience asks its judge through ``server_client.post(judge, /v1/chat/completions)`` (its own YAML sets
    use_chat_completions_for_judge). The judge's name maps to a model entry of ours (the openai adapter, chat API,
    on the local stub answering each question with the judge text recorded for it): every judge call is a model
    call a model worker served (its spans), and the rewards are the recorded ones."""
    sdir = catalogue / "omniscience"
    recorded = read_jsonl(sdir / "data" / "example_rollouts.jsonl")
    said = {r["question"]: r["judge_output"] for r in recorded}

    def judge(req: RecordedRequest) -> StubReply:
        text = json.dumps(req.body)
        (answer,) = [v for q, v in said.items() if json.dumps(q)[1:-1] in text]
        return StubReply(body=chat_completion(answer))

    # its example.jsonl no longer holds the recorded tasks: the rollouts' own task fields are the input rows
    task = ("id", "domain", "topic", "question", "expected_answer", "responses_create_params")
    data = write_jsonl(tmp_path / "in.jsonl", [{k: r[k] for k in task} for r in recorded])
    with StubOpenAI(handler=judge) as stub:
        config = {
            "models": {
                "policy": {"adapter": "replay", "rollouts": str(sdir / "data" / "example_rollouts.jsonl")},
                "judge": judge_model(stub.base_url),
            },
            "resources": {
                "env": {
                    "nemo_gym": "omniscience",
                    "options": {"judge_model_server": {"type": "responses_api_models", "name": "judge"}},
                }
            },
            "agents": {"env_agent": {"agent": "agents.simple", "model": "policy", "resource": "env"}},
        }
        trace = build_and_run(tmp_path, config, data)
        paths = [q.path for q in stub.requests if q.method == "POST"]  # not the model worker's GET /v1/models
    got = sorted((row["_ng_task_index"], row["reward"]) for row in read_jsonl(tmp_path / "out.jsonl"))
    assert got == [(i, rec["reward"]) for i, rec in enumerate(recorded)]
    assert paths == ["/v1/chat/completions"] * len(recorded)  # what our model worker sent the judge
    assert len(model_worker_spans(trace, "judge-llm")) == len(recorded)


def test_a_servers_own_openai_client_reaches_our_model_workers(catalogue: Path, tmp_path: Path) -> None:
    """verifif opens its own NeMoGymAsyncOpenAI judge client on ``get_server_url(judge_server_name) + "/v1"``
    (its LLM-judge validators; it swallows a failed judge call into a fallback verdict, so only the judge's side
    tells whether the calls arrived): every judge request the stub saw came from our model worker (one span
    each, with the model entry's name), and every recorded rollout yields a row."""
    sdir = catalogue / "verifif"
    recorded = read_jsonl(sdir / "data" / "example_rollouts.jsonl")
    data = write_jsonl(tmp_path / "in.jsonl", inputs(sdir, recorded))
    with StubOpenAI(handler=lambda req: StubReply(body=chat_completion("YES"))) as stub:
        config = {
            "models": {
                "policy": {"adapter": "replay", "rollouts": str(sdir / "data" / "example_rollouts.jsonl")},
                "judge": judge_model(stub.base_url),
            },
            "resources": {"env": {"nemo_gym": "verifif", "options": {"judge_server_name": "judge"}}},
            "agents": {"env_agent": {"agent": "agents.simple", "model": "policy", "resource": "env"}},
        }
        trace = build_and_run(tmp_path, config, data)
        paths = [q.path for q in stub.requests if q.method == "POST"]  # not the model worker's GET /v1/models
    assert len(read_jsonl(tmp_path / "out.jsonl")) == len(recorded)
    assert paths and set(paths) == {"/v1/chat/completions"}
    assert len(model_worker_spans(trace, "judge-llm")) == len(paths)


def logs(stderr: str) -> list[dict[str, Any]]:
    """The JSON log lines of a command's stderr."""
    out = []
    for line in stderr.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def caller_config(*, judge_url: str, calls: list[str]) -> dict[str, Any]:
    """caller (a NeMo Gym server of a checkout) calls counter (example_session_state_mgmt, hosted) as a session,
    other (another instance of it) by name, and a judge through its own clients on a base URL."""
    judge = "http://judge.models.gym-runtime.invalid/v1"
    return {
        "models": {"policy": {"adapter": "scripted"}, "judge": judge_model(judge_url)},
        "resources": {
            "caller": {
                "nemo_gym": str(CALLER),
                "calls": calls,
                "options": {"grader": "counter", "other": "other", "judge_base_url": judge, "openai_base_url": judge},
            },
            "counter": {"nemo_gym": "example_session_state_mgmt"},
            "other": {"nemo_gym": "example_session_state_mgmt"},
        },
        "agents": {"caller_agent": {"agent": "agents.simple", "model": "policy", "resource": "caller"}},
    }


def test_calls_to_other_servers_and_a_base_url_go_over_the_bus(catalogue: Path, tmp_path: Path) -> None:
    """A hosted server's calls to other resources servers by name reach their workers as sessions of ours (seed,
    tool and verify with the seed's cookies land on one session: the counter is 3 + 2), and its own clients on a
    base URL naming a model of the config (NeMo Gym's NeMoGymAsyncOpenAI, the openai package's AsyncOpenAI and,
    in a thread, OpenAI) reach that model's worker (a span per request), no port opened."""
    data = write_jsonl(tmp_path / "in.jsonl", [{"responses_create_params": {"input": f"go {i}"}} for i in range(3)])
    with StubOpenAI(handler=lambda req: StubReply(body=chat_completion("looks right"))) as stub:
        trace = build_and_run(tmp_path, caller_config(judge_url=stub.base_url, calls=["counter", "other"]), data)
        paths = [q.path for q in stub.requests if q.method == "POST"]  # not the model worker's GET /v1/models
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert [row["reward"] for row in rows] == [1.0] * 3
    for said in ("judge_said", "openai_said", "openai_sync_said"):  # NeMo Gym's client, openai's async and sync
        assert {row[said] for row in rows} == {"looks right"}
    assert {row["other_status"] for row in rows} == {200}
    assert paths == ["/v1/chat/completions"] * 9
    assert len(model_worker_spans(trace, "judge-llm")) == 9
    # a seed's subject ends with its caller (``Subjects.seed``): the environment's part of it
    served = {
        ".".join(s["name"].split()[-1].split(".")[:4])
        for s in spans(trace)
        if s["name"].startswith(("seed ", "tool ", "verify "))
    }
    assert {"gym.res.counter.seed", "gym.res.other.seed"} <= served


def test_under_secure_a_server_may_call_only_the_environments_its_config_names(catalogue: Path, tmp_path: Path) -> None:
    """`server --secure DIR --config CONFIG` with per-pool credentials: caller's pool may call counter (named in
    resources.caller.calls) and the NATS server refuses its call to other (not named): a permissions violation
    reported by the server, the call failing instead of reaching other's workers."""
    data = write_jsonl(tmp_path / "in.jsonl", [{"responses_create_params": {"input": "go"}}])
    auth = tmp_path / "auth"
    pools = [("agent", "caller_agent"), ("resource", "caller"), ("resource", "counter"), ("resource", "other")]
    ensure_auth_dir(auth, pools=[*pools, ("model", "policy"), ("model", "judge")])
    with StubOpenAI(handler=lambda req: StubReply(body=chat_completion("looks right"))) as stub:
        cfg = tmp_path / "config.yaml"
        cfg.write_text(json.dumps(caller_config(judge_url=stub.base_url, calls=["counter"])))
        r = cli("env", "build", str(cfg), timeout=600)
        assert r.returncode == 0, r.stderr
        server = subprocess.Popen(
            [sys.executable, "-m", "gym_runtime.cli", "server", "--secure", str(auth), "--port", "0"]
            + ["--http-port", "-1", "--config", str(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        try:
            assert server.stdout is not None
            url = server.stdout.readline().strip()
            assert url.startswith("nats://"), server.stderr.read() if server.stderr else ""
            r = cli(
                "run", str(cfg), "-i", str(data), "-o", str(tmp_path / "out.jsonl"),
                "--nats", url, "--auth-dir", str(auth), timeout=300,
            )  # fmt: skip
        finally:
            server.terminate()
            server.wait(30)
    assert r.returncode == 0, r.stderr
    (row,) = read_jsonl(tmp_path / "out.jsonl")
    assert row["reward"] == 1.0  # counter: permitted, one session
    assert row["other_status"] == 502  # other: never reached
    refused = [e for e in logs(r.stderr) if "permissions violation" in str(e.get("error", "")).lower()]
    assert refused, r.stderr  # the server's own -ERR, as the caller's connection (its pool credential) got it
    # the caller pool's own connection (its worker in `run`'s process, the server's code in its guest)
    assert {e["client"] for e in refused} == {"gym-run-resource.caller"}
    assert all('publish to "gym.res.other.' in e["error"] for e in refused)


def test_calls_grant_publish_rights_only_towards_the_named_environments() -> None:
    """What the secured server is given: a resource pool may publish into the subjects of the environments its
    ``calls`` names and no other; the role-wide resource credential into every environment some entry calls;
    without calls, no environment may call another (as before)."""
    calls = {"caller": ("counter",), "judge_env": ("grader",)}

    def res_publish(pool: str | None, given: dict[str, tuple[str, ...]] | None) -> set[str]:
        allowed = permissions("resource", ["gym"], pool, Reach(resources=given or {}))["publish"]["allow"]
        return {s for s in allowed if s.startswith("gym.res.")}

    def towards(env: str, caller: str) -> set[str]:  # seeds and its sessions' operations as itself, stateless verifies
        return {f"gym.res.{env}.seed.{caller}", f"gym.res.{env}.*.*.{caller}", f"gym.res.{env}.verify"}

    assert res_publish("caller", calls) == towards("counter", "resource.caller")
    assert res_publish("counter", calls) == set()
    assert res_publish(None, calls) == towards("counter", "resource.*") | towards("grader", "resource.*")
    assert res_publish("caller", None) == res_publish(None, None) == set()


def test_calls_naming_no_other_environment_is_one_line_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        json.dumps(
            {
                "models": {"policy": {"adapter": "scripted"}},
                "resources": {"caller": {"nemo_gym": str(CALLER), "calls": ["countr"]}},
                "agents": {"a": {"agent": "agents.simple", "model": "policy", "resource": "caller"}},
            }
        )
    )
    data = write_jsonl(tmp_path / "in.jsonl", [{"responses_create_params": {"input": "go"}}])
    r = cli("validate", str(cfg), "-i", str(data))
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "resources.caller.calls: 'countr' is not another entry under resources" in line


PROBER = REPO / "tests" / "data" / "nemo_servers" / "prober"


def test_a_server_that_probes_its_judge_with_requests_before_serving_starts(catalogue: Path, tmp_path: Path) -> None:
    """xstest's setup_webserver waits until a `requests` GET of its judge's URL (poll_for_status) and a POST to
    its /v1/responses get any HTTP answer, retrying for ever: `requests` to our model hosts failed to resolve,
    so its worker never became ready. The probe (tests/data/nemo_servers/prober, which tries once) gets an
    answer, the worker starts, and its judge calls through server_client reach our model worker."""
    config = {
        "models": {"policy": {"adapter": "scripted"}, "judge": {"adapter": "scripted"}},
        "resources": {
            "env": {
                "nemo_gym": str(PROBER),
                "options": {"judge_model_server": {"type": "responses_api_models", "name": "judge"}},
            }
        },
        "agents": {"env_agent": {"agent": "agents.simple", "model": "policy", "resource": "env"}},
    }
    data = write_jsonl(tmp_path / "in.jsonl", [{"responses_create_params": {"input": f"go {i}"}} for i in range(2)])
    trace = build_and_run(tmp_path, config, data)
    assert [row["reward"] for row in read_jsonl(tmp_path / "out.jsonl")] == [1.0, 1.0]
    judged = [s for s in spans(trace) if s["name"] == "generate judge gym.call.model.judge"]
    assert len(judged) == 2  # one judge call per verify, served by the judge's model worker


def test_a_server_whose_start_fails_is_one_line_and_exit_2(catalogue: Path, tmp_path: Path) -> None:
    """rolemrc's start looks up NLTK corpora it would download (LookupError): `run` said "internal error (this is
    a bug in gym-runtime ...)" with a traceback and exit 3. A hosted server that cannot start here fails before
    any task with one line naming what it lacks, exit 2."""
    judge = {"type": "responses_api_models", "name": "judge"}
    config = {
        "models": {"policy": {"adapter": "scripted"}, "judge": {"adapter": "scripted"}},
        "resources": {"env": {"nemo_gym": str(PROBER), "options": {"judge_model_server": judge, "missing": "wordnet"}}},
        "agents": {"env_agent": {"agent": "agents.simple", "model": "policy", "resource": "env"}},
    }
    cfg = tmp_path / "config.yaml"
    cfg.write_text(json.dumps(config))
    assert cli("env", "build", str(cfg), timeout=600).returncode == 0
    data = write_jsonl(tmp_path / "in.jsonl", [{"responses_create_params": {"input": "go"}}])
    r = cli("run", str(cfg), "-i", str(data), "-o", str(tmp_path / "out.jsonl"))
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if not line.startswith("{")]
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert any("LookupError" in line and "Resource 'wordnet' not found." in line for line in errors), errors
    assert not (tmp_path / "out.jsonl").exists()
