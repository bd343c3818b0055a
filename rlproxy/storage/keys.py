"""The `keys` table: an app's key, stored hashed; created, listed and revoked by the operator.

A key's secret (`rk-` + 43 characters of 256 random bits) is shown once, by `create`, and never
stored: the table keeps its sha256 (a fast hash is enough for a random secret of that size; there
is nothing to guess a password from). The proxy reads the valid keys (`active`) into memory and
matches a request's bearer against them (proxy/keys.py); `touch` records when each was last used.
Every replica reads the same table, so a revoke reaches all of them at their next read.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.db import write_transaction
from rlproxy.storage.models import Key

KEYS = Key.__table__
SECRET_PREFIX = "rk-"
SHOWN = ("id", "name", "policies", "rpm", "tpm", "max_streams", "scorer_url", "created_at", "revoked_at")


class KeyNameTaken(ValueError):
    """`create` with the name of an existing key (revoked ones included: names are never reused)."""


def hash_secret(secret: str | bytes) -> str:
    """The stored form of a secret: its sha256, hex."""
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).hexdigest()


async def create(
    engine: AsyncEngine,
    name: str,
    *,
    policies: list[str] | None = None,
    rpm: int | None = None,
    tpm: int | None = None,
    max_streams: int | None = None,
    scorer_url: str | None = None,
) -> tuple[dict[str, Any], str]:
    """A new key named `name`: (its row as `list_keys` shows it, its secret). KeyNameTaken if taken."""
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    row = {
        "id": f"key_{secrets.token_hex(6)}",
        "name": name,
        "secret_hash": hash_secret(secret),
        "policies": list(policies) if policies is not None else None,
        "rpm": rpm,
        "tpm": tpm,
        "max_streams": max_streams,
        "scorer_url": scorer_url,
        "created_at": datetime.now(UTC),
        "revoked_at": None,
    }
    try:
        async with write_transaction(engine) as conn:
            await conn.execute(KEYS.insert().values(**row))
    except IntegrityError:
        raise KeyNameTaken(f"a key named {name!r} exists already (names are never reused)") from None
    return {k: row[k] for k in SHOWN}, secret


async def list_keys(engine: AsyncEngine) -> list[dict[str, Any]]:
    """Every key, valid and revoked, oldest first, with `last_used_at` (never the hash)."""
    cols = [KEYS.c[c] for c in (*SHOWN, "last_used_at")]
    async with engine.connect() as conn:
        rows = (await conn.execute(select(*cols).order_by(KEYS.c.created_at, KEYS.c.id))).mappings().all()
    return [dict(r) for r in rows]


async def revoke(engine: AsyncEngine, name: str) -> bool:
    """Revoke the key named `name`; False when there is no valid key of that name."""
    async with write_transaction(engine) as conn:
        res = await conn.execute(
            update(KEYS)
            .where(KEYS.c.name == name, KEYS.c.revoked_at.is_(None))
            .values(revoked_at=datetime.now(UTC))
        )
    return res.rowcount == 1


async def active(engine: AsyncEngine) -> list[dict[str, Any]]:
    """The valid keys with their `secret_hash`: what the proxy matches bearers against."""
    cols = [
        KEYS.c[c]
        for c in ("id", "name", "secret_hash", "policies", "rpm", "tpm", "max_streams", "scorer_url")
    ]
    async with engine.connect() as conn:
        rows = (await conn.execute(select(*cols).where(KEYS.c.revoked_at.is_(None)))).mappings().all()
    return [dict(r) for r in rows]


async def touch(engine: AsyncEngine, key_ids: Iterable[str], at: datetime) -> None:
    """Set `last_used_at` of `key_ids` to `at` (one statement; called at most once a minute)."""
    ids = sorted(set(key_ids))
    if not ids:
        return
    async with write_transaction(engine) as conn:
        await conn.execute(update(KEYS).where(KEYS.c.id.in_(ids)).values(last_used_at=at))
