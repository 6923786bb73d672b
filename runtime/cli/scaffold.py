"""What ``gym-runtime init`` writes: a new environment package that runs and passes its tests at once.

The package is self-contained: ``NAME/__init__.py`` (a Resource with one tool and
a verifier), ``config.yaml`` (the scripted test-double policy, ``server: NAME``
resolved relative to the config — see ``gym_runtime.plugins``), ``data/example.jsonl``
(tool definitions generated from the class, so they cannot drift), ``README.md``
and ``tests/``. Variants: ``stateful`` (session state set by ``seed``, graded on
the state the tools left) and ``judge`` (an LLM judge model of the config grades
the final answer). Templates use ``__NAME__``/``__CLASS__`` placeholders, not
``$``/``{}``, because the files themselves hold ``${VAR}`` and braces.
"""

from __future__ import annotations

import importlib.util
import json
import keyword
import re
import sys
from pathlib import Path
from typing import Any

from gym_runtime.errors import UserError

# ------------------------------------------------------------------ module pieces

_HEAD = '''"""__NAME__: __SUMMARY__

Made by ``gym-runtime init``: change the tool, ``Task`` and ``verify`` into your
environment. The model is offered the tools in each row's
``responses_create_params.tools`` (``data/example.jsonl``); ``gym-runtime validate
config.yaml -i FILE`` checks rows against ``Task`` and the tools before any run.
"""

from __future__ import annotations

__IMPORT_RE__from typing import Any

import msgspec

from gym_runtime import Message, Resource, Response, Verdict, tool
__JUDGE_IMPORT__


class Task(msgspec.Struct, kw_only=True):
    """The row fields ``seed``/``verify`` read (other fields are ignored)."""

__TASK_FIELDS__
__JUDGE_PROMPT__

def final_answer(response: Response) -> str:
    """The text of the response's last assistant message ("" when there is none)."""
    for item in reversed(response.output):
        if isinstance(item, Message) and item.role == "assistant":
            if isinstance(item.content, str):
                return item.content
            return "".join(p.get("text", "") for p in item.content if isinstance(p, dict))
    return ""


class __CLASS__(Resource):
    """__CLASS_DOC__"""

    task_fields = Task
'''

_TOOL_STATELESS = '''
    @tool
    async def count_letter(self, word: str, letter: str) -> dict[str, int]:
        """Count how many times `letter` occurs in `word` (ignoring case)."""
        return {"count": word.lower().count(letter.lower()) if letter else 0}
'''

_TOOL_STATEFUL = '''    reverify = "replay"  # re-verifying replays the recorded tool calls to rebuild the cart

    def __init__(self) -> None:
        self.cart: dict[str, int] = {}

    async def seed(self, task: dict[str, Any]) -> None:
        self.cart = dict(task.get("initial_items") or {})

    @tool
    async def add_item(self, item: str, quantity: int) -> dict[str, Any]:
        """Put `quantity` of `item` into the shopping cart."""
        if quantity < 1:
            return {"error": "quantity must be at least 1"}
        self.cart[item] = self.cart.get(item, 0) + quantity
        return {"cart": self.cart}
'''

_VERIFY_ANSWER = """
    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        numbers = re.findall(r"-?\\d+", final_answer(response))
        extracted = numbers[-1] if numbers else None
        return Verdict(reward=float(extracted == task["expected_answer"]), fields={"extracted_answer": extracted})
"""

_VERIFY_STATE = """
    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        # The state the tools left, not what the model claims: a model that only says "done" scores 0.
        return Verdict(reward=float(self.cart == task["expected_items"]), fields={"final_cart": dict(self.cart)})
"""

_VERIFY_JUDGE = """
    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        answer = final_answer(response)
        prompt = JUDGE_PROMPT.format(expected=task["expected_answer"], answer=answer)
        # The judge is a model of the config (resources.__NAME__.options.judge_model): it scales like any model.
        judged = await self.models.generate(
            create_params({"input": [{"role": "user", "content": prompt}]}),
            model=self.options.get("judge_model", "judge"),
        )
        verdict = final_answer(judged)
        reward = float("[[YES]]" in verdict)__STATE_AND__
        return Verdict(reward=reward, fields={"judge_verdict": verdict[:500]})
"""

_JUDGE_PROMPT = '''

JUDGE_PROMPT = """Does the answer mean the same as the expected answer?
Expected answer: {expected}
Answer: {answer}
Reply [[YES]] or [[NO]]."""
'''

# ------------------------------------------------------------------ other files

_CONFIG = """\
# __NAME__: made by `gym-runtime init`; runs offline with the scripted test-double model:
#   gym-runtime run config.yaml -i data/example.jsonl -o out.jsonl
# `server: __NAME__` is found relative to this file (no install, no PYTHONPATH needed).
# For a real model, replace the scripted entries with e.g.:
#   policy: {adapter: openai, base_url: ${POLICY_BASE_URL}, api_key: ${POLICY_API_KEY}, model: ${POLICY_MODEL:-gpt-4.1}}
namespace: gym
nats: embedded
models:
  policy: {adapter: scripted}
__JUDGE_MODEL__resources:
  __NAME__: {server: __NAME__, replicas: 1__RES_OPTIONS__}
agents:
  __NAME___agent: {agent: agents.simple, model: policy, resource: __NAME__, max_steps: 8, timeout_s: 600}
"""

_README = """\
# __NAME__

__SUMMARY__ Made by `gym-runtime init`__VARIANT__.

```bash
gym-runtime validate config.yaml -i data/example.jsonl      # rows vs. Task and the tools
gym-runtime run config.yaml -i data/example.jsonl -o out.jsonl
python -m pytest tests                                       # the tool, verify, and a whole run
```

The bundled config uses the `scripted` test-double model (it calls every offered tool
once with schema-valid arguments, then answers), so rewards are not meaningful
until you point `models.policy` at a real model. Files: `__init__.py` (the
environment: tools, `Task`, `verify`), `config.yaml`, `data/example.jsonl` (task
rows in NeMo Gym's format; their tool definitions were generated from the class),
`tests/`.
"""

_TESTS = '''"""__NAME__'s own tests: the tool, verify, the example rows, and a whole run with the scripted model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gym_runtime import Response, assistant_message, load_config
from gym_runtime.testing import AgentEnvironment, ScriptedPolicy, tool_calls_response

HERE = Path(__file__).resolve().parents[1]
CONFIG = HERE / "config.yaml"
EXAMPLE = HERE / "data" / "example.jsonl"

load_config(CONFIG)  # makes `__NAME__` importable relative to its config: no PYTHONPATH needed
from __NAME__ import __CLASS__  # noqa: E402


def rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in EXAMPLE.read_text().splitlines() if line.strip()]


def answer(text: str) -> Response:
    return Response(id="resp_test", created_at=time.time(), output=[assistant_message(text)])


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gym_runtime.cli", *args], capture_output=True, text=True,
                          check=False, timeout=300, cwd=HERE)
__TOOL_TESTS__

def test_one_rollout_in_process() -> None:
    """The config's agent and this environment in one process, with a scripted policy (a test double for the
    LLM) and no bus or workers: the quickest loop to debug a rollout in (gym_runtime.testing.AgentEnvironment)."""
    task = rows()[0]
    policy = ScriptedPolicy(__TURNS__)
    env = AgentEnvironment(__CLASS__, policy=policy, agent="agents.simple"__JUDGE_ARG__)
    outcome = asyncio.run(env.run(task))
    assert outcome.verdict.reward == 1.0
    assert len(policy.calls) == 2  # the tool turn, then the answer (which saw the tool's output)


def test_example_rows_are_valid() -> None:
    r = cli("validate", str(CONFIG), "-i", str(EXAMPLE))
    assert r.returncode == 0, r.stderr


def test_runs_end_to_end_with_the_scripted_model(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    r = cli("run", str(CONFIG), "-i", str(EXAMPLE), "-o", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == len(rows())
    for row in got:
        assert row["reward"] in (0.0, 1.0)
        calls = [i for i in row["response"]["output"] if i["type"] == "function_call"]
        assert [c["name"] for c in calls] == ["__TOOL__"]  # the scripted model called the offered tool__E2E_EXTRA__
'''

_TESTS_STATELESS = """

def test_tool_counts_letters() -> None:
    out = asyncio.run(__CLASS__().call_tool("count_letter", '{"word": "Strawberry", "letter": "r"}'))
    assert json.loads(out) == {"count": 3}
__VERIFY_TESTS__"""

_TESTS_STATEFUL = """

async def _session(task: dict[str, Any], calls: list[tuple[str, str]]) -> __CLASS__:
    env = __CLASS__()
    await env.seed(task)
    for name, arguments in calls:
        await env.call_tool(name, arguments)
    return env


def test_tools_change_the_session_state() -> None:
    env = asyncio.run(_session({"initial_items": {"apple": 1}}, [("add_item", '{"item": "apple", "quantity": 2}')]))
    assert env.cart == {"apple": 3}
    again = asyncio.run(_session({}, []))
    assert again.cart == {}  # every rollout has its own session
__VERIFY_TESTS__"""

# What the scripted policy answers in the in-process rollout: the tool's turn, then the final answer.
_TURNS_STATELESS = """[
            tool_calls_response(("count_letter", {"word": "strawberry", "letter": "r"})),
            answer(f"It occurs {task['expected_answer']} times."),
        ]"""
_TURNS_STATEFUL = """[
            tool_calls_response(
                *[
                    ("add_item", {"item": k, "quantity": q - task["initial_items"].get(k, 0)})
                    for k, q in task["expected_items"].items()
                    if q > task["initial_items"].get(k, 0)
                ]
            ),
            answer(task.get("expected_answer", "done")),
        ]"""

_VERIFY_TESTS_ANSWER = """

def test_verify_rewards_the_right_count_only() -> None:
    task = rows()[0]
    env = __CLASS__()
    right = asyncio.run(env.verify(task, answer(f"It occurs {task['expected_answer']} times.")))
    wrong = asyncio.run(env.verify(task, answer("It occurs 99 times.")))
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    assert right.fields["extracted_answer"] == task["expected_answer"]
"""

_VERIFY_TESTS_STATE = """

def test_verify_grades_the_state_not_the_claim() -> None:
    task = rows()[0]
    calls = [("add_item", json.dumps({"item": k, "quantity": v})) for k, v in task["expected_items"].items()]
    done = asyncio.run(_session(task, calls))
    assert asyncio.run(done.verify(task, answer("done"))).reward == 1.0
    idle = asyncio.run(_session(task, []))
    assert asyncio.run(idle.verify(task, answer("done, all added"))).reward == 0.0
"""

_VERIFY_TESTS_JUDGE = '''

class Judge:
    """A TEST DOUBLE for the judge LLM: says [[YES]] when the answer contains the expected text."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    async def generate(self, params: Any, *, model: str) -> Response:
        prompt = params.input[-1].content
        self.prompts.append(prompt)
        expected = prompt.split("Expected answer: ")[1].split("\\n")[0]
        answer_text = prompt.split("Answer: ")[1].split("\\n")[0]
        return answer("[[YES]]" if expected in answer_text else "[[NO]]")


def test_verify_asks_the_judge_model() -> None:
    task = rows()[0]
    env = __SESSION__
    env.models = Judge()
    right = asyncio.run(env.verify(task, answer(task["expected_answer"])))
    wrong = asyncio.run(env.verify(task, answer("something else")))
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    assert right.fields["judge_verdict"] == "[[YES]]" and len(env.models.prompts) == 2
'''

# ------------------------------------------------------------------ example rows

_STATELESS_ROWS = [
    ("strawberry", "r", "3"),
    ("banana", "a", "3"),
    ("mississippi", "s", "4"),
    ("letter", "t", "2"),
    ("rhythm", "y", "1"),
]
_STATEFUL_ROWS = [
    ({}, {"apple": 2, "pear": 1}, "2 apples and 1 pear"),
    ({"milk": 1}, {"milk": 1, "bread": 2}, "1 milk and 2 breads"),
    ({}, {"egg": 12}, "12 eggs"),
    ({"apple": 1}, {"apple": 4}, "4 apples"),
    ({}, {"rice": 1, "bean": 3}, "1 rice and 3 beans"),
]
_SYSTEM = "You are a helpful assistant. Use the tools you are given, then answer briefly."


def _rows(stateful: bool, judge: bool, tools: list[dict]) -> list[dict]:
    rows = []
    if not stateful:
        for word, letter, n in _STATELESS_ROWS:
            prompt = f"How many times does the letter '{letter}' occur in '{word}'? Answer with the number."
            rows.append(
                {
                    "responses_create_params": {
                        "input": [{"role": "developer", "content": _SYSTEM}, {"role": "user", "content": prompt}],
                        "tools": tools,
                    },
                    "expected_answer": n,
                }
            )
        return rows
    for initial, expected, text in _STATEFUL_ROWS:
        adds = [f"{q - initial.get(k, 0)} {k}" for k, q in expected.items() if q - initial.get(k, 0)]
        prompt = f"My cart holds {json.dumps(initial)}. Add {' and '.join(adds)}, then tell me what it holds."
        row: dict[str, Any] = {
            "responses_create_params": {
                "input": [{"role": "developer", "content": _SYSTEM}, {"role": "user", "content": prompt}],
                "tools": tools,
            },
            "initial_items": initial,
            "expected_items": expected,
        }
        if judge:
            row["expected_answer"] = text
        rows.append(row)
    return rows


# ------------------------------------------------------------------ writing


class ScaffoldError(UserError):
    """A bad name or destination (one line, exit 2)."""


def class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_") if part) or "Env"


def check_name(name: str) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise ScaffoldError(f"{name!r}: an environment name must be a lowercase Python identifier (e.g. my_env)")
    if importlib.util.find_spec(name) is not None:
        raise ScaffoldError(f"{name!r}: an importable module already has this name; choose another")


def render(name: str, *, stateful: bool, judge: bool) -> dict[str, str]:
    """Relative path → text of every file but ``data/example.jsonl``."""
    cls = class_name(name)
    if stateful:
        summary = "a shopping cart per rollout; the reward checks the cart the tools left behind."
        fields = (
            "    initial_items: dict[str, int] = msgspec.field(default_factory=dict)\n"
            "    expected_items: dict[str, int]\n"
        )
        doc = "One instance per rollout: each has its own cart."
        body, tool_name = _TOOL_STATEFUL, "add_item"
    else:
        summary = "count a letter in a word with a tool; the reward checks the number answered."
        fields, doc, body, tool_name = (
            "",
            "Stateless: every instance answers the same way.",
            _TOOL_STATELESS,
            "count_letter",
        )
    if judge or not stateful:
        fields += "    expected_answer: str\n"
    if judge:
        summary = summary.split(";")[0] + "; an LLM judge model grades the final answer."
        verify = _VERIFY_JUDGE.replace(
            "__STATE_AND__", '\n        reward *= float(self.cart == task["expected_items"])' if stateful else ""
        )
    else:
        verify = _VERIFY_STATE if stateful else _VERIFY_ANSWER
    module = (
        _HEAD.replace("__JUDGE_IMPORT__\n", "from gym_runtime.messages import create_params\n" if judge else "")
        .replace("__IMPORT_RE__", "" if judge or stateful else "import re\n")
        .replace("__TASK_FIELDS__", fields)
        .replace("__JUDGE_PROMPT__", _JUDGE_PROMPT if judge else "")
        .replace("__CLASS_DOC__", doc)
        + body
        + verify
    )
    verify_tests = _VERIFY_TESTS_JUDGE if judge else (_VERIFY_TESTS_STATE if stateful else _VERIFY_TESTS_ANSWER)
    session = (
        'asyncio.run(_session(task, [("add_item", json.dumps({"item": k, "quantity": v})) '
        'for k, v in task["expected_items"].items()]))'
        if stateful
        else "__CLASS__()"
    )
    tool_tests = (
        (_TESTS_STATEFUL if stateful else _TESTS_STATELESS)
        .replace("__VERIFY_TESTS__", verify_tests)
        .replace("__SESSION__", session)
    )
    turns = _TURNS_STATEFUL if stateful else _TURNS_STATELESS
    tests = (
        _TESTS.replace("__TOOL_TESTS__", tool_tests)
        .replace("__TURNS__", turns)
        .replace("__JUDGE_ARG__", ", judge=Judge()" if judge else "")
        .replace("__TOOL__", tool_name)
        .replace("__E2E_EXTRA__", '\n        assert row["judge_verdict"]  # the judge model answered' if judge else "")
    )
    config = _CONFIG.replace("__JUDGE_MODEL__", "  judge: {adapter: scripted}\n" if judge else "").replace(
        "__RES_OPTIONS__", ", options: {judge_model: judge}" if judge else ""
    )
    variants = [v for v, on in (("--stateful", stateful), ("--judge", judge)) if on]
    readme = _README.replace("__VARIANT__", f" ({' '.join(variants)})" if variants else "")
    files = {"__init__.py": module, "config.yaml": config, "README.md": readme, f"tests/test_{name}.py": tests}
    return {
        path: text.replace("__SUMMARY__", summary[0].upper() + summary[1:])
        .replace("__CLASS__", cls)
        .replace("__NAME__", name)
        for path, text in files.items()
    }


def _tool_definitions(package: Path, name: str) -> list[dict]:
    """The generated class's tool definitions, imported from the new files under a private name."""
    mod_name = f"_gym_scaffold_{name}"
    spec = importlib.util.spec_from_file_location(
        mod_name, package / "__init__.py", submodule_search_locations=[str(package)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
        return getattr(module, class_name(name)).tool_definitions()
    finally:
        sys.modules.pop(mod_name, None)


def write_package(name: str, dest: str | Path, *, stateful: bool = False, judge: bool = False) -> Path:
    """Write the package ``dest/name``; refuses to touch an existing directory."""
    check_name(name)
    package = Path(dest) / name
    if package.exists():
        raise ScaffoldError(f"{package}: already exists; choose another name or --dir")
    files = render(name, stateful=stateful, judge=judge)
    for rel, text in files.items():
        path = package / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    tools = _tool_definitions(package, name)
    (package / "data").mkdir()
    rows = _rows(stateful, judge, tools)
    (package / "data" / "example.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return package
