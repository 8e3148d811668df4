"""The engine's exception hierarchy. Only the server edge maps these to gRPC status codes."""

from __future__ import annotations


class MMServeError(Exception):
    """Base class: a failure with a message a person can act on."""


class InvalidInputError(MMServeError):
    """The request itself is wrong (-> INVALID_ARGUMENT). `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class LimitExceededError(MMServeError):
    """A configured limit was hit (-> RESOURCE_EXHAUSTED for size/queue limits, INVALID_ARGUMENT
    when the request can never fit). `flag` names the option that raises the limit."""

    def __init__(self, message: str, flag: str = "", *, retryable: bool = False):
        super().__init__(message + (f" (raise it with {flag})" if flag else ""))
        self.flag = flag
        self.retryable = retryable


class EngineUnavailableError(MMServeError):
    """The engine is not ready or is draining (-> UNAVAILABLE)."""


class RequestAbortedError(MMServeError):
    """The request was aborted (-> CANCELLED)."""


class EngineInternalError(MMServeError):
    """A step failed; the request id is in the message for grepping logs (-> INTERNAL)."""
