"""An endpoint that fails every call is out of service after ``out_after`` in a row, probed back in by one call
after a cooldown; with every endpoint out a call fails at once, naming each endpoint and its last error.

The LLM is ``tests/stub_openai.py`` (a test double), served over real HTTP; the pool is the ``openai`` adapter's.
The e2e rows (a hung server, a run's rows) are in ``tests/e2e/test_endpoint_outages.py``.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from gym_runtime.errors import ModelError
from gym_runtime.messages import CreateParams, parse_items
from gym_runtime.models.openai import OpenAIModel
from gym_runtime.models.openai import Options as OpenAIOptions
from gym_runtime.models.openai_http import AllOut, rendezvous
from tests.stub_openai import StubOpenAI, StubReply, error_body

FAIL = StubReply(status=500, body=error_body(500, "Internal Server Error"))


def cfg(*stubs: StubOpenAI, **kw: Any) -> OpenAIOptions:
    base: dict[str, Any] = dict(
        api="chat", base_url=[s.base_url for s in stubs], model="tiny", max_retries=3, retry_backoff_s=0.001,
        timeout_s=5.0, out_after=3, replica_cooldown_s=0.2,
    )  # fmt: skip
    return OpenAIOptions(**{**base, **kw})


def posts(stub: StubOpenAI) -> int:
    return len([r for r in stub.requests if r.method == "POST"])


async def generate(model: OpenAIModel, key: str) -> None:
    await model.generate(CreateParams(input=parse_items("hi")), rollout_key=key)


def keys_ranking_first(model: OpenAIModel, index: int, n: int) -> list[str]:
    """Rollout keys whose calls go first to endpoint ``index`` (rendezvous hashing), while it is up."""
    urls = [ep.url for ep in model.pool.endpoints]
    return [k for k in (f"r{i}" for i in range(1000)) if rendezvous(k, urls)[0] == index][:n]


async def fail_until_out(model: OpenAIModel, a: StubOpenAI, keys: list[str]) -> None:
    """Calls that go first to ``a`` (which fails each) until it is out: each waits out its cooldown first."""
    ep = model.pool.endpoints[0]
    for key in keys:
        deadline = time.monotonic() + 30
        while not ep.healthy and ep.out is None:
            assert time.monotonic() < deadline
            await anyio.sleep(0.01)
        if ep.out is not None:
            return
        await generate(model, key)  # answered all the same: moved to the other endpoint


@pytest.fixture
def two() -> Any:
    with StubOpenAI() as a, StubOpenAI() as b:
        yield a, b


async def test_an_endpoint_failing_every_call_is_out_after_out_after_and_a_trial_brings_it_back(two: Any) -> None:
    a, b = two
    model = OpenAIModel(cfg(a, b))
    keys = keys_ranking_first(model, 0, 40)
    a.handler = lambda req: FAIL
    await fail_until_out(model, a, keys[:10])
    ep = model.pool.endpoints[0]
    assert posts(a) == 3 and ep.out is not None, (posts(a), ep.out)
    assert "3 calls failed in a row" in ep.out and "HTTP 500" in ep.out
    ep.back_at = time.monotonic() + 60  # its trial far off: nothing goes to it
    for key in keys[10:20]:
        await generate(model, key)
    assert posts(a) == 3 and posts(b) == 13
    a.handler = None  # it serves again: the trial call, once its cooldown is over, brings it back
    ep.back_at = time.monotonic()
    for key in keys[20:30]:
        await generate(model, key)
    assert ep.out is None and posts(a) == 13, posts(a)  # back: its rollouts return to it
    await model.aclose()


async def test_a_failed_trial_keeps_it_out_a_cooldown_longer(two: Any) -> None:
    a, b = two
    model = OpenAIModel(cfg(a, b))
    keys = keys_ranking_first(model, 0, 20)
    a.handler = lambda req: FAIL
    await fail_until_out(model, a, keys[:10])
    ep = model.pool.endpoints[0]
    ep.back_at = time.monotonic()
    await generate(model, keys[10])  # its trial: fails, answered by b
    assert posts(a) == 4 and ep.out is not None
    assert ep.back_at - time.monotonic() > 0.2 * 1.5  # the next trial a cooldown later, doubled
    await model.aclose()


async def test_with_every_endpoint_out_a_call_fails_at_once_naming_each(two: Any) -> None:
    a, b = two
    model = OpenAIModel(cfg(a, b, replica_cooldown_s=0.0, max_retries=1))
    a.handler = b.handler = lambda req: FAIL
    for k in range(3):
        with pytest.raises(ModelError, match="HTTP 500"):
            await generate(model, f"r{k}")
    assert all(ep.out is not None for ep in model.pool.endpoints)
    for ep in model.pool.endpoints:
        ep.back_at = time.monotonic() + 60  # no trial due
    before = posts(a) + posts(b)
    t0 = time.perf_counter()
    with pytest.raises(AllOut) as e:
        await generate(model, "r9")
    assert time.perf_counter() - t0 < 1.0  # no retries, no backoff
    assert posts(a) + posts(b) == before  # not one call more
    said = str(e.value)
    assert said.startswith("every endpoint is out of service")
    assert a.base_url in said and b.base_url in said and said.count("HTTP 500") == 2, said
    assert e.value.retryable is False
    await model.aclose()
