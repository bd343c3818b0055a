"""Storage outcomes a caller must handle; each carries its HTTP status and OpenAI error code."""

from __future__ import annotations

from rlproxy.errors import StorageError


class RunNotFound(StorageError):
    """A reward (or lookup) named a run that has no completion stored."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id!r} not found")
        self.run_id = run_id


class RewardConflict(StorageError):
    """A second, different reward for a run that already has one; the first one stays."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"

    def __init__(self, run_id: str, existing: float | None, new: float) -> None:
        super().__init__(f"run {run_id!r} already has reward {existing!r}; refusing {new!r}")
        self.run_id = run_id
        self.existing = existing
        self.new = new


class StoreUnavailable(StorageError):
    """The store cannot take more right now (its queue is full, a commit or a run's stream is
    still pending past the wait bound): retryable, the HTTP layer answers 503 with Retry-After."""

    status = 503
    code = "store_unavailable"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StepConflict(StorageError):
    """A step could not be committed: one of its runs is no longer `completed`, or the step exists.

    The trainer's own outcome (never an HTTP answer): it discards the step's weights.
    """
