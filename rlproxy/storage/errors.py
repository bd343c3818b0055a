"""Storage outcomes a caller must handle (the HTTP layer maps them to 404 and 409)."""

from __future__ import annotations

from rlproxy.errors import StorageError


class RunNotFound(StorageError):
    """A reward (or lookup) named a run that has no completion stored."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id!r} not found")
        self.run_id = run_id


class RewardConflict(StorageError):
    """A second, different reward for a run that already has one; the first one stays."""

    def __init__(self, run_id: str, existing: float | None, new: float) -> None:
        super().__init__(f"run {run_id!r} already has reward {existing!r}; refusing {new!r}")
        self.run_id = run_id
        self.existing = existing
        self.new = new
