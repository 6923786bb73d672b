"""Every row says what it cost and where it came from (issue 39): ``cost`` and ``provenance``.

Real nats-server, real workers; the only doubles are the LLMs (``tests/stub_openai.py``, one stub for the
policy and one for the judge), whose own counts of the tokens they reported are the ground truth.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from gym_runtime import Client
from gym_runtime.config import config_from_dict, resolve_config
from gym_runtime.messages import RolloutResult
from gym_runtime.service.batches import collect_batch
from gym_runtime.transport.codec import Codec
from tests.helpers import REPO, cli, read_jsonl, write_jsonl
from tests.stub_openai import RecordedRequest, StubOpenAI, StubReply, responses_reply

JUDGE_ROWS = read_jsonl(REPO / "resources/equivalence_llm_judge/data/example.jsonl")


class CountingModel:
    """A stub LLM's handler that answers ``text`` with token counts drawn from the request, and keeps its own
    totals of what it reported (calls, input, cached, output tokens)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.totals = {"calls": 0, "input_tokens": 0, "cached_tokens": 0, "output_tokens": 0}
        self.lock = threading.Lock()

    def __call__(self, req: RecordedRequest) -> StubReply:
        size = len(json.dumps(req.body))
        with self.lock:
            n = self.totals["calls"]
            inp, out, cached = 50 + size % 97, 3 + n % 11, n % 5
            self.totals["calls"] += 1
            self.totals["input_tokens"] += inp
            self.totals["output_tokens"] += out
            self.totals["cached_tokens"] += cached
        message = {
            "id": f"msg_{n}",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}],
        }
        body = responses_reply([message], input_tokens=inp, output_tokens=out)
        body["usage"]["input_tokens_details"]["cached_tokens"] = cached
        return StubReply(body=body)


def judge_config(policy_url: str, judge_url: str) -> dict[str, Any]:
    raw = json.loads(json.dumps(read_yaml(REPO / "resources/equivalence_llm_judge/config.yaml")))
    raw["models"] = {
        "policy": {"adapter": "openai", "base_url": policy_url, "api_key": "test", "model": "policy-llm"},
        "judge": {"adapter": "openai", "base_url": judge_url, "api_key": "test", "model": "judge-llm"},
    }
    raw["pricing"] = {
        "currency": "EUR",
        "models": {
            "policy": {"input_per_1m": 2.0, "output_per_1m": 8.0, "cached_input_per_1m": 0.5},
            "judge": {"input_per_1m": 1.0, "output_per_1m": 4.0},
        },
    }
    return raw


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text())  # type: ignore[no-any-return]


def estimate(used: dict[str, Any]) -> float:
    """The pricing above, by hand."""
    p, j = used["models"]["policy"], used["models"]["judge"]
    cached = p.get("cached_tokens", 0)
    policy = ((p["input_tokens"] - cached) * 2.0 + cached * 0.5 + p["output_tokens"] * 8.0) / 1e6
    judge = (j["input_tokens"] * 1.0 + j["output_tokens"] * 4.0) / 1e6  # no cached price: the input price
    return policy + judge


@pytest.mark.parametrize("isolation", ["none", "process"])
async def test_costs_add_up_to_the_stubs_own_token_counts_for_the_policy_and_its_judge(
    nats_server, tmp_path: Path, isolation: str
) -> None:
    """Each row's ``cost`` counts the policy's calls (made by the agent) and the judge's (made by the
    environment's verify on a resource worker, in its own process or a guest's); summed over the batch they are
    exactly what each stub said it served. The estimate follows ``pricing``; the metrics file totals the same
    numbers; the row's grader is the judge entry's fingerprint; and ``pricing`` is in no fingerprint."""
    policy, judge = CountingModel("\\boxed{darwin}"), CountingModel("[[A=B]]")
    with StubOpenAI(handler=policy) as p_stub, StubOpenAI(handler=judge) as j_stub:
        raw = judge_config(p_stub.base_url, j_stub.base_url)
        raw["resources"]["equivalence_llm_judge"]["isolation"] = isolation  # process: its judge asks over the wire
        config = resolve_config(config_from_dict(raw))
        unpriced = resolve_config(config_from_dict({k: v for k, v in raw.items() if k != "pricing"}))
        agent = ("agent", "equivalence_llm_judge_agent")
        assert config.fingerprints[agent] == unpriced.fingerprints[agent]
        async with Client(config, nats=nats_server.url) as client:
            batch = await client.submit(JUDGE_ROWS, repeats=2)
            rows = await batch.gather()
            stats = await collect_batch(client.bus, batch.batch, tmp_path / "out.jsonl", wait_s=5)
            stored = await stored_results(client, "equivalence_llm_judge_agent")
    assert len(rows) == 2 * len(JUDGE_ROWS) and stats.failures == 0
    assert len(stored) == len(rows)
    by_slot = {(r["_ng_task_index"], r["_ng_rollout_index"]): r for r in rows}
    for data, result in stored:  # bytes stored: the result's body exactly as stored
        slot = (result.row["_ng_task_index"], result.row["_ng_rollout_index"])
        assert by_slot[slot]["cost"]["stored_bytes"] == len(data), (by_slot[slot]["cost"], len(data))
    assert all(not isinstance(r, dict) or "error_class" not in r for r in rows), rows
    for entry, stub in (("policy", policy), ("judge", judge)):
        got = {k: sum(r["cost"]["models"][entry].get(k, 0) for r in rows) for k in stub.totals}
        assert got == stub.totals, (entry, got, stub.totals)
    for r in rows:
        assert abs(r["cost"]["estimated_cost"] - estimate(r["cost"])) < 1e-9, r["cost"]
        assert r["cost"]["currency"] == "EUR"
        prov = r["provenance"]
        assert prov["grader"] == f"judge:{config.fingerprints[('model', 'judge')]}"
        assert prov["turns"] == ["policy"] and prov["config"] == config.fingerprints[agent]
        assert len(prov["workers"]["model"]) == 1 and len(prov["workers"]["resource"]) == 1
    (metrics,) = json.loads((tmp_path / "out_aggregate_metrics.json").read_text())
    totals = metrics["cost"]["rollouts"]
    assert totals["models"]["policy"]["input_tokens"] == policy.totals["input_tokens"]
    assert totals["models"]["judge"]["output_tokens"] == judge.totals["output_tokens"]
    assert totals["stored_bytes"] == sum(r["cost"]["stored_bytes"] for r in rows) > 0
    assert abs(totals["estimated_cost"] - sum(estimate(r["cost"]) for r in rows)) < 1e-6
    assert totals["currency"] == "EUR"
    assert "failed" not in metrics["cost"]


async def stored_results(client: Client, agent: str) -> list[tuple[bytes, RolloutResult]]:
    """Each message of an agent's results stream: its stored body, and that body decoded."""
    stream = client.bus.subjects.results_stream(agent)
    info = await client.bus.js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        data = (await client.bus.js.get_msg(stream, seq)).data
        out.append((data, Codec().decode(data, None)))
    return out


def env_copy(tmp_path: Path) -> tuple[Path, Path]:
    """The weather environment as a user's own module beside its config (``server: myweather``)."""
    pkg = tmp_path / "myweather"
    shutil.copytree(REPO / "resources/weather", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    raw = read_yaml(REPO / "resources/weather/config.yaml")
    raw["resources"]["weather"]["server"] = "myweather"
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(raw))
    return pkg, config


def run(config: Path, data: Path, out: Path) -> list[dict[str, Any]]:
    done = cli("run", str(config), "-i", str(data), "-o", str(out), "--log-level", "warning")
    assert done.returncode == 0, done.stderr[-3000:]
    return read_jsonl(out)


def test_provenance_changes_with_the_environments_code_and_reverify_names_the_drift(tmp_path: Path) -> None:
    """A row's ``provenance.env`` is the content hash of the environment's code: the same for a second run of
    the same code (its data and its config edited), another once a line of its code changes. ``reverify``
    of the old rows with the new code says which identity changed, from what to what; of rows made with the
    installed code, it says nothing of drift."""
    pkg, config = env_copy(tmp_path)
    data = pkg / "data" / "example.jsonl"
    first = run(config, data, tmp_path / "a.jsonl")
    env = {r["provenance"]["env"] for r in first}
    assert len(env) == 1 and all(r["provenance"]["runtime"] and r["provenance"]["workers"]["agent"] for r in first)
    (was,) = env

    write_jsonl(pkg / "data" / "extra.jsonl", read_jsonl(data)[:1])  # data and config are not code
    config.write_text(config.read_text() + "\n# a comment\n")
    again = run(config, data, tmp_path / "b.jsonl")
    assert {r["provenance"]["env"] for r in again} == {was}
    assert {r["provenance"]["config"] for r in again} == {r["provenance"]["config"] for r in first}

    code = pkg / "__init__.py"
    code.write_text(code.read_text() + "\n# a changed line of code\n")
    changed = run(config, data, tmp_path / "c.jsonl")
    (now,) = {r["provenance"]["env"] for r in changed}
    assert now != was

    old = cli("reverify", str(config), "-i", str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "ra.jsonl"))
    assert old.returncode == 0, old.stderr[-3000:]
    drift = [line for line in old.stdout.splitlines() if "drift" in line]
    assert len(drift) == 1 and "environment code of resources.weather" in drift[0], old.stdout
    assert f"{was} -> {now}" in drift[0] and f"{len(first)} rows" in drift[0], drift
    same = cli("reverify", str(config), "-i", str(tmp_path / "c.jsonl"), "-o", str(tmp_path / "rc.jsonl"))
    assert same.returncode == 0 and "drift" not in same.stdout, same.stdout
    assert read_jsonl(tmp_path / "rc.jsonl")[0]["provenance"] == changed[0]["provenance"]


class FailingFirst:
    """A judge whose server refuses its first ``n`` calls (HTTP 400), then answers as ``CountingModel``."""

    def __init__(self, n: int, then: CountingModel) -> None:
        self.left, self.then, self.lock = n, then, threading.Lock()

    def __call__(self, req: RecordedRequest) -> StubReply:
        with self.lock:
            refuse = self.left > 0
            self.left -= refuse
        return StubReply(status=400, body={"error": {"message": "refused"}}) if refuse else self.then(req)


async def test_a_failed_rollout_keeps_what_it_used_and_the_metrics_total_it_apart(nats_server, tmp_path: Path) -> None:
    """The judge's server refuses its first two calls: those rollouts fail in verify after their policy call
    (one attempt each). A failure row carries its attempt's cost (the policy's tokens); rows and failures
    together are exactly what the policy stub counted, and the metrics file totals the failures apart."""
    policy, judge = CountingModel("\\boxed{darwin}"), CountingModel("[[A=B]]")
    with StubOpenAI(handler=policy) as p_stub, StubOpenAI(handler=FailingFirst(2, judge)) as j_stub:
        raw = judge_config(p_stub.base_url, j_stub.base_url)
        raw["agents"]["equivalence_llm_judge_agent"]["max_attempts"] = 1
        raw["models"]["judge"]["max_retries"] = 0
        config = resolve_config(config_from_dict(raw))
        async with Client(config, nats=nats_server.url) as client:
            batch = await client.submit(JUDGE_ROWS)
            stats = await collect_batch(client.bus, batch.batch, tmp_path / "out.jsonl", wait_s=5)
    assert (stats.rows, stats.failures) == (len(JUDGE_ROWS) - 2, 2)
    rows, failed = read_jsonl(tmp_path / "out.jsonl"), read_jsonl(tmp_path / "out_failures.jsonl")
    assert all("judge" not in f["cost"]["models"] for f in failed), failed
    every = rows + failed
    got = {k: sum(r["cost"]["models"]["policy"].get(k, 0) for r in every) for k in policy.totals}
    assert got == policy.totals
    assert sum(r["cost"]["models"]["judge"]["calls"] for r in rows) == judge.totals["calls"] == len(rows)
    (metrics,) = json.loads((tmp_path / "out_aggregate_metrics.json").read_text())
    cost = metrics["cost"]
    assert cost["failed_rollouts"] == 2
    assert cost["failed"]["models"]["policy"]["calls"] == 2 and "judge" not in cost["failed"]["models"]
    split = cost["rollouts"]["models"]["policy"]["input_tokens"] + cost["failed"]["models"]["policy"]["input_tokens"]
    assert split == policy.totals["input_tokens"]
