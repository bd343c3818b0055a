"""The rlproxy error tree. A leaf module: every layer may import it, it imports nothing of ours.

    RLProxyError                      base of everything rlproxy raises on purpose
    ├── ConfigError                   settings or command-line values that cannot work together
    ├── ModelError                    a model name/folder cannot be resolved, prepared or loaded
    ├── BackendError                  the inference backend misbehaved
    │   ├── BackendUnavailable        it cannot be reached or did not become healthy (HTTP 502)
    │   │   └── BackendUnreachable    no connection opened: the request was never sent
    │   ├── BackendTimeout            it did not answer in time (HTTP 504)
    │   ├── BackendRedirect           it answered a pass-through path with a redirect (HTTP 502)
    │   └── AdapterError              loading/unloading a LoRA adapter failed (the backend's status)
    ├── StorageError                  the SQL store failed (storage/errors.py: 404, 409, 503)
    └── TrainerError                  a training step or checkpoint could not be completed

Each class says how the HTTP API answers it: `status`, and OpenAI's error `type` and `code`
(class attributes; a subclass overrides what differs). The one handler (`proxy/errors.py`) reads
them; a 500 tells the client only an error id. Storage's own outcomes (unknown run 404, conflicting
reward 409, store busy 503) are subclasses of `StorageError` in `storage/errors.py`.

Caller mistakes on the HTTP API are not part of this tree: they are `APIError`s, rendered in
OpenAI's error shape `{"error": {"message", "type", "param", "code"}}` by the same handler.
"""

from __future__ import annotations


class RLProxyError(Exception):
    """Base class of every error rlproxy raises on purpose."""

    status: int = 500  # the HTTP status the API answers with
    type: str = "server_error"  # OpenAI's error type
    code: str = "internal_error"  # OpenAI's error code


class ConfigError(RLProxyError):
    """Settings or options that cannot work together; the message says which and what to do."""


class ModelError(RLProxyError):
    """A model name or folder cannot be resolved, prepared or loaded."""


class BackendError(RLProxyError):
    """The inference backend misbehaved."""


class BackendUnavailable(BackendError):
    """The backend cannot be reached, or did not become healthy in time."""

    status = 502
    code = "upstream_unavailable"


class BackendUnreachable(BackendUnavailable):
    """No connection to the backend could be opened: nothing was sent (another replica may take it)."""


class BackendTimeout(BackendError):
    """The backend did not answer within the configured timeout."""

    status = 504
    code = "upstream_timeout"


class BackendRedirect(BackendError):
    """The backend answered with a redirect: never relayed nor followed (it names the engine's address)."""

    status = 502
    code = "upstream_redirect"


class AdapterError(BackendError):
    """Loading or unloading a LoRA adapter failed; `status` is the backend's HTTP status."""

    code = "adapter_error"

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class StorageError(RLProxyError):
    """The SQL store failed."""


class TrainerError(RLProxyError):
    """A training step or checkpoint could not be completed."""


class APIError(Exception):
    """A caller mistake on the HTTP API, rendered in OpenAI's error shape with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        """The JSON body OpenAI's API would send for this error."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
