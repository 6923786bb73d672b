"""math: math-verify equivalence of the final answer, with an optional LLM judge.

Matches NeMo Gym's ``math_with_judge`` resources server (its shipped config, judge
off, is the default here). What is graded:

- The **response text** is every ``output_text`` part of every message in the
  response, concatenated with nothing in between (reasoning items are ignored).
- The **library check** (Hugging Face ``math-verify``): the expected answer, with
  outer ``\\( \\)`` / ``$ $`` delimiters stripped, is wrapped in ``\\boxed{}`` and
  parsed as LaTeX; the response is parsed with math-verify's expression and LaTeX
  extractors (boxed answers first; without a box it takes the last expression it
  finds, so a plain "The answer is 32." can be right, and several boxes become a
  set). ``library_reward`` is 1.0 when any extracted prediction verifies against the
  gold. ``extracted_answer`` is ``str()`` of the first prediction that verifies, else
  of the first prediction (SymPy's spelling: ``'Interval.Ropen(2, 5)'``,
  ``'25*(1/100)'``), or None. Any error, and running past
  ``library_verifier_timeout_seconds``, gives ``(0.0, None)``.
- The check runs in a worker process (``run_in_process``), never on the event
  loop; a timed-out worker is killed and replaced, the resource worker goes on.
- The **judge** (``should_use_judge: true``) is asked only when ``library_reward``
  is not above 0.5: first with (expected, response), then, if it says equal, with
  the two swapped; both must say ``[[A=B]]`` for reward 1.0. A verdict is the label
  that occurs first in the ``output_text`` that is the last content part of the
  judge's last output item (which must be a message); anything else is "not
  equal". The judge is the config's model ``judge_model``, reached through
  ``self.models``. A failing judge call raises (the rollout becomes a failure row).

Fields: ``extracted_answer``, ``library_reward``, ``judge_evaluations`` (None, or
per judge call ``{"responses_create_params": ..., "response": ...}`` in NeMo Gym's
shape). ``reward`` is ``library_reward`` unless the judge decided.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

import msgspec

from gym_runtime.messages import CreateParams, Message, Response, create_params, output_text, recorded_create_params
from gym_runtime.resource import Resource, Verdict, run_in_process
from gym_runtime.resource import parse_options as _parse_options

# The judge prompt NeMo Gym's math_with_judge uses (adapted there from Arena Hard).
JUDGE_SYSTEM_MESSAGE = """Please act as an impartial judge and evaluate the equivalence of the solutions given by two AI assistants to the mathematical problem displayed below. You will be given AI assistant A's answer and AI assistant B's answer. Your job is to evaluate whether assistant A's answer is equivalent to assistant B's answer.

Consider the mathematical equivalence of the AI assistants' answers above all other considerations. If the problem requests special formatting instructions, you may disregard any formatting considerations when evaluating the answers -- consider only mathematical equivalence.

After evaluating both answers for equivalence, you must output only one of the following choices as your final verdict with a label:

1.  The AI assistants' answers are equivalent: [[A=B]]
2.  The AI assistants' answers are different: [[A!=B]]

Example output: "My final verdict is different [[A!=B]]"."""
JUDGE_PROMPT_TEMPLATE = (
    "<|Problem|>\n{question}\n\n"
    "<|Start of Assistant A's Answer|>\n{first_answer}\n<|End of Assistant A's Answer|>\n\n"
    "<|Start of Assistant B's Answer|>\n{second_answer}\n<|End of Assistant B's Answer|>"
)
EQUAL_LABEL = "[[A=B]]"
NOT_EQUAL_LABEL = "[[A!=B]]"
# Seconds a worker process may take to start (interpreter, SymPy import) on top of the check's timeout.
WORKER_START_ALLOWANCE_S = 30.0
TIMEOUT_EXIT_CODE = 124  # a worker process that ran past the deadline exits with this


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``resources.<name>.options`` in the config; defaults are NeMo Gym's shipped config."""

    should_use_judge: bool = False
    judge_model: str = "judge"  # a key of the config's ``models``
    judge_responses_create_params: dict[str, Any] = msgspec.field(default_factory=lambda: {"input": []})
    library_verifier_timeout_seconds: float = 10.0
    # Worker processes running math-verify at once (per resource worker).
    library_verifier_max_concurrency: int = max(1, min(4, os.cpu_count() or 1))
    # math-verify's own timeout for each parse and comparison step (math-verify's default is 5).
    math_verify_timeout_seconds: int = 10

    def __post_init__(self) -> None:
        if self.library_verifier_timeout_seconds <= 0:
            raise ValueError("library_verifier_timeout_seconds must be positive")
        if self.math_verify_timeout_seconds < 1:
            raise ValueError("math_verify_timeout_seconds must be at least 1")
        if self.library_verifier_max_concurrency < 1:
            raise ValueError("library_verifier_max_concurrency must be at least 1")


def parse_options(raw: dict[str, Any]) -> Options:
    return _parse_options(raw, Options, "math")


def strip_math_delimiters(s: str) -> str:
    """Drop one outer ``\\( ... \\)`` and then one outer ``$ ... $`` around an expected answer."""
    s = s.strip()
    if s.startswith("\\(") and s.endswith("\\)"):
        s = s[2:-2].strip()
    if len(s) > 1 and s.startswith("$") and s.endswith("$"):
        s = s[1:-1].strip()
    return s


# --------------------------------------------------------------- worker process side


def _watchdog(deadline_s: float) -> threading.Event:
    """Exit this (worker) process unless the returned event is set within ``deadline_s`` seconds."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(deadline_s):
            os._exit(TIMEOUT_EXIT_CODE)

    threading.Thread(target=watch, name="math-verify-deadline", daemon=True).start()
    return done


def library_verify(
    expected_answer: str, generated: str, deadline_s: float | None = None, step_timeout_s: int = 10
) -> tuple[float, str | None]:
    """math-verify's verdict on ``generated`` against ``expected_answer``; runs in a worker process.

    This is math-verify's ``math_metric`` (gold: LaTeX extraction; prediction:
    expression then LaTeX extraction; equality as ``verify`` decides) spelled out so
    that its per-step timeouts (``step_timeout_s``) can be set. Any failure, math-verify's
    own timeouts included (they raise a BaseException), gives ``(0.0, None)``.

    With ``deadline_s``, a watchdog thread ends this process (``os._exit``) if the
    check is still running then: the clock starts with the check itself, as NeMo
    Gym's does in its forked child, not with the worker's start-up. (SymPy is Python
    code and lets the watchdog run; a long call into C that holds the GIL is caught
    by the event loop side's own, later, timeout.)
    """
    # Imported before the clock starts: a cold worker's import is not part of the check.
    from math_verify import grader, parse
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
    from math_verify.utils import timeout

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    done = _watchdog(deadline_s) if deadline_s is not None else None
    try:
        gold_text = "\\boxed{" + strip_math_delimiters(expected_answer) + "}"
        preds = parse(generated, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=step_timeout_s)
        golds = parse(gold_text, (LatexExtractionConfig(),), parsing_timeout=step_timeout_s)
        if not golds:
            return 0.0, None  # math_metric raises "No gold targets found"
        try:  # SymPy's str() can be slow: math_metric gives it 2 s (its timeout, a BaseException, fails the check)
            str_golds, str_preds = timeout(2)(lambda: ([str(g) for g in golds], [str(p) for p in preds]))()
        except Exception:  # noqa: BLE001 - any other failure: no extracted answer, as in math_metric
            str_golds = str_preds = None
        reward = 1.0 if grader.verify(golds, preds, 6, timeout_seconds=step_timeout_s) else 0.0
        if str_preds is None:
            return reward, None
        for pred in str_preds:
            if any(grader.verify(g, pred) for g in str_golds):
                return reward, pred
        return reward, str_preds[0] if str_preds else None
    except BaseException:  # noqa: BLE001 - math-verify's TimeoutException is a BaseException
        return 0.0, None
    finally:
        if done is not None:
            done.set()


# ------------------------------------------------------------------------ resource


def judge_says_equal(response: Response) -> bool:
    """True iff the judge's last output is a message whose last part is ``output_text``
    in which ``[[A=B]]`` occurs before any ``[[A!=B]]``."""
    if not response.output or not isinstance(response.output[-1], Message):
        return False
    content = response.output[-1].content
    if isinstance(content, str):
        text = content
    elif content and isinstance(content[-1], dict) and content[-1].get("type") == "output_text":
        text = content[-1].get("text") or ""
    else:
        return False
    eq, neq = text.find(EQUAL_LABEL), text.find(NOT_EQUAL_LABEL)
    return eq >= 0 and (neq < 0 or eq < neq)


def _task_str(task: dict[str, Any], key: str) -> str:
    value = task.get(key)
    if not isinstance(value, str):
        raise ValueError(f"task row needs a string {key!r}, got {value!r}")  # noqa: TRY004 - an invalid row
    return value


class MathTask(msgspec.Struct, kw_only=True):
    """The task fields verify reads."""

    question: str
    expected_answer: str


class MathWithJudge(Resource):
    """Stateless; CPU-heavy checking goes to a small pool of worker processes."""

    task_fields = MathTask
    requires = ("math_verify",)
    install = "pip install 'gym-runtime[envs]'"

    _opts: Options = Options()
    _limiter: Any = None
    _limiter_loop: Any = None

    @classmethod
    async def setup(cls, options: dict[str, Any]) -> None:
        await super().setup(options)
        cls._opts = parse_options(options)
        cls._limiter = None

    @classmethod
    def _process_limiter(cls) -> Any:
        """One capacity limiter per event loop (anyio's process pool is per loop too)."""
        import anyio

        loop = asyncio.get_running_loop()
        if cls._limiter is None or cls._limiter_loop is not loop:
            cls._limiter = anyio.CapacityLimiter(cls._opts.library_verifier_max_concurrency)
            cls._limiter_loop = loop
        return cls._limiter

    async def library_check(self, expected_answer: str, generated: str) -> tuple[float, str | None]:
        """``library_verify`` in a worker process, bounded by the per-verify timeout.

        The worker enforces the timeout on the check itself and exits when it runs
        past it (anyio then replaces it); the event loop side also gives up (killing the worker) after the
        timeout plus an allowance for a cold worker's start-up, should even that fail.
        """
        timeout = self._opts.library_verifier_timeout_seconds
        try:
            return await run_in_process(
                library_verify,
                expected_answer,
                generated,
                timeout,
                self._opts.math_verify_timeout_seconds,
                timeout=timeout + WORKER_START_ALLOWANCE_S,
                limiter=self._process_limiter(),
            )
        except TimeoutError:
            return 0.0, None
        except Exception:  # noqa: BLE001 - a worker that died (BrokenWorkerProcess) scores 0, as in NeMo Gym
            return 0.0, None

    async def _judge(self, question: str, first: str, second: str) -> tuple[bool, dict[str, Any]]:
        opts = self._opts
        prompt = JUDGE_PROMPT_TEMPLATE.format(question=question, first_answer=first, second_answer=second)
        messages = [
            {"content": JUDGE_SYSTEM_MESSAGE, "role": "system", "type": "message"},
            {"content": prompt, "role": "user", "type": "message"},
        ]
        base = {k: v for k, v in opts.judge_responses_create_params.items() if k != "input"}
        params: CreateParams = create_params({**base, "input": messages})
        response = await self.models.generate(params, model=opts.judge_model)
        record = {
            "responses_create_params": recorded_create_params({**base, "input": messages}),
            "response": msgspec.to_builtins(response),
        }
        return judge_says_equal(response), record

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        question = _task_str(task, "question")
        expected = _task_str(task, "expected_answer")
        generated = output_text(response.output)
        library_reward, extracted = await self.library_check(expected, generated)
        reward, evaluations = library_reward, None
        if self._opts.should_use_judge and library_reward <= 0.5:
            # NeMo Gym's recorded rollouts show the judge the whole response text.
            equal, first = await self._judge(question, expected, generated)
            evaluations = [first]
            reward = 0.0
            if equal:
                equal, second = await self._judge(question, generated, expected)
                evaluations.append(second)
                reward = 1.0 if equal else 0.0
        return Verdict(
            reward=reward,
            fields={"extracted_answer": extracted, "library_reward": library_reward, "judge_evaluations": evaluations},
        )
