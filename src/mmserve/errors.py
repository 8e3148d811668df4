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

    -> RESOURCE_EXHAUSTED only when `retryable`: the same request may pass later (a full queue, a
    busy worker, a full spool). Otherwise -> INVALID_ARGUMENT: the request is over a limit of this
    configuration (media bytes, duration, pixels, frames, the context, one step's budget, the whole
    KV cache), so resending it can never succeed; only a smaller request or a server started with
    the flag raised helps. Gateways retry RESOURCE_EXHAUSTED (SMG: HTTP 429, 5 attempts), so a
    permanent refusal under that code would be redone each time."""

    def __init__(self, message: str, flag: str = "", *, retryable: bool = False):
        super().__init__(message + (f" (raise it with {flag})" if flag else ""))
        self.flag = flag
        self.retryable = retryable


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
