"""A Dockerfile's ``FROM`` lines with their variables resolved as ``docker build`` resolves them.

Task repositories write ``ARG BASE_IMAGE=debian:12`` then ``FROM ${BASE_IMAGE}``: the image a ``FROM`` names
is known only once the ``ARG`` lines before the first ``FROM`` (the global scope) are read, each default
overridden by a build argument of the same name (``--build-arg``), as the builder does. Only variables
declared there count for ``FROM``; an undeclared one is empty.

BuildKit's automatic platform arguments (``BUILDPLATFORM``, ``TARGETPLATFORM``, ...) are not defined by the
engine's classic builder (the ``/build`` API our images are built through): undeclared, they are empty as
there. A ``--platform`` flag that names only them is dropped rather than left to fail ("failed to parse
platform"): in a single-platform build they name the engine's own platform, which is what it builds for.
Anything still unresolvable (an empty image name, an expansion the builder's lexer does not know) is a
``UserError`` naming the line.
"""

from __future__ import annotations

import re

from gym_runtime.errors import UserError

_ARG = re.compile(r"^\s*ARG\s+(.*)$", re.IGNORECASE)
FROM_LINE = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]*")  # what a reference may hold (its grammar is the engine's)
_PLATFORM_FLAG = re.compile(r"--platform=(\S*)", re.IGNORECASE)
# what BuildKit defines by itself and the classic builder does not
BUILDKIT_ONLY = frozenset(
    f"{side}{part}" for side in ("BUILD", "TARGET") for part in ("PLATFORM", "OS", "ARCH", "VARIANT")
)


class Unresolvable(ValueError):
    """A word the builder's lexer would refuse or that this resolver does not model."""


def resolve_from(dockerfile: str, build_args: dict[str, str] | None = None) -> str:
    """The Dockerfile with each ``FROM`` line's image (and ``--platform``) resolved; other lines as written."""
    scope: dict[str, str] = {}
    overrides = build_args or {}
    seen_from = False
    out = []
    for n, line in enumerate(dockerfile.splitlines(), start=1):
        arg = _ARG.match(line)
        if arg and not seen_from:
            _declare(arg.group(1), scope, overrides, n)
        m = FROM_LINE.match(line)
        if m:
            seen_from = True
            line = _resolved_line(m, scope, n)
        out.append(line)
    return "\n".join(out) + ("\n" if dockerfile.endswith("\n") else "")


def _declare(decl: str, scope: dict[str, str], overrides: dict[str, str], n: int) -> None:
    """``ARG A=1 B C="x y"``: each name's value in the global scope (a build argument wins over a default)."""
    for word in _words(decl):
        name, eq, default = word.partition("=")
        if not _NAME.fullmatch(name):
            raise UserError(f"environment/Dockerfile line {n}: ARG {word!r}: not a variable name")
        try:
            value = _expand(default, scope) if eq else ""
        except Unresolvable as e:
            raise UserError(f"environment/Dockerfile line {n}: ARG {word}: {e}") from None
        if eq or name in overrides:  # ``ARG A`` alone, not given: unset (``${A-x}`` is x), as the builder has it
            scope[name] = overrides.get(name, value)


def _words(text: str) -> list[str]:
    """Split on unquoted blanks, quotes kept (expanded later with the word)."""
    words, cur, quote, escaped = [], "", "", False
    for ch in text:
        if escaped:
            cur, escaped = cur + ch, False
        elif ch == "\\":
            cur, escaped = cur + ch, True
        elif quote:
            cur += ch
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            cur, quote = cur + ch, ch
        elif ch.isspace():
            if cur:
                words.append(cur)
            cur = ""
        else:
            cur += ch
    return [*words, cur] if cur else words


def _resolved_line(m: re.Match[str], scope: dict[str, str], n: int) -> str:
    head, flags, image, rest = m.group(1), m.group(2), m.group(3), m.group(4)
    try:
        resolved = _expand(image, scope)
    except Unresolvable as e:
        raise UserError(f"environment/Dockerfile line {n}: FROM {image}: {e}") from None
    if not _IMAGE.fullmatch(resolved):
        empty = [v for v in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", image) if not scope.get(v)]
        hint = (
            f": declare it before the first FROM with a default (ARG {empty[0]}=IMAGE) or give it (--build-arg"
            f" {empty[0]}=IMAGE)"
            if empty
            else ""
        )
        raise UserError(f"environment/Dockerfile line {n}: FROM {image} resolves to {resolved!r}, not an image{hint}")
    return f"{head}{_resolved_flags(flags, scope, n)}{resolved}{rest}"


def _resolved_flags(flags: str, scope: dict[str, str], n: int) -> str:
    platform = _PLATFORM_FLAG.search(flags)
    if platform is None:
        return flags
    names = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", platform.group(1)))
    if names and names <= BUILDKIT_ONLY and not names & set(scope):
        return (flags[: platform.start()] + flags[platform.end() :]).lstrip()  # the engine's own platform
    try:
        _expand(platform.group(1), scope)
    except Unresolvable as e:
        raise UserError(f"environment/Dockerfile line {n}: FROM {platform.group(0)}: {e}") from None
    return flags  # the engine expands it itself, from the same global ARGs


def _expand(word: str, scope: dict[str, str]) -> str:
    """The builder's word processing: quotes removed, ``\\`` escapes, ``$A``, ``${A}``, ``${A:-x}``,
    ``${A-x}``, ``${A:+x}``, ``${A+x}`` (unset variables are empty)."""
    out, i, quote = [], 0, ""
    while i < len(word):
        ch = word[i]
        if ch == "\\" and quote != "'" and i + 1 < len(word):
            out.append(word[i + 1])
            i += 2
        elif ch in "'\"" and quote in ("", ch):
            quote = "" if quote else ch
            i += 1
        elif ch == "$" and quote != "'":
            value, i = _variable(word, i + 1, scope)
            out.append(value)
        else:
            out.append(ch)
            i += 1
    if quote:
        raise Unresolvable(f"unmatched {quote}")
    return "".join(out)


def _variable(word: str, i: int, scope: dict[str, str]) -> tuple[str, int]:
    """The value of the variable that starts at ``word[i]`` (just past ``$``), and where the word goes on."""
    if i < len(word) and word[i] == "{":
        close = _closing_brace(word, i)
        body = word[i + 1 : close]
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-+])(.*))?", body)
        if m is None:
            raise Unresolvable(f"${{{body}}}: an expansion the builder does not support")
        name, op, alt = m.group(1), m.group(2), m.group(3) or ""
        value = scope.get(name)
        if op in ("-", ":-"):
            use_alt = value is None or (op == ":-" and value == "")
            value = _expand(alt, scope) if use_alt else value
        elif op in ("+", ":+"):
            use_alt = value is not None and (op == "+" or value != "")
            value = _expand(alt, scope) if use_alt else ""
        return value or "", close + 1
    m = _NAME.match(word, i)
    if m is None:
        return "$", i  # a lone '$' is itself
    return scope.get(m.group(0), ""), m.end()


def _closing_brace(word: str, i: int) -> int:
    """Where the ``{`` at ``word[i]`` closes (``${A:-${B}}`` nests)."""
    depth = 0
    for j in range(i, len(word)):
        depth += {"{": 1, "}": -1}.get(word[j], 0)
        if depth == 0:
            return j
    raise Unresolvable("missing '}'")
