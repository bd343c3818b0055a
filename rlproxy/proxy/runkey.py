"""The run key of a request: which episode (run) and group a completion belongs to.

A run is named by the `X-Run-Id` header or by the path prefix `/runs/{run_id}/v1/...` (for apps
that can only set a base URL). `X-Group-Id` names the group explicitly; otherwise the store uses the
default group of the run's first completion: a hash of (policy, tools, messages up to and including
the first user message), so runs that start from the same task land in one group without any header.
`X-Split: val` on a run's first request makes it a validation run (served and stored, never trained).
"""

from __future__ import annotations

import re

from rlproxy.errors import APIError
from rlproxy.storage.records import default_group

__all__ = ["check_id", "check_split", "default_group"]

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def invalid_id(what: str, why: str) -> APIError:
    """The 400 for a run or group id (`what`) that does not fit, `why` saying how."""
    return APIError(400, f"invalid {what}{why}", param=what.replace(" ", "_"), code="invalid_run_id")


def check_id(value: str, what: str = "run id") -> str:
    """`value` if it is 1-128 chars of [A-Za-z0-9._:-], else a 400 APIError saying so."""
    if RUN_ID_PATTERN.fullmatch(value) is None:
        raise invalid_id(what, f" {value[:140]!r}: use 1-128 characters of A-Z a-z 0-9 . _ : -")
    return value


SPLITS = ("train", "val")  # X-Split values (runs.split; storage/validation.py)


def check_split(value: str) -> str:
    """`value` if it is an X-Split value (`train` or `val`), else a 400 APIError saying so."""
    if value not in SPLITS:
        raise APIError(
            400,
            f"invalid X-Split {value[:40]!r}: use train or val (val: a validation run, never trained)",
            param="split",
            code="invalid_split",
        )
    return value
