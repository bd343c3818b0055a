"""Who may call which route: two principals, two keys (see the README's "Security" section).

    agent     `RLPROXY_API_KEY`    the OpenAI routes (captured or passed through), rewards,
              or an app's key      reading one run by its id (`GET /v1/runs/{id}`); an app's key
              (`rlproxy keys`)     (proxy/keys.py) only its policies, runs and replies
    operator  `RLPROXY_ADMIN_KEY`  everything an agent may do, plus listing all runs, run stats,
                                   training steps, `/metrics` and the dashboard's data

A route is public (`/healthz`, the dashboard's static page), an operator route or an agent route
(everything else), as the one table of route rules says (`proxy/rules.py`). Each key guards its own
routes: with no key set everything is open (local development on loopback, which `guard.Guard`'s
Host and Origin checks protect); with only the agents' key set the operator routes are closed (403
that says to set `RLPROXY_ADMIN_KEY`), so an agent key can never read other agents' runs; with only
the admin key set the agent routes stay open. A missing or wrong key is 401, a valid key on a route
its principal may not use is 403, both in OpenAI's error shape.

`/metrics` is an operator route: it shows traffic, latencies and policy steps of every client, which
is operator knowledge; Prometheus sends the admin key with `authorization: {credentials: ...}`.
"""

from __future__ import annotations

import hmac
from enum import IntEnum

from rlproxy.errors import ConfigError
from rlproxy.proxy.keys import AppKey, KeyRing
from rlproxy.proxy.rules import ROUTE_RULES, Rules


class Role(IntEnum):
    """What a request's credentials make it (ordered: each role may do what the ones below may)."""

    ANONYMOUS = 0  # no key, or a wrong one
    AGENT = 1  # the agents' key (RLPROXY_API_KEY)
    ADMIN = 2  # the operators' key (RLPROXY_ADMIN_KEY)


class Refusal(Exception):
    """Why a request may not pass: `status` (401 or 403), `message`, OpenAI error `code`."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def is_admin_path(path: str) -> bool:
    """True for the operator routes (see the module doc)."""
    return ROUTE_RULES.is_admin(path)


class Principals:
    """The two keys and the rule of the module doc; `check(path, authorization)` raises `Refusal`."""

    def __init__(
        self,
        api_key: str | None,
        admin_key: str | None,
        rules: Rules = ROUTE_RULES,
        keys: KeyRing | None = None,
    ) -> None:
        if api_key and admin_key and hmac.compare_digest(api_key.encode(), admin_key.encode()):
            raise ConfigError(
                "RLPROXY_ADMIN_KEY must differ from RLPROXY_API_KEY (else every agent is an operator)"
            )
        self.agent = b"Bearer " + api_key.encode() if api_key else None
        self.admin = b"Bearer " + admin_key.encode() if admin_key else None
        self.public = rules.public
        self.is_admin = rules.is_admin
        self.keys = keys  # the apps' keys (the `keys` table); a valid one closes the agent routes too

    @property
    def open(self) -> bool:
        """No key at all: every route is open (Host and Origin checks still apply)."""
        return self.agent is None and self.admin is None and not self._app_keys

    @property
    def _app_keys(self) -> bool:
        return self.keys is not None and self.keys.any

    def role(self, authorization: bytes | None) -> Role:
        """The role the `Authorization` header value gives (compared in constant time)."""
        if not authorization:
            return Role.ANONYMOUS
        if self.admin is not None and hmac.compare_digest(authorization, self.admin):
            return Role.ADMIN
        if self.agent is not None and hmac.compare_digest(authorization, self.agent):
            return Role.AGENT
        return Role.ANONYMOUS

    def check(self, path: str, authorization: bytes | None) -> AppKey | None:
        """The app's key when the request may go on with one (None: it goes on without); raise
        `Refusal` (401 or 403) if it may not go on."""
        if self.open or path in self.public:
            return None
        admin_route = self.is_admin(path)
        if not admin_route and self.agent is None and not self._app_keys:
            return None  # only the admin key is set: agent routes stay open
        role = self.role(authorization)
        if role is Role.ANONYMOUS and authorization and self.keys is not None:
            key = self.keys.find(authorization)
            if key is not None:
                if admin_route:
                    raise Refusal(
                        403,
                        f"{path} is an operator route: send the admin key, not an app's key.",
                        "admin_key_required",
                    )
                return key
        if role is Role.ANONYMOUS:
            if authorization:
                raise Refusal(401, "Incorrect API key provided.", "invalid_api_key")
            raise Refusal(401, "Missing API key: send `Authorization: Bearer <key>`.", "invalid_api_key")
        if admin_route and role is not Role.ADMIN:
            if self.admin is None:
                message = (
                    f"{path} is an operator route and this proxy has no operator key: set "
                    "RLPROXY_ADMIN_KEY on the proxy and send it as `Authorization: Bearer <admin key>`."
                )
            else:
                message = f"{path} is an operator route: send the admin key, not the agents' key."
            raise Refusal(403, message, "admin_key_required")
        return None
