"""Back-and-forth over issue 64's six walks: where one parameter goes, room by room.

    python tests/bench/walks.py [--tree]    # a table: walk, calls, rooms, back-and-forth (--tree: each call)

A walk starts at one function and follows one of its parameters: every call that is handed that value (as an
argument, or as the object whose method is called) is a step, and the walk goes on inside the callee with the
parameter that received it. Calls are resolved statically: a module's names, ``self``'s class and the type
annotations of parameters and attributes (a call through an untyped value, or into code outside
``gym_runtime``, ends that branch). A room is a top-level module or package of ``gym_runtime`` (``service``,
``workers``, ``agent``, ...; the plugin folders are ``agents``, ``models``, ``resources``). A call from one room
into another is a crossing; back-and-forth counts a room pair met again beyond a call and its return: each pair
of rooms crossed by n distinct calls (caller function, callee function) adds n - 1. Used for issue 64 item 7.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import inspect
import sys
import textwrap
import typing
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

WALKS = [
    ("service/runner.py:make_workers:config", "gym_runtime.service.runner", "make_workers", "config"),
    ("service/batches.py:publish_batch:bus", "gym_runtime.service.batches", "publish_batch", "bus"),
    (
        "workers/agent_worker.py:AgentWorker._run_task:task",
        "gym_runtime.workers.agent_worker",
        "AgentWorker._run_task",
        "task",
    ),
    (
        "workers/agent_worker.py:AgentWorker._store:result",
        "gym_runtime.workers.agent_worker",
        "AgentWorker._store",
        "result",
    ),
    ("data/collector.py:Collector.run:self", "gym_runtime.data.collector", "Collector.run", "self"),
    ("client/__init__.py:Client.submit:rows", "gym_runtime.client", "Client.submit", "rows"),
]


ROOM_DEPTH = [2]  # 2: rooms are gym_runtime's top-level modules and packages; 3: their modules too (--modules)


def room(fn: Any) -> str | None:
    """The top-level module or package of ``gym_runtime`` a function lives in (None: outside it)."""
    parts = (getattr(fn, "__module__", None) or "").split(".")
    return ".".join(parts[1 : ROOM_DEPTH[0]]) if len(parts) > 1 and parts[0] == "gym_runtime" else None


def unwrap(obj: Any) -> Any:
    obj = inspect.unwrap(obj) if callable(obj) else obj
    return obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj


def hints_of(obj: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj)
    except Exception:  # noqa: BLE001 - a hint that does not evaluate is a branch the walk cannot follow
        return {}


def concrete(tp: Any) -> type | None:
    """The class a hint names: ``X``, ``X | None``, ``Optional[X]`` (a union of several classes: none)."""
    if isinstance(tp, type):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1 and isinstance(args[0], type):
        return args[0]
    origin = typing.get_origin(tp)
    return origin if isinstance(origin, type) and not args else None


def attribute_type(cls: type, name: str) -> type | None:
    """The class of ``cls().name`` from the class's annotations or its ``__init__``'s parameter of that name."""
    for klass in cls.__mro__:
        hint = hints_of(klass).get(name)
        if hint is not None:
            return concrete(hint)
    init = hints_of(getattr(cls, "__init__", None))
    return concrete(init[name]) if name in init else None


@dataclass
class Step:
    caller: str
    callee: str
    param: str
    rooms: tuple[str, str]
    depth: int
    again: bool  # a call of the chain above crossed this room pair already


@dataclass
class Walk:
    name: str
    steps: list[Step] = field(default_factory=list)
    seen: set[tuple[Any, str]] = field(default_factory=set)

    def back_and_forth(self) -> int:
        """The calls that cross a room pair the chain of calls above them crossed already (A -> B -> A)."""
        return len({(s.caller, s.callee) for s in self.steps if s.again})

    def per_function(self) -> int:
        """A stricter count: each function that calls from its room into another crosses that pair once; a pair
        crossed from a second function (a sibling's call included) is met again."""
        crossings = {(s.caller, s.rooms[1]): frozenset(s.rooms) for s in self.steps if s.rooms[0] != s.rooms[1]}
        return sum(n - 1 for n in Counter(crossings.values()).values())


def ordered_calls(tree: ast.AST) -> Iterator[ast.Call]:
    """The calls of a function body in source order (nested functions and lambdas included: the value goes there)."""
    yield from sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))


class Resolver:
    def __init__(self, fn: Any, owner: type | None) -> None:
        self.fn, self.owner = fn, owner
        self.globals: dict[str, Any] = getattr(fn, "__globals__", {})
        self.hints = hints_of(fn)

    def type_of(self, node: ast.expr) -> type | None:
        if isinstance(node, ast.Name):
            if node.id == "self" and self.owner is not None:
                return self.owner
            return concrete(self.hints.get(node.id))
        if isinstance(node, ast.Attribute):
            base = self.type_of(node.value)
            return attribute_type(base, node.attr) if base is not None else None
        return None

    def callee(self, func: ast.expr) -> tuple[Any, type | None]:
        """The function a call reaches and the class it is a method of (``(None, None)``: not resolved)."""
        if isinstance(func, ast.Name):
            target = self.globals.get(func.id)
            if isinstance(target, type) and target is not functools.partial:
                return unwrap(getattr(target, "__init__", None)), target
            return unwrap(target), None
        if isinstance(func, ast.Attribute):
            if isinstance(func.value, ast.Name) and inspect.ismodule(self.globals.get(func.value.id)):
                target = getattr(self.globals[func.value.id], func.attr, None)
                if isinstance(target, type) and target is not functools.partial:
                    return unwrap(getattr(target, "__init__", None)), target
                return unwrap(target), None
            cls = self.type_of(func.value)
            if cls is not None:
                return unwrap(inspect.getattr_static(cls, func.attr, None)), cls
        return None, None


def aliases(tree: ast.AST, param: str) -> set[str]:
    """The walked value's names in a function: itself, and what a loop or comprehension over it binds
    (``for i, row in enumerate(rows)``: ``row`` is one of the rows)."""
    names = {param}
    for node in ast.walk(tree):
        loops = [(node.target, node.iter)] if isinstance(node, (ast.For, ast.AsyncFor)) else []
        loops += [(g.target, g.iter) for g in getattr(node, "generators", [])]
        for target, over in loops:
            if carries(over, param):
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def carries(arg: ast.expr, param: str | set[str]) -> bool:
    """``arg`` is the walked value, or a comprehension or call over it (``((i, r) for i, r in enumerate(rows))``);
    an attribute of it (``task.row``) is another value."""
    names = {param} if isinstance(param, str) else param
    if isinstance(arg, ast.Name):
        return arg.id in names
    if not isinstance(arg, (ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp, ast.Call)):
        return False
    under_attribute = {id(n.value) for n in ast.walk(arg) if isinstance(n, ast.Attribute)}
    return any(isinstance(n, ast.Name) and n.id in names and id(n) not in under_attribute for n in ast.walk(arg))


def parameter_for(fn: Any, call: ast.Call, param: str, method: bool, walked: set[str]) -> str | None:
    """The callee's parameter that receives the walked value (``walked``: its names here) in ``call``."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    if method and isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name):
        if call.func.value.id == param and names:
            return names[0]  # the value is the object whose method is called: the callee's ``self``
    positional = names[1:] if method else names
    for i, arg in enumerate(call.args):
        if carries(arg, walked) and i < len(positional):
            return positional[i]
    for kw in call.keywords:
        if kw.arg and carries(kw.value, walked):
            return kw.arg if kw.arg in names else None
    return None


def source_tree(fn: Any) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None


def walk(
    w: Walk, fn: Any, owner: type | None, param: str, depth: int, limit: int, chain: frozenset[frozenset[str]]
) -> None:
    """Follow ``param`` through ``fn``'s calls; ``chain``: the room pairs the calls above crossed."""
    if (fn, param) in w.seen or depth > limit:
        return
    w.seen.add((fn, param))
    tree = source_tree(fn)
    if tree is None:
        return
    here = room(fn)
    resolver = Resolver(fn, owner)
    names = aliases(tree, param)
    for call in ordered_calls(tree):
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            # a bound method of the value handed on (a callback, a task): the walk goes on where it runs
            if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == param:
                target, cls = resolver.callee(arg)
                if target is not None and cls is not None and room(target) is not None and here is not None:
                    step(w, fn, target, cls, "self", (here, str(room(target))), depth, limit, chain)
        passes = any(carries(a, names) for a in call.args) or any(carries(k.value, names) for k in call.keywords)
        on_it = isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
        on_it = on_it and call.func.value.id == param  # type: ignore[union-attr]
        if not (passes or on_it):
            continue
        target, cls = resolver.callee(call.func)
        if target is functools.partial and call.args:  # partial(fn, value, ...): the walk goes on in fn
            call = ast.Call(func=call.args[0], args=call.args[1:], keywords=call.keywords)
            target, cls = resolver.callee(call.func)
        there = room(target)
        if target is None or there is None or here is None:
            continue
        received = parameter_for(target, call, param, cls is not None, names)
        if received is None:
            continue
        step(w, fn, target, cls, received, (here, there), depth, limit, chain)


def step(
    w: Walk,
    fn: Any,
    target: Any,
    cls: type | None,
    received: str,
    rooms: tuple[str, str],
    depth: int,
    limit: int,
    chain: frozenset[frozenset[str]],
) -> None:
    pair = frozenset(rooms)
    crossing = rooms[0] != rooms[1]
    w.steps.append(Step(fn.__qualname__, target.__qualname__, received, rooms, depth, crossing and pair in chain))
    walk(w, target, cls, received, depth + 1, limit, chain | {pair} if crossing else chain)


def start(module: str, qualname: str) -> tuple[Callable[..., Any], type | None]:
    obj: Any = importlib.import_module(module)
    owner = None
    for part in qualname.split("."):
        owner = obj if isinstance(obj, type) else owner
        obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
    return unwrap(obj), owner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="store_true", help="print each walk's calls")
    parser.add_argument("--depth", type=int, default=12, help="how deep a walk goes (default 12)")
    parser.add_argument("--modules", action="store_true", help="rooms are modules (service.batches), not packages")
    args = parser.parse_args(argv)
    ROOM_DEPTH[0] = 3 if args.modules else 2
    total = strict = 0
    rows = []
    for name, module, qualname, param in WALKS:
        fn, owner = start(module, qualname)
        w = Walk(name)
        walk(w, fn, owner, param, 0, args.depth, frozenset())
        rooms = sorted({r for s in w.steps for r in s.rooms})
        rows.append((name, len(w.steps), ", ".join(rooms), w.back_and_forth(), w.per_function()))
        total += w.back_and_forth()
        strict += w.per_function()
        if args.tree:
            print(name)
            for s in w.steps:
                mark = "  BACK-AND-FORTH" if s.again else ""
                print(f"  {'  ' * s.depth}{s.caller} -> {s.callee}({s.param})  [{s.rooms[0]} -> {s.rooms[1]}]{mark}")
    print("| walk | calls | rooms | back-and-forth | per function |")
    print("| --- | --- | --- | --- | --- |")
    for name, calls, rooms, bf, pf in rows:
        print(f"| `{name}` | {calls} | {rooms} | {bf} | {pf} |")
    print(f"| total | | | {total} | {strict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
