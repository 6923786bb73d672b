"""Make and apply a repository's unified diff with Python alone, for images without ``git`` or ``patch``.

A sandbox of the fleet runs this file (``python3 patch_tool.py diff BASE WORK`` / ``apply PATCH [ROOT]`` /
``unpack FILES.json ROOT...``: a row's ``repo_files`` written out)
when its image has no ``git``: the locally built images here are a Debian base with Python and nothing
else. Standard library only, so it runs in any image with a ``python3``. ``diff`` writes git's layout
(``diff --git a/p b/p``, ``new file mode``, ``deleted file mode``) for text files, skipping ``.git`` and
``__pycache__``; ``apply`` takes such a diff (git's, or ``diff -u``'s with ``a/``/``b/`` prefixes) and
applies every hunk or none: a hunk whose context is not found (at its line or anywhere in the file)
leaves the tree untouched and exits 1 naming it. Binary patches and renames are not handled.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys

SKIP = {".git", "__pycache__"}
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
NO_EOL = "\\ No newline at end of file"


def _files(root: str) -> dict[str, str]:
    out = {}
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP)
        for n in names:
            p = os.path.join(d, n)
            if os.path.isfile(p) and not os.path.islink(p):
                out[os.path.relpath(p, root)] = p
    return out


def _text(path: str | None) -> list[str] | None:
    if path is None:
        return []
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return None


def diff_trees(base: str, work: str) -> str:
    """``work`` against ``base`` as a git-style unified diff (text files only)."""
    a, b = _files(base), _files(work)
    out: list[str] = []
    for rel in sorted(set(a) | set(b)):
        old, new = _text(a.get(rel)), _text(b.get(rel))
        if old is None or new is None or old == new:
            continue
        out.append(f"diff --git a/{rel} b/{rel}\n")
        if rel not in a:
            out.append("new file mode 100644\n")
        if rel not in b:
            out.append("deleted file mode 100644\n")
        src = f"a/{rel}" if rel in a else "/dev/null"
        dst = f"b/{rel}" if rel in b else "/dev/null"
        for line in difflib.unified_diff(old, new, src, dst):
            if line.startswith(("--- ", "+++ ")):
                line = line.rstrip("\n") + "\n"  # difflib adds a tab-less header; keep git's
            out.append(line if line.endswith("\n") else line + "\n" + NO_EOL + "\n")
    return "".join(out)


def _strip(name: str) -> str | None:
    name = name.split("\t", 1)[0].strip()
    if name == "/dev/null":
        return None
    return name[2:] if name[:2] in ("a/", "b/") else name


def _sections(patch: str) -> list[tuple[str | None, str | None, list[list[str]]]]:
    """[(old path, new path, hunks)], each hunk its body lines (with ' ', '-', '+', '\\' prefixes)."""
    lines = patch.splitlines(keepends=True)
    out: list[tuple[str | None, str | None, list[list[str]]]] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new, hunks = _strip(lines[i][4:]), _strip(lines[i + 1][4:]), []
            i += 2
            while i < len(lines) and (m := HUNK.match(lines[i])):
                n_old = int(m.group(2)) if m.group(2) is not None else 1
                n_new = int(m.group(4)) if m.group(4) is not None else 1
                body, i = [], i + 1
                while i < len(lines) and (n_old > 0 or n_new > 0 or lines[i].startswith("\\")):
                    line = lines[i]
                    tag = line[:1] if line.strip("\n") else " "  # an empty context line lost its space
                    if tag == " ":
                        n_old, n_new = n_old - 1, n_new - 1
                    elif tag == "-":
                        n_old -= 1
                    elif tag == "+":
                        n_new -= 1
                    elif tag != "\\":
                        raise ValueError(f"malformed hunk line: {line!r}")
                    body.append(line if line.strip("\n") else " \n")
                    i += 1
                hunks.append([m.group(1), *body])
            out.append((old, new, hunks))
        else:
            i += 1
    return out


def _sides(body: list[str]) -> tuple[list[str], list[str]]:
    old: list[str] = []
    new: list[str] = []
    last: list[list[str]] = []
    for line in body:
        tag, text = line[:1], line[1:]
        if tag == "\\":  # the previous line has no newline at the end of its file
            for side in last:
                side[-1] = side[-1].rstrip("\n")
            continue
        last = [old, new] if tag == " " else [old] if tag == "-" else [new]
        for side in last:
            side.append(text)
    return old, new


def _apply_hunks(lines: list[str], hunks: list[list[str]], name: str) -> list[str]:
    offset = 0
    for n, (start, *body) in enumerate(hunks, 1):
        old, new = _sides(body)
        want = max(0, int(start) - 1 + offset)
        spots = sorted(range(len(lines) - len(old) + 1), key=lambda k: abs(k - want))
        at = next((k for k in spots if lines[k : k + len(old)] == old), None)
        if at is None:
            raise ValueError(f"{name}: hunk {n} does not apply")
        lines[at : at + len(old)] = new
        offset += at - (int(start) - 1) + len(new) - len(old)
    return lines


def apply_patch(patch: str, root: str) -> list[str]:
    """Apply every file's hunks under ``root``, or none (ValueError). Returns the paths changed."""
    results: dict[str, list[str] | None] = {}
    for old, new, hunks in _sections(patch):
        name = new or old
        if name is None:
            raise ValueError("a file section names no file")
        current = results.get(old) if old in results else _text(os.path.join(root, old)) if old else []
        if old and current is None:
            raise ValueError(f"{old}: missing or not a text file")
        results[name] = _apply_hunks(list(current or []), hunks, name)
        if new is None:
            results[name] = None  # deleted
    for name, lines in results.items():
        path = os.path.join(root, name)
        if lines is None:
            os.remove(path)
            continue
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write("".join(lines))
    return sorted(results)


def unpack(files_json: str, *roots: str) -> None:
    """Write a row's ``repo_files`` ({path: text}) under each root (the repository, and its base)."""
    with open(files_json, encoding="utf-8") as f:
        files = json.load(f)
    for root in roots:
        for rel, text in files.items():
            path = os.path.normpath(os.path.join(root, rel))
            if not path.startswith(os.path.normpath(root) + os.sep):
                raise ValueError(f"{rel!r} leaves the repository")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8", newline="") as out:
                out.write(text)


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "unpack":
        try:
            unpack(*argv[1:])
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if len(argv) >= 3 and argv[0] == "diff":
        sys.stdout.write(diff_trees(argv[1], argv[2]))
        return 0
    if len(argv) in (2, 3) and argv[0] == "apply":
        with open(argv[1], encoding="utf-8") as f:
            patch = f.read()
        try:
            for name in apply_patch(patch, argv[2] if len(argv) == 3 else "."):
                print(f"patched {name}")
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    print("usage: patch_tool.py diff BASE WORK | apply PATCH [ROOT] | unpack FILES.json ROOT...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
