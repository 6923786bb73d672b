"""Secrets never in argv: a command-line value that looks like a secret is refused with a way to pass it."""

from __future__ import annotations

from gym_runtime.errors import AuthError
from gym_runtime.ops.security import AUTH_DIR_ENV

SECRET_NAMES = frozenset(
    {
        "api_key",
        "apikey",
        "password",
        "passwd",
        "secret",
        "client_secret",
        "token",
        "access_token",
        "auth_token",
        "bearer_token",
        "authorization",
        "credential",
        "credentials",
    }
)

SECRET_SUFFIXES = ("_api_key", "_apikey", "_password", "_secret", "_access_token", "_auth_token")


def _secret_key(key: str) -> bool:
    """A config path that holds a secret: ``*.api_key``, ``*.password``, any HTTP header value, ...

    (Not ``max_tokens`` or ``stop_token``: those are ordinary options.)
    """
    parts = key.strip().lower().replace("-", "_").split(".")
    return "headers" in parts[:-1] or parts[-1] in SECRET_NAMES or parts[-1].endswith(SECRET_SUFFIXES)


def check_argv_secret(option: str, value: str) -> None:
    """Refuse a literal secret given on the command line (every local user sees argv in ``ps``).

    ``--set KEY=VALUE``: a secret-named key with a literal value (``${VAR}`` references
    are fine), a ``sk-``/``Bearer`` value, or a URL with a password; any other option: a
    URL with credentials.
    """
    from urllib.parse import urlparse

    key, sep, val = value.partition("=") if option == "--set" else ("", "", value)
    val = val.strip()
    if "://" in val:
        for part in val.split(","):
            u = urlparse(part.strip())
            if u.username or u.password:
                raise AuthError(
                    f"{option}: credentials in a URL on the command line are visible to every local "
                    f"user; use --auth-dir DIR (or ${AUTH_DIR_ENV}) for NATS, or put the URL in the "
                    f"config / env.yaml"
                )
    if not sep:
        return
    literal = bool(val) and "${" not in val  # a ${VAR} reference is resolved from the environment
    if literal and (_secret_key(key) or val.startswith(("sk-", "Bearer "))):
        raise AuthError(
            f"{option} {key.strip()}=...: a literal secret on the command line is visible to every local "
            f"user; put it in the environment and pass --set '{key.strip()}=${{MY_VAR}}' (or write it in "
            f"env.yaml beside the config)"
        )
