"""One error type for typed failures, raised and received alike."""

from __future__ import annotations

from gym_runtime.messages import ErrorClass, ErrorInfo

__all__ = ["GymError"]


class GymError(Exception):
    """A failure with an ``ErrorInfo``: error class, message, whether a retry may help.

    Raised by a handler or an agent to answer or fail with that error class
    (``GymError("tool_error", "...", retryable=False)``), and raised by the bus when
    the other side answered with one or was lost (``GymError(info)``), so one
    exception crosses any number of hops unchanged.
    """

    def __init__(self, error: ErrorClass | ErrorInfo, message: str = "", *, retryable: bool = False) -> None:
        info = (
            error
            if isinstance(error, ErrorInfo)
            else ErrorInfo(error_class=error, message=message, retryable=retryable)
        )
        super().__init__(f"{info.error_class}: {info.message}")
        self.info = info
