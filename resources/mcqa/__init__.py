"""mcqa: multiple-choice questions graded by the answer letter the model gives.

Matches NeMo Gym's ``mcqa`` resources server. The task row carries ``options``
(a list of one-letter dicts, ``[{"A": "text"}, {"B": "text"}, ...]``), the gold
``expected_answer`` letter, an optional ``grading_mode`` and an optional
``template_metadata`` whose ``output_regex`` names the answer format the prompt
asked for. The graded text is every ``output_text`` part of every message item of
the response, joined and stripped (reasoning items are never read).

Extraction, first hit wins:

1. ``template_metadata.output_regex`` (a regex, or a list of regexes tried in
   order): the *last* case-insensitive match of the regex's first group. A single
   letter is taken as is, even one outside the options (the template is
   trusted); otherwise the captured text must equal one option's text
   (case and whitespace-insensitive).
2. the grading mode (the config's ``options.grading_mode`` overrides the row's):
   - ``strict_single_letter_boxed`` (default): the last ``\\boxed{...}`` (braces
     counted, ``\\text{}`` wrappers removed) must hold one upper-case letter with
     nothing but non-letters around it (``\\boxed{[C]}``), or start with a letter
     followed by ``:`` ``)`` ``.`` or ``-`` (``\\boxed{B: option text}``, on one
     line or several); the letter must be one of the options.
   - ``lenient_boxed``: strict first, else the text inside the last box must
     contain exactly one option's text.
   - ``lenient_answer_colon``: the first ``Answer: ...`` line; a single option
     letter (any case) or an option's exact text.
   - ``lenient_answer_colon_md`` (config only): the last markdown-tolerant
     ``**Answer:** ...`` payload (or a payload after the template's
     ``answer_prefix``) that names exactly one option letter; with an
     ``answer_prefix`` it falls back to the strict box.

``reward`` is 1.0 iff the extracted letter equals the gold letter. Extra fields:
``expected_answer`` (the gold, stripped and upper-cased) and ``extracted_answer``
(the letter, or null).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from typing import Any, Literal, get_args

import msgspec

from gym_runtime.messages import Response, output_text
from gym_runtime.resource import Resource, Verdict

RowMode = Literal["strict_single_letter_boxed", "lenient_boxed", "lenient_answer_colon"]
Mode = Literal["strict_single_letter_boxed", "lenient_boxed", "lenient_answer_colon", "lenient_answer_colon_md"]
ROW_MODES: tuple[str, ...] = get_args(RowMode)
MODES: tuple[str, ...] = get_args(Mode)

# A box holding just a letter among non-letters: "E", "[C]", "(B)".
_BOX_LETTER_ONLY = re.compile(r"^[^A-Za-z]*([A-Z])[^A-Za-z]*$")
# A box starting with a letter and a delimiter, the option text after it ignored: "E: ...", "C) ...".
_BOX_LETTER_LABEL = re.compile(r"^\s*([A-Z])\s*[:).\-]")
_TEXT_WRAPPER = re.compile(r"\\text\{\s*(.*?)\s*\}", re.S)
_ANSWER_COLON = re.compile(r"(?i)answer\s*:\s*(.+)")
_ANSWER_PAYLOAD_MD = re.compile(r"(?im)[*_]{0,2}Answer[*_]{0,2}\s*:[*_\s]{0,2}(.+)")
_LONE_LETTER = re.compile(r"(?<![A-Za-z])([A-Za-z])(?![A-Za-z])")
_LEADING_LETTER = re.compile(r"^([a-zA-Z])(?![a-zA-Z0-9])")
_LAST_STANDALONE_CAPITAL = re.compile(r"\b[A-Z]\b(?!.*\b[A-Z]\b)", re.S)
_LIST_SEPARATOR = re.compile(r"(?:\s*[/|&,;]\s*|\s+(?:or|and)\s+|\s+)", re.I)
_BOX = "\\boxed{"
# Answer letters written in other scripts, read as A-D (the template regexes are case-insensitive).
_FOREIGN_LETTERS = str.maketrans(
    {
        "أ": " A",
        "ب": " B",
        "ج": " C",
        "د": " D",
        "অ": " A",
        "ব": " B",
        "ড": " C",
        "ঢ": " D",
        "Ａ": " A",
        "Ｂ": " B",
        "Ｃ": " C",
        "Ｄ": " D",
    }
)


# ------------------------------------------------------------------ helpers


def option_letters(options: list[dict[str, str | None]] | None) -> set[str]:
    """Upper-cased one-letter keys whose option text is not null."""
    return {
        k.upper()
        for entry in options or []
        for k, v in entry.items()
        if isinstance(k, str) and len(k) == 1 and k.isalpha() and v is not None
    }


def _squash(s: str) -> str:
    """Lower-case and collapse whitespace, for option-text comparisons."""
    return " ".join(s.lower().split())


def _unwrap_text(s: str) -> str:
    """Remove nested ``\\text{...}`` wrappers around a whole string."""
    while (m := _TEXT_WRAPPER.fullmatch(s)) is not None:
        s = m.group(1)
    return s


def _unify_letters(s: str) -> str:
    return unicodedata.normalize("NFKC", s).translate(_FOREIGN_LETTERS).strip()


def last_box(text: str) -> str | None:
    """Everything inside the last ``\\boxed{`` up to its matching brace; None if absent or unclosed."""
    start = text.rfind(_BOX)
    if start < 0:
        return None
    depth = 0
    for i in range(start + len(_BOX), len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            if depth == 0:
                return text[start + len(_BOX) : i]
            depth -= 1
    return None


def _option_with_text(text: str, options: list[dict[str, str | None]] | None, letters: set[str]) -> str | None:
    """The first option (in order) whose normalized text equals ``text``'s."""
    want = _squash(text)
    for entry in options or []:
        for k, v in entry.items():
            if v is not None and k.upper() in letters and _squash(v) == want:
                return k.upper()
    return None


# ------------------------------------------------------------------ extractors


def strict_boxed(text: str, letters: set[str]) -> str | None:
    inner = last_box(text)
    if inner is None:
        return None
    inner = _unwrap_text(inner.strip())
    m = _BOX_LETTER_ONLY.match(inner) or _BOX_LETTER_LABEL.match(inner)
    if m is None:
        return None
    letter = m.group(1).upper()
    return letter if letter in letters else None


def boxed_option_text(text: str, options: list[dict[str, str | None]] | None, letters: set[str]) -> str | None:
    """The one option whose text appears inside the last box (None if zero or several do)."""
    inner = last_box(text)
    if inner is None:
        return None
    inner = inner.strip()
    candidates = {_squash(inner), _squash(_unwrap_text(inner))}
    texts = [
        (k.upper(), _squash(v))
        for entry in options or []
        for k, v in entry.items()
        if v is not None and isinstance(k, str) and len(k) == 1 and k.upper() in letters
    ]
    hits = {letter for cand in candidates for letter, t in texts if t and t in cand}
    return hits.pop() if len(hits) == 1 else None


def answer_colon(text: str, options: list[dict[str, str | None]] | None, letters: set[str]) -> str | None:
    m = _ANSWER_COLON.search(text)
    if m is None:
        return None
    candidate = _unwrap_text(m.group(1)).strip()
    if len(candidate) == 1 and candidate.isalpha() and candidate.upper() in letters:
        return candidate.upper()
    return _option_with_text(candidate, options, letters)


def _lists_several_choices(text: str, letters: set[str]) -> bool:
    """True when distinct option letters are written as a list ("A or B", "A, C")."""
    found = [(m.group(1).upper(), m.span(1)) for m in _LONE_LETTER.finditer(text) if m.group(1).upper() in letters]
    return any(
        a != b and _LIST_SEPARATOR.fullmatch(text[sa[1] : sb[0]]) is not None
        for (a, sa), (b, sb) in zip(found, found[1:], strict=False)
    )


def _choice_letter(payload: str, letters: set[str]) -> str | None:
    candidate = _unify_letters(payload).strip().strip("*_` \t\n\r.,;:")
    if _lists_several_choices(candidate, letters):
        return None
    if len(candidate) == 1:
        letter: str | None = candidate
    elif (m := _LEADING_LETTER.match(candidate)) is not None:
        letter = m.group(1)
    else:
        m = _LAST_STANDALONE_CAPITAL.search(candidate)
        letter = m.group(0) if m else None
    if letter and letter.upper() in letters:
        return letter.upper()
    return None


def answer_colon_md(text: str, letters: set[str], prefix: str | None) -> str | None:
    text = unicodedata.normalize("NFKC", text)
    found = [(m.start(), m.group(1)) for m in _ANSWER_PAYLOAD_MD.finditer(text)]
    if prefix:
        pat = re.compile(re.escape(unicodedata.normalize("NFKC", prefix)) + r"\s*", re.IGNORECASE)
        for m in pat.finditer(text):
            end = text.find("\n", m.end())
            found.append((m.start(), text[m.end() : end if end >= 0 else len(text)]))
    found.sort(key=lambda f: f[0])
    for _, payload in reversed(found):
        if (letter := _choice_letter(payload, letters)) is not None:
            return letter
    return None


def template_regex(
    text: str, pattern: str, letters: set[str], options: list[dict[str, str | None]] | None
) -> str | None:
    """The last match of a template's ``output_regex``; a captured single letter is trusted as is."""
    try:
        matches = re.findall(pattern, text, re.IGNORECASE)
    except re.error:
        return None
    if not matches:
        return None
    captured = matches[-1]
    if not isinstance(captured, str):  # several groups: NeMo Gym fails the same way
        raise ValueError(f"template_metadata.output_regex {pattern!r} must have at most one group")
    captured = _unify_letters(captured.strip()).upper()
    if len(captured) == 1 and captured.isalpha():
        return captured
    return _option_with_text(captured, options, letters)


def template_regexes(
    text: str, patterns: str | Iterable[str], letters: set[str], options: list[dict[str, str | None]] | None
) -> str | None:
    if isinstance(patterns, str):
        patterns = [patterns]
    for pattern in patterns:
        if (letter := template_regex(text, pattern, letters, options)) is not None:
            return letter
    return None


# ------------------------------------------------------------------ task


def _task_fields(row: dict[str, Any]) -> tuple[list[dict[str, str | None]] | None, str | None, str, dict | None]:
    options = row.get("options")
    if options is not None and not (
        isinstance(options, list)
        and all(isinstance(e, dict) and all(isinstance(v, str) or v is None for v in e.values()) for e in options)
    ):
        raise ValueError("task row: options must be a list of {letter: text} objects")
    expected = row.get("expected_answer")
    if expected is not None and not isinstance(expected, str):
        raise ValueError("task row: expected_answer must be a string")
    mode = row.get("grading_mode", "strict_single_letter_boxed")
    if mode not in ROW_MODES:
        raise ValueError(f"task row: grading_mode must be one of {', '.join(ROW_MODES)}; got {mode!r}")
    template = row.get("template_metadata")
    if template is not None and not isinstance(template, dict):
        raise ValueError("task row: template_metadata must be an object")
    return options, expected, mode, template


def grade(row: dict[str, Any], text: str, mode_override: str | None = None) -> tuple[float, str, str | None]:
    """(reward, expected_answer, extracted_answer) for one response text."""
    options, expected, mode, template = _task_fields(row)
    gold = (expected or "").strip().upper()
    letters = option_letters(options)
    mode = mode_override or mode
    text = text.strip()
    if not text:
        return 0.0, gold, None
    pred: str | None = None
    if template and "output_regex" in template:
        pred = template_regexes(text, template["output_regex"], letters, options)
    if pred is None:
        if mode == "strict_single_letter_boxed":
            pred = strict_boxed(text, letters)
        elif mode == "lenient_boxed":
            pred = strict_boxed(text, letters) or boxed_option_text(text, options, letters)
        elif mode == "lenient_answer_colon":
            pred = answer_colon(text, options, letters)
        elif mode == "lenient_answer_colon_md":
            prefix = (template or {}).get("answer_prefix")
            pred = answer_colon_md(text, letters, prefix)
            if pred is None and prefix:
                pred = strict_boxed(text, letters)
    reward = 1.0 if pred is not None and gold and pred == gold else 0.0
    return reward, gold, pred


class MCQATask(msgspec.Struct, kw_only=True):
    """The task fields verify reads (checked in depth by ``_task_fields``)."""

    options: list[dict[str, str | None]] | None = None
    expected_answer: str | None = None
    grading_mode: str = "strict_single_letter_boxed"
    template_metadata: dict[str, Any] | None = None


class MCQA(Resource):
    """Stateless and single-turn: no tools; the config may pin ``options.grading_mode``."""

    task_fields = MCQATask
    check_task = staticmethod(_task_fields)

    @classmethod
    async def setup(cls, options: dict[str, Any]) -> None:
        mode = options.get("grading_mode")
        if mode is not None and mode not in MODES:
            raise ValueError(f"mcqa options.grading_mode must be one of {', '.join(MODES)}; got {mode!r}")
        await super().setup(options)

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        reward, gold, pred = grade(task, output_text(response.output), self.options.get("grading_mode"))
        return Verdict(reward=reward, fields={"expected_answer": gold, "extracted_answer": pred})
