"""The SQL store: schema, engines, the single writer and the reads other parts need.

Imports nothing of rlproxy's except `rlproxy.errors`. Submodules: `models` (tables), `db` (engines,
migrations), `records` (what the proxy captures), `writer` (the one writer), `queries` (reads),
`errors` (RunNotFound, RewardConflict).
"""

from __future__ import annotations

from rlproxy.storage.errors import RewardConflict, RunNotFound

__all__ = ["RewardConflict", "RunNotFound"]
