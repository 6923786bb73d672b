"""A rollout's tokens as the trainer saw them: turn by turn, the ids the environment and the chat template added
(mask 0: tool output, template) and the ids the policy generated (mask 1), each generated token with its logprob
and the policy version that sampled it; decoded per token where ``view --tokenizer PATH`` gave a tokenizer.

The same walk as ``trainers.rows.sequence`` (a later turn's prompt extends everything before it), but it never
refuses a row: a turn whose prompt does not extend the rollout so far shows its whole prompt, marked. Plain data
for the template (which escapes every string).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gym_runtime.errors import UserError

BUCKETS = 8  # logprob colours: 0 (p near 1) .. 7 (logprob <= -7)
EXTRA = "tokenizers"  # the optional extra ``view --tokenizer`` needs: pip install 'gym-runtime[tokenizers]'

Decode = Callable[[int], str]


@dataclass
class Token:
    id: Any
    kind: str  # "prompt" (the first turn's), "env" (mask 0 between generations), "gen" (mask 1)
    logprob: float | None = None
    version: int | None = None
    text: str | None = None
    klass: str = ""  # what the template writes, computed once here (a 32k-token page is 32k spans)
    title: str = ""
    shown: str = ""

    def __post_init__(self) -> None:
        lp = self.logprob
        if self.kind != "gen":
            self.klass = f"t {self.kind}"
        else:
            b = BUCKETS - 1 if lp is None else min(BUCKETS - 1, int(-lp)) if lp < 0 else 0
            self.klass = f"t gen l{b} v{(self.version or 0) % 2}"
        title = f"id {self.id}"
        if lp is not None:
            title += f" · logprob {lp:.4f}"
        if self.version is not None:
            title += f" · version {self.version}"
        self.title = title
        self.shown = str(self.id) if self.text is None else self.text


@dataclass
class Turn:
    n: int
    tokens: list[Token] = field(default_factory=list)
    note: str = ""


@dataclass
class TokenView:
    turns: list[Turn]
    ranges: list[tuple[int, int, int | None]]  # (first, last, version) over the generated tokens, in order
    prompt: int = 0
    env: int = 0
    generated: int = 0
    mean_logprob: float | None = None


def _ints(v: Any) -> list[Any]:
    return list(v) if isinstance(v, list) else []


def _versions(item: dict[str, Any], n: int) -> list[int | None]:
    """Each generated token's policy version: ``policy_version_ranges`` ([start, end, version], end exclusive) where
    the item has them, else its ``policy_version``."""
    pv = item.get("policy_version")
    out: list[int | None] = [pv if isinstance(pv, int) else None] * n
    for r in _ints(item.get("policy_version_ranges")):
        if isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) for x in r):
            for k in range(max(0, r[0]), min(n, r[1])):
                out[k] = r[2]
    return out


def token_view(row: dict[str, Any], decode: Decode | None = None) -> TokenView:
    response = row.get("response")
    output = response.get("output") if isinstance(response, dict) else None
    turns: list[Turn] = []
    seen: list[Any] | None = None
    lps: list[float] = []
    ranges: list[tuple[int, int, int | None]] = []
    counts = {"prompt": 0, "env": 0, "gen": 0}
    cache: dict[Any, str] = {}

    def text(tid: Any) -> str | None:
        if decode is None or not isinstance(tid, int):
            return None
        if tid not in cache:
            try:
                cache[tid] = decode(tid)
            except Exception:  # an id the tokenizer does not have
                cache[tid] = "\ufffd"
        return cache[tid]

    for item in output if isinstance(output, list) else []:
        if not isinstance(item, dict) or "generation_token_ids" not in item:
            continue
        turn = Turn(len(turns) + 1)
        prompt = _ints(item.get("prompt_token_ids"))
        if seen is None:
            added, kind = prompt, "prompt"
        elif prompt[: len(seen)] == seen:
            added, kind = prompt[len(seen) :], "env"
        else:
            added, kind = prompt, "env"
            turn.note = "this turn's prompt does not extend the turns before it: its whole prompt is shown"
        turn.tokens += [Token(t, kind, text=text(t)) for t in added]
        counts[kind] += len(added)
        gen = _ints(item.get("generation_token_ids"))
        glps = _ints(item.get("generation_log_probs"))
        versions = _versions(item, len(gen))
        for k, t in enumerate(gen):
            lp = glps[k] if k < len(glps) and isinstance(glps[k], int | float) else None
            lp = float(lp) if lp is not None and math.isfinite(lp) else None
            if lp is not None:
                lps.append(lp)
            g = counts["gen"]
            if ranges and ranges[-1][2] == versions[k] and ranges[-1][1] == g - 1:
                ranges[-1] = (ranges[-1][0], g, versions[k])
            else:
                ranges.append((g, g, versions[k]))
            counts["gen"] += 1
            turn.tokens.append(Token(t, "gen", lp, versions[k], text(t)))
        seen = prompt + gen
        turns.append(turn)
    mean = sum(lps) / len(lps) if lps else None
    return TokenView(turns, ranges, counts["prompt"], counts["env"], counts["gen"], mean)


def load_tokenizer(path: str) -> Decode:
    """``--tokenizer PATH``: a ``tokenizer.json`` or a folder holding one, read from local files only."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise UserError(f"--tokenizer {path}: no tokenizer.json there (give a model folder or its tokenizer.json)")
    try:
        import tokenizers
    except ImportError:
        raise UserError(
            f"--tokenizer needs the {EXTRA!r} package: pip install 'gym-runtime[{EXTRA}]' "
            "(or leave --tokenizer out: token ids are shown)"
        ) from None
    try:
        tok = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:
        raise UserError(f"--tokenizer {path}: not a tokenizer file ({e})") from None
    return Loaded(tok)


class Loaded:
    """A loaded tokenizer: called with one id, its text (the token view's); ``text`` decodes a whole generation."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self._size = tok.get_vocab_size(with_added_tokens=True)

    def __call__(self, tid: int) -> str:
        piece = self._tok.id_to_token(tid)
        if piece is None:
            return "\ufffd"
        out: str = self._tok.decode([tid], skip_special_tokens=False)
        return out or piece

    def text(self, ids: list[Any]) -> str:
        """``ids`` decoded as the model server decodes a generation (special tokens skipped); an id the tokenizer
        does not have is U+FFFD."""
        known = [t for t in ids if isinstance(t, int) and 0 <= t < self._size]
        out: str = self._tok.decode(known, skip_special_tokens=True)
        return out + "\ufffd" * (len(ids) - len(known))


TURNS_CHECKED = 20  # generations compared before the first page is served


def turns_said(row: dict[str, Any]) -> list[tuple[str, list[Any]]]:
    """Each generation of ``row`` that wrote text: (the text its messages hold, its generated ids). The ids of a turn
    ride on its last item; the messages before it are what the model server decoded them into."""
    response = row.get("response")
    output = response.get("output") if isinstance(response, dict) else None
    out: list[tuple[str, list[Any]]] = []
    said: list[str] = []
    for item in output if isinstance(output, list) else []:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message" and isinstance(item.get("content"), list):
            said += [c["text"] for c in item["content"] if isinstance(c, dict) and isinstance(c.get("text"), str)]
        if "generation_token_ids" in item:
            text, said = "".join(said), []
            ids = _ints(item.get("generation_token_ids"))
            if text.strip() and ids:
                out.append((text, ids))
    return out


def misfit(tok: Loaded, turns: list[tuple[str, str, list[Any]]]) -> tuple[str, str, str] | None:
    """Whether ``tok`` decodes the rows' generations into the words the rows hold (``turns``: where, text, ids):
    None if most do (a model server's tool parser may take some text out), else the first that does not: (where,
    the row's text, the decoded text)."""
    bad = []
    for where, text, ids in turns:
        decoded = tok.text(ids)
        if "".join(text.split()) not in "".join(decoded.split()):
            bad.append((where, text, decoded))
    return bad[0] if bad and 2 * len(bad) > len(turns) else None
