"""google_search against NeMo Gym's recorded rollouts, the offline BM25 backend, and browse limits."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gym_runtime import testing
from gym_runtime.config import load_config, resolve_config
from gym_runtime.messages import Response, assistant_message, parse_items
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.resources.google_search import GoogleSearch, box_parser, graded_text, parse_options
from gym_runtime.resources.google_search.backends import OfflineBackend, SearchOptions
from gym_runtime.service.runner import run_batch
from tests import differential
from tests.helpers import cli, prompt_key, read_jsonl, write_jsonl

ENV_DIR = Path(__file__).resolve().parents[1]
CORPUS_URL = "https://offline.gym-runtime.invalid/wiki/"


def compat() -> Path:
    return differential.compat_dir("nemo_gym", "google_search")


def google_search_cli(
    command: str, rows: str | Path, out: Path, *more: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``gym-runtime <command>`` on this environment's config, ``rows`` in, ``out`` out."""
    return cli(command, "resources/google_search/config.yaml", "-i", str(rows), *more, "-o", str(out), timeout=timeout)


def pairs() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return testing.joined_rollouts(ENV_DIR / "data" / "example.jsonl", compat() / "example_rollouts.jsonl")


async def session(options: dict[str, Any] | None = None) -> GoogleSearch:
    await GoogleSearch.setup(options or {})
    return GoogleSearch()


async def test_recorded_rollouts_reverify_to_recorded_reward_and_parsed_option() -> None:
    seen = []
    for i, (task, rollout) in enumerate(pairs()):
        inst = await session()
        reward, fields = testing.split_verdict(await inst.verify(task, testing.recorded_response(rollout["response"])))
        assert (reward, fields) == (rollout["reward"], {"parsed_option": rollout["parsed_option"]}), f"rollout {i}"
        seen.append(fields["parsed_option"])
    assert len(seen) == 5 and "\\\\text{B" in seen  # NeMo Gym's repr quirk is reproduced, not "fixed"


async def test_recorded_backend_reproduces_every_recorded_tool_output_exactly() -> None:
    inst = await session({"backend": "recorded", "rollouts": str(compat() / "example_rollouts.jsonl")})
    calls = 0
    for _task, rollout in pairs():
        calls += await testing.replay_tool_calls(inst, testing.recorded_response(rollout["response"]))
    assert calls == 5  # three searches, two browses


def test_reverify_cli_reproduces_recorded_rewards(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    res = google_search_cli(
        "reverify", compat() / "example_rollouts.jsonl", out, "--tasks", str(compat() / "example.jsonl")
    )
    assert res.returncode == 0, res.stderr
    assert "5 rows re-verified, 0 failed, 0 rewards changed" in res.stdout
    rows = read_jsonl(out)
    recorded = read_jsonl(compat() / "example_rollouts.jsonl")
    assert [(r["reward"], r["parsed_option"]) for r in rows] == [(r["reward"], r["parsed_option"]) for r in recorded]


async def test_replay_end_to_end_with_recorded_tool_outputs(nats_server, tmp_path: Path) -> None:
    """Recorded model outputs through our agent and resource; search/browse answers come from the recording."""
    rollouts = compat() / "example_rollouts.jsonl"
    cfg = load_config(
        ENV_DIR / "config.yaml",
        [
            "models.policy.adapter=replay",
            f"models.policy.rollouts={rollouts}",
            "resources.google_search.options.backend=recorded",
            f"resources.google_search.options.rollouts={rollouts}",
        ],
    )
    out = tmp_path / "out.jsonl"
    result = await run_batch(
        resolve_config(cfg), nats_server.url, input_path=compat() / "example.jsonl", out=out, telemetry=Telemetry()
    )
    assert result.stats.failures == 0
    recorded = {prompt_key(r["responses_create_params"]["input"]): r for r in read_jsonl(rollouts)}
    rows = read_jsonl(out)
    assert len(rows) == 5
    for row in rows:
        rec = recorded[prompt_key(row["responses_create_params"]["input"])]
        assert (row["reward"], row["parsed_option"]) == (rec["reward"], rec["parsed_option"])
        ours = [(i["type"], i.get("arguments"), i.get("output")) for i in row["response"]["output"]]
        theirs = [(i["type"], i.get("arguments"), i.get("output")) for i in rec["response"]["output"]]
        assert ours == theirs  # tool outputs bit for bit


def test_run_cli_offline_on_the_bundled_example(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    res = google_search_cli("run", "resources/google_search/data/example.jsonl", out, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = read_jsonl(out)
    assert len(rows) == 5
    for row in rows:
        assert "parsed_option" in row and row["reward"] in (0.0, 1.0)
        outputs = [json.loads(i["output"]) for i in row["response"]["output"] if i["type"] == "function_call_output"]
        assert outputs, "the scripted policy calls the tools"
        for o in outputs:
            if "search_results" in o:
                assert json.loads(o["search_results"])["kind"] == "customsearch#search"


def test_tool_schemas_are_nemo_gyms() -> None:
    theirs = read_jsonl(ENV_DIR / "data" / "example.jsonl")[0]["responses_create_params"]["tools"]
    assert GoogleSearch.tool_definitions() == theirs


# ------------------------------------------------------------------ verifier details


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        (r"\boxed{C}", "C"),
        (r"\boxed{A} or maybe \boxed{B}", "A"),  # the first box
        (r"\boxed{\text{B}}", "\\\\text{B"),  # repr doubles the backslash, the regex stops at the first }
        ("no box", None),
        ("\\boxed{\nC\n}", "\\nC\\n"),  # newlines are the two characters \n in the repr
        ("it's \\boxed{D}", "D"),
    ],
)
def test_graded_text_is_the_repr_nemo_gym_searches(text: str, parsed: str | None) -> None:
    response = Response(id="r", created_at=0.0, output=[assistant_message(text)])
    assert box_parser(graded_text(response)) == parsed


async def test_reward_needs_the_last_item_to_be_an_assistant_message() -> None:
    inst = await session()
    items = parse_items(
        [
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "\\boxed{C}"}]},
            {"type": "function_call", "call_id": "c1", "name": "search", "arguments": '{"query": "x"}'},
        ]
    )
    v = await inst.verify({"expected_answer": "C"}, Response(id="r", created_at=0.0, output=items))
    assert (v.reward, v.fields) == (0.0, {"parsed_option": None})
    v = await inst.verify({"expected_answer": "C"}, Response(id="r", created_at=0.0, output=items[:1]))
    assert (v.reward, v.fields) == (1.0, {"parsed_option": "C"})


# ------------------------------------------------------------------ offline backend


def test_offline_ranking_on_the_bundled_corpus() -> None:
    backend = OfflineBackend(SearchOptions(top_k=3))
    top = [p.url.removeprefix(CORPUS_URL) for p, _ in backend.rank("Coulomb's law force between two point charges")]
    assert top[0] == "coulombs-law"
    assert [p.url.removeprefix(CORPUS_URL) for p, _ in backend.rank("time reversal mirror")][:2] == [
        "time-reversal-mirror",
        "time-reversal-acoustics",
    ]
    assert backend.rank("Carnot efficiency reservoirs")[0][0].url.endswith("carnot-efficiency")
    assert backend.rank("zzzz qqqq") == []  # no term in the corpus: no results, not arbitrary pages
    scores = [s for _, s in backend.rank("RNA interference ubiquitination")]
    assert scores == sorted(scores, reverse=True) and len(scores) <= 3


async def test_offline_corpus_from_jsonl_and_parquet(tmp_path: Path) -> None:
    pages = [
        {"url": "https://a.test/x", "title": "Zebra stripes", "text": "Zebras have black and white stripes."},
        {"url": "https://a.test/y", "title": "Lion manes", "text": "Male lions grow manes. Lions live in prides."},
        {"url": "https://a.test/z", "title": "Penguins", "text": "Penguins cannot fly but swim well."},
    ]
    paths = [write_jsonl(tmp_path / "c.jsonl", pages)]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(pages), tmp_path / "c.parquet")
        paths.append(tmp_path / "c.parquet")
    except ImportError:
        pass
    for path in paths:
        inst = await session({"corpus": str(path), "top_k": 2})
        result = json.loads(json.loads(await inst.call_tool("search", '{"query": "lion prides"}'))["search_results"])
        assert [i["link"] for i in result["items"]] == ["https://a.test/y"]
        assert result["items"][0]["snippet"] == "Lions live in prides."
        page = json.loads(await inst.call_tool("browse", '{"url": "https://a.test/z"}'))
        assert page == {"page_content": "Penguins cannot fly but swim well."}
        # offline means offline: a URL outside the corpus is never fetched
        assert json.loads(await inst.call_tool("browse", '{"url": "http://127.0.0.1:9/"}')) == {
            "page_content": "No HTML found"
        }


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"backend": "bing"}, "backend"),
        ({"top_k": 0}, "top_k must be >= 1"),
        ({"corpus": "/nonexistent/corpus.jsonl"}, "not found"),
        ({"backend": "recorded"}, "needs options.rollouts"),
        ({"colour": "blue"}, "colour"),
    ],
)
async def test_bad_options_fail_setup_with_one_line(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await GoogleSearch.setup(options)


def test_options_parse() -> None:
    assert parse_options({"backend": "tavily", "requests_per_s": 2}).requests_per_s == 2.0


def test_config_options() -> None:
    cfg = load_config(ENV_DIR / "config.yaml")
    assert cfg.resources["google_search"].options["backend"] == "offline"
