"""What an argument a command does not take should have been: the one line ``gym-runtime`` prints instead of
argparse's "unrecognized arguments" (the nearest option's name; where the namespace or a config goes for a
command that takes it elsewhere or not at all).

Light to import (argparse and the error tree only): it runs before any command's module does its work.
"""

from __future__ import annotations

import argparse

from gym_runtime.errors import did_you_mean


def unrecognized(command: argparse.ArgumentParser, name: str, extras: list[str]) -> str:
    """The line for ``extras`` (what ``parse_known_args`` left of the command ``name``'s argv): the first
    unknown option if there is one (a value after it is its value), else the first stray word."""
    options = sorted({s for a in command._actions for s in a.option_strings if s.startswith("--")})
    takes_config = any(a.dest == "config" for a in command._actions)
    on_bus = "--namespace" in options
    flag = next((e.partition("=")[0] for e in extras if e.startswith("--")), None)
    if flag is None:
        flag = next((e for e in extras if e.startswith("-") and len(e) > 1), None)
    if flag is None:
        word = extras[0]
        if not takes_config and on_bus:
            return (
                f"{name} takes no CONFIG (got {word!r}): it reads from the bus; drop it and give --nats URL "
                "(and --namespace NAME when the config's namespace is not gym)"
            )
        return f"unrecognized argument {word!r}: {name} takes no more positional arguments"
    if flag == "--namespace" and takes_config:
        return (
            f"{name} takes its namespace from the config: set `namespace: NAME` in the YAML, "
            "or add --set namespace=NAME"
        )
    if flag == "--set" and not takes_config:
        where = " (--nats URL, and --namespace NAME for another namespace)" if on_bus else ""
        return f"--set: {name} reads no config, so it has no value to set; it takes the bus's own options{where}"
    near = did_you_mean(flag, options)
    if near:
        return f"unrecognized option {flag}{near}"
    return f"unrecognized arguments: {' '.join(extras)}"
