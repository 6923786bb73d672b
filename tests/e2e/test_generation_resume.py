"""A kill during a generation: its tokens continue (issue 69, items 4 and 6). Real nats-server, real worker
processes, the agent worker SIGKILLed while the policy's second turn streams; the LLM is the vLLM emulator
(tests/stub_openai.py, a test double) behind the ``vllm`` adapter.

With ``interruptible: true`` the model worker sends the generation's tokens so far every ``GENERATING_S``, the
agent keeps them in the rollout's checkpoint, and the redelivered attempt continues that generation: its
request's prompt is the checkpoint's ids (prompt + the tokens so far), the turn is never sampled from its start
again, and the row's ids run on across the kill. With ``interruptible: false`` the adapter cannot continue one:
the generation is redone whole, from the same prompt ids, and the row is still token-contiguous."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import yaml

from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.transport.bus import Bus
from gym_runtime.workers.control import publish_version
from tests.helpers import ROWS, cli, read_jsonl, write_jsonl
from tests.long_rollout import BATCH, checkpoint_gone, stored_checkpoint
from tests.pools import Pool, start_collect, wait_until
from tests.stub_openai import Gen, StubOpenAI, VLLMEmulator

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "San Francisco"}}</tool_call>'
ANSWER = "It is sunny in San Francisco today, with a light breeze from the west and no rain expected. " * 3
KEY_AGENT = "agent"  # the name tests.long_rollout's checkpoint key reads


class Policy:
    """The emulated policy: turn 1 calls the weather tool; turn 2 answers, continuing the answer from wherever its
    prompt's generated part ends. ``hold``: turn 2's first request waits (a generation the kill cuts)."""

    def __init__(self, em: VLLMEmulator, *, hold: bool = False) -> None:
        tok = em.tokenizer
        self.call = [*tok.encode_bytewise(CALL), tok.EOS]
        self.answer = [*tok.encode_bytewise(ANSWER), tok.EOS]
        self.first: list[int] | None = None
        self.second: list[int] | None = None
        self.prompts: list[list[int]] = []
        self.hold = threading.Event() if hold else None
        self.held = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, path: str, body: dict[str, Any]) -> Gen:
        if "prompt" not in body:  # turn 1 over chat (an adapter that does not stream)
            self.first = []
            return Gen(token_ids=self.call)
        sent = list(body["prompt"])
        with self.lock:
            self.prompts.append(sent)
            if self.first is None:
                self.first = sent
            if sent == self.first:
                return Gen(token_ids=self.call)
            if self.second is None:
                self.second = sent
            base = self.second
        done = len(sent) - len(base)
        assert sent[: len(base)] == base and sent[len(base) :] == self.answer[:done], "not a continuation"
        if self.hold is not None and not self.held.is_set():
            self.held.set()
            self.hold.wait(60.0)
        return Gen(token_ids=self.answer[done:])


def write_config(tmp: Path, base_url: str, *, interruptible: bool) -> Path:
    cfg = {
        "namespace": "gym",
        "models": {
            "policy": {
                "adapter": "vllm",
                "base_url": base_url,
                "model": "tiny",
                "return_token_ids": True,
                "eos_token_id": 4,
                "tool_call_parser": "hermes",
                "interruptible": interruptible,
                "ack_wait_s": 2.0,
                "concurrency": 4,
            }
        },
        "resources": {"weather": {"server": "resources.weather"}},
        "agents": {
            KEY_AGENT: {
                "agent": "agents.simple",
                "model": "policy",
                "resource": "weather",
                "max_steps": 4,
                "timeout_s": 120,
                "ack_wait_s": 2.0,  # redelivered in seconds, not the default 30
                "max_attempts": 2,
                "checkpoint": "every_turn",
            }
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def set_version(url: str, version: int) -> None:
    """The trainer's policy version, as ``Client.set_policy_version`` sets it."""

    async def put() -> None:
        bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="test-trainer")
        try:
            await publish_version(bus, "policy", version)
        finally:
            await bus.close()

    anyio.run(put)


def run_batch(tmp: Path, config: Path, url: str) -> Any:
    tasks = write_jsonl(tmp / "tasks.jsonl", [{**ROWS[0], "agent_ref": {"name": KEY_AGENT}}])
    res = cli("publish", str(config), "-i", str(tasks), "--nats", url, "--batch", BATCH)
    assert res.returncode == 0, res.stderr
    return start_collect(url, BATCH, tmp / "out.jsonl")


def collected(tmp: Path, collector: Any) -> dict[str, Any]:
    stdout, stderr = collector.communicate(timeout=240)
    assert collector.returncode == 0, stderr[-3000:]
    assert "1 rows, 0 failed" in stdout, (stdout, read_jsonl(tmp / "out.jsonl"))
    (row,) = read_jsonl(tmp / "out.jsonl")
    return row


def generations(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in row["response"]["output"] if i.get("generation_token_ids")]


def assert_contiguous(row: dict[str, Any], policy: Policy) -> None:
    first, second = generations(row)
    assert first["generation_token_ids"] == policy.call
    assert second["prompt_token_ids"] == policy.second  # turn 2's prompt: turn 1's ids, then the tool's reply
    seen = first["prompt_token_ids"] + first["generation_token_ids"]
    assert second["prompt_token_ids"][: len(seen)] == seen
    assert second["generation_token_ids"] == policy.answer  # every token once, in order
    assert len(second["generation_log_probs"]) == len(policy.answer)


def test_a_kill_during_a_generation_continues_its_tokens(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    with StubOpenAI() as stub:
        em = stub.emulator
        em.policy = policy = Policy(em)
        em.token_delay_s = 0.03  # turn 2 streams for ~9 s: its tokens so far are sent every GENERATING_S (2 s)
        config = write_config(tmp_path, stub.base_url, interruptible=True)
        pool = Pool(config, nats_server.url)
        try:
            set_version(nats_server.url, 7)
            for only in ("models.policy", "resources.weather", f"agents.{KEY_AGENT}"):
                pool.start(only, only)
            collector = run_batch(tmp_path, config, nats_server.url)

            def generating() -> bool:
                cp = stored_checkpoint(nats_server.url)
                return cp is not None and cp.generating is not None and len(cp.generating.generation_token_ids) > 0

            wait_until(generating, timeout=120)
            pool.kill(f"agents.{KEY_AGENT}")
            cp = stored_checkpoint(nats_server.url)  # what the next attempt finds
            assert cp is not None and cp.generating is not None
            kept = cp.generating.generation_token_ids
            assert cp.turn == 1 and cp.generating.prompt_token_ids == policy.second
            assert 0 < len(kept) < len(policy.answer) and kept == policy.answer[: len(kept)]
            assert cp.generating.policy_version_ranges[-1][1:] == [len(kept), 7]
            set_version(nats_server.url, 8)  # a weight update while the rollout waits for its redelivery
            pool.start(f"agents.{KEY_AGENT}#2", f"agents.{KEY_AGENT}")
            row = collected(tmp_path, collector)
        finally:
            pool.stop_all()
    assert (row["resumed_from_turn"], row["resumed_how"]) == (1, "reattached")
    assert row["provenance"]["attempt"] == 2
    assert_contiguous(row, policy)
    # the kept tokens' versions recorded: sampled by version 7 before the kill, the rest by 8 after it
    second = generations(row)[1]
    assert second["policy_version_ranges"] == [[0, len(kept), 7], [len(kept), len(policy.answer), 8]]
    assert second["policy_version"] == 7 and row["policy_versions"] == [7, 8]
    assert second["content"][0]["text"] == ANSWER  # all its ids decoded at once, the kept ones too
    resumed = policy.second + kept
    # the continuation was asked twice: by the first attempt's call (orphaned by the kill, its model worker went on)
    # and by the resumed attempt, from the checkpoint's ids; turn 2 was never sampled from its start again
    assert policy.prompts.count(resumed) == 2, [len(p) for p in policy.prompts]
    assert policy.prompts.count(policy.second) == 1
    checkpoint_gone(nats_server.url)  # the checkpoint went with its row (its delete follows the row)


def test_an_adapter_that_cannot_continue_redoes_the_generation_whole(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """``interruptible: false``: nothing of the generation is checkpointed; the resumed attempt makes it again
    from the same prompt ids (the checkpoint's), and the row's ids are still contiguous."""
    with StubOpenAI() as stub:
        em = stub.emulator
        em.policy = policy = Policy(em, hold=True)
        config = write_config(tmp_path, stub.base_url, interruptible=False)
        pool = Pool(config, nats_server.url)
        try:
            for only in ("models.policy", "resources.weather", f"agents.{KEY_AGENT}"):
                pool.start(only, only)
            collector = run_batch(tmp_path, config, nats_server.url)
            wait_until(policy.held.is_set, timeout=120)  # turn 2's generation is under way
            pool.kill(f"agents.{KEY_AGENT}")
            cp = stored_checkpoint(nats_server.url)
            assert cp is not None and cp.turn == 1 and cp.generating is None
            pool.start(f"agents.{KEY_AGENT}#2", f"agents.{KEY_AGENT}")
            row = collected(tmp_path, collector)
        finally:
            if policy.hold is not None:
                policy.hold.set()
            pool.stop_all()
    assert (row["resumed_from_turn"], row["resumed_how"]) == (1, "reattached")
    assert_contiguous(row, policy)
    assert policy.prompts.count(policy.second) == 2  # redone whole, from the same prompt ids
