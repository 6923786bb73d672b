"""The TRL adapter under faults and mistakes: an agent worker SIGKILLed mid-step, and bad input (a prompt with no
row, an unknown agent, a bus that is gone) as one ``ClientError`` line with nothing submitted."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gym_runtime import SyncClient
from gym_runtime.errors import ClientError
from gym_runtime.trainers.trl import TRLRollouts
from tests.cluster import start_worker
from tests.trainers.world import PROMPT, grpo, need, world

need("trl")


def wait_for(path: Path, within: float) -> None:
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {within:g} s"
        time.sleep(0.05)


def test_an_agent_worker_sigkilled_mid_step_gives_whole_groups_and_nothing_twice(tmp_path: Path, nats_server) -> None:
    w = world(tmp_path, rows=2, ack_wait_s=3.0)  # a lost worker's tasks come back after 3 s
    verifying = tmp_path / "verifying"
    for r in w.rows:
        r.update(verifying=str(verifying), verify_delay_s=1.0)
    workers = [start_worker(w.config, nats_server.url, "agents.agent")]  # the agents run in a process of their own
    calls: list[tuple[list[Any], list[Any]]] = []
    try:
        # the policy and the environment in this process: the policy is the trainer's live model
        with SyncClient(w.config, nats=nats_server.url, workers=["models.policy", "resources.env"]) as client:
            rollouts = TRLRollouts(client, w.rows)

            def kill_mid_rollout() -> None:
                wait_for(verifying, 120)  # a rollout is being verified: its agent holds the task
                workers[0].send_signal(signal.SIGKILL)
                workers[0].wait()
                workers.append(start_worker(w.config, nats_server.url, "agents.agent"))

            def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
                killer = threading.Thread(target=kill_mid_rollout)
                killer.start()
                out = rollouts(prompts, trainer)
                killer.join()
                calls.append((prompts, list(rollouts.last_rows)))
                return out

            trainer = grpo(w, rollout_func, rollouts.dataset(), tmp_path, steps=1, batch=4, generations=2)
            trainer.train()
    finally:
        for p in workers:
            p.kill()
            p.wait()
    assert workers[0].returncode == -signal.SIGKILL
    ((prompts, rows),) = calls
    assert (
        len(rows) == len(prompts) == 4 and rollouts.totals.excluded == rollouts.totals.policy_failures == 0
    )  # no failure row: the task came back
    for k in (0, 2):
        group = rows[k : k + 2]
        assert sorted(r["_ng_rollout_index"] for r in group) == [0, 1]  # whole, each member once
        assert {r["word"] for r in group} == {w.rows[prompts[k][0]["gym_row"]]["word"]}
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 1


class Counted:
    """A SyncClient's submit, counted (what reached the cluster)."""

    def __init__(self, client: SyncClient) -> None:
        self.submitted = 0
        self._submit = client.submit
        client.submit = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.submitted += 1
        return self._submit(*args, **kwargs)


def one_line(e: pytest.ExceptionInfo[ClientError]) -> str:
    text = str(e.value)
    assert "\n" not in text and text
    return text


def test_bad_input_is_one_client_error_line_and_nothing_is_submitted(tmp_path: Path, nats_server) -> None:
    w = world(tmp_path, rows=2)
    with SyncClient(w.config, nats=nats_server.url, publish_retry_s=2.0) as client:
        counted = Counted(client)
        with pytest.raises(ClientError) as e:
            TRLRollouts(client, w.rows, agent="nope")
        assert "unknown agent 'nope'" in one_line(e)
        with pytest.raises(ClientError) as e:  # issue 67 item 11: every rollout failed, naming neither
            TRLRollouts(client, w.rows, live="polcy")
        assert "unknown live model 'polcy'" in one_line(e) and "'policy'" in str(e.value)

        # a dataset TRL was given that is not the adapter's: two rows share this prompt, and one prompt has none
        rollouts = TRLRollouts(client, w.rows)
        foreign = [{"prompt": [{"role": "user", "content": PROMPT}]}, {"prompt": [{"role": "user", "content": "?"}]}]
        for prompt, said in ((foreign[0], "2 rows have the prompt"), (foreign[1], "no row has the prompt")):
            trainer = grpo(w, rollouts, [prompt] * 2, tmp_path, steps=1, batch=2, generations=2)
            with pytest.raises(ClientError) as e:
                trainer.train()
            assert said in one_line(e)

        # the bus is gone
        nats_server.stop()
        trainer = grpo(w, rollouts, rollouts.dataset(), tmp_path, steps=1, batch=2, generations=2)
        with pytest.raises(ClientError) as e:
            trainer.train()
        one_line(e)
        assert counted.submitted == 0 and rollouts.totals.rollouts == 0
