"""One JSON value read from a file's bytes as a user's file is read: what cannot be read (not UTF-8, not JSON,
nested deeper than the parser goes) is the user's mistake, one line naming ``where`` (``file:line``) and what
the file should hold. ``view``'s index, the ATIF reader and ``export`` read with it."""

from __future__ import annotations

import json
from typing import Any

from gym_runtime.errors import UserError

TOO_DEEP = "nested deeper than the reader's limit (about 1,000 levels)"


def json_value(raw: bytes, where: str, should: str) -> Any:
    """``raw`` parsed (the stdlib's parser: it keeps a lone surrogate escape); ``should``: what the file holds,
    said after the problem (``a rollouts file has one JSON object a line``)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise UserError(f"{where}: {TOO_DEEP}; {should}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not UTF-8 ({e.reason} at byte {e.start}); {should}") from None
    except ValueError as e:
        raise UserError(f"{where}: not JSON ({e}); {should}") from None
