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

    def __init__(self, run_id: str, existing: float | None, new: float | None) -> None:
        # None: the judge's reward (asked for, or waiting for it)
        has = "is waiting for the judge's reward" if existing is None else f"already has reward {existing!r}"
        wants = "a judge request" if new is None else repr(new)
        super().__init__(f"run {run_id!r} {has}; refusing {wants}")
        self.run_id = run_id
        self.existing = existing
        self.new = new


class SplitConflict(StorageError):
    """A reward that contradicts the run's split: `"split": "train"` for a validation run, `"split":
    "val"` for a run already rewarded as a training run, or a validation run completed for the judge
    (val runs need a number: the judge scores training groups). The run stays as it was."""

    status = 409
    type = "invalid_request_error"
    code = "split_conflict"

    def __init__(self, run_id: str, message: str) -> None:
        super().__init__(f"run {run_id!r} {message}")
        self.run_id = run_id


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


class NotAStore(StorageError):
    """A database URL or path that does not hold an rlproxy store: no file there, a file that is not
    a database, an unreachable server, or a database without rlproxy's tables (raised by readers
    such as the CLI before they query; `rlproxy db upgrade` creates a store)."""

    status = 503
    code = "store_unavailable"


class RubricConflict(StorageError):
    """A judge request whose rubric differs from the one another run of its group (still waiting for
    the judge, or scored and not yet trained) asked for: a group is judged under one rubric (issue 22)."""

    status = 409
    type = "invalid_request_error"
    code = "rubric_conflict"

    def __init__(self, run_id: str, group_id: str | None) -> None:
        super().__init__(
            f"run {run_id!r}: group {group_id!r} is judged under another rubric; post the same rubric "
            "(or none, if its runs posted none), or send another X-Group-Id"
        )
        self.run_id = run_id


class RunClosed(StorageError):
    """A completion for a run that already has its reward (or asked for the judge's): a run past
    `open` takes no more turns into its reward (README: Tenancy). Start a new run id."""

    status = 409
    type = "invalid_request_error"
    code = "run_closed"

    def __init__(self, run_id: str) -> None:
        super().__init__(
            f"run {run_id!r} is closed: it already has its reward (or asked for the judge's); "
            "send this turn under a new run id"
        )
        self.run_id = run_id
