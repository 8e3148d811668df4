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
    """A configured limit was hit. `flag` names the option that raises the limit.

    -> RESOURCE_EXHAUSTED for size limits, and for a full queue when `retryable` (the same request
    may succeed later). -> INVALID_ARGUMENT when `can_never_fit`: the request needs more than this
    configuration can ever give it (a frame above the step budget, more tokens than the context,
    more KV than the whole cache), so only a smaller request or a bigger server helps."""

    def __init__(self, message: str, flag: str = "", *, retryable: bool = False, can_never_fit: bool = False):
        if retryable and can_never_fit:
            raise ValueError("a limit cannot be both retryable and never fit")
        super().__init__(message + (f" (raise it with {flag})" if flag else ""))
        self.flag = flag
        self.retryable = retryable
        self.can_never_fit = can_never_fit


class EngineUnavailableError(MMServeError):
    """The engine is not ready or is draining (-> UNAVAILABLE)."""


class EngineDeadError(EngineUnavailableError):
    """The engine process died (killed, out of memory, crashed): requests in flight end with this
    (-> UNAVAILABLE: another replica can serve them) and the server exits so it gets restarted."""


class RequestAbortedError(MMServeError):
    """The request was aborted (-> CANCELLED)."""


class EngineInternalError(MMServeError):
    """A step failed; the request id is in the message for grepping logs (-> INTERNAL)."""


class NotFoundError(MMServeError):
    """Something the request names does not exist here, e.g. an expired or unknown media id
    (-> NOT_FOUND). `resource_type` and `resource_name` say what was looked for."""

    def __init__(self, message: str, *, resource_type: str, resource_name: str):
        super().__init__(message)
        self.resource_type = resource_type
        self.resource_name = resource_name
