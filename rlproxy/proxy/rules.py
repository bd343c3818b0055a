"""The route rules, written once: who may call a path, which body limit it has, whether it counts
against the requests-in-flight cap. Read by the guard (`auth.Principals`, through `guard.Guard`),
the limits (`limits.Limits`) and the docs (`docs/security.md`'s table is `rules_markdown()`,
which tests/test_readme.py keeps equal).

A pattern is an exact path; `*` matches any characters, `/` included (`fnmatch`), so `/v1/admin/*`
is a prefix and `*/runs/*/reward` is any path with `/runs/` in it that ends in `/reward`. A path
that no rule names is an agent route with the ordinary body limit, counted in flight.

Rules do not overlap (a test checks it). Matching is compiled once into sets, prefixes and one
regular expression per property (`Rules`), as the guard and the limits run it on every request.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class Who(StrEnum):
    """Who may call a route."""

    PUBLIC = "anyone"  # no key (the page and its scripts hold no data; /healthz)
    AGENT = "agent"  # the agents' key RLPROXY_API_KEY, an app's key (`rlproxy keys`), or the admin key
    ADMIN = "operator"  # the operators' key RLPROXY_ADMIN_KEY only


class Body(StrEnum):
    """Which body limit a route has (the setting's name)."""

    ANY = "max_body_bytes"
    REWARD = "max_reward_body_bytes"  # a reward or a completion: small JSON, never 8 MB


@dataclass(frozen=True)
class Rule:
    """One row: the paths it names, who may call them, their body limit, and `capped` (False: not
    counted against `max_concurrent_requests`, so an overloaded proxy can still be watched)."""

    patterns: tuple[str, ...]
    who: Who = Who.AGENT
    body: Body = Body.ANY
    capped: bool = True
    what: str = ""


RULES: tuple[Rule, ...] = (
    Rule(("/healthz",), Who.PUBLIC, capped=False, what="health, for load balancers"),
    Rule(("/metrics",), Who.ADMIN, capped=False, what="Prometheus metrics: every client's traffic"),
    Rule(("/",), Who.PUBLIC, what="the dashboard page (it asks for the admin key)"),
    Rule(
        (
            "/dashboard/app.js",
            "/dashboard/chart.js",
            "/dashboard/dig.js",
            "/dashboard/rollouts.js",
            "/dashboard/style.css",
        ),
        Who.PUBLIC,
        what="the dashboard's scripts and style (proxy/dashboard.py ASSETS)",
    ),
    Rule(("/rollouts",), Who.PUBLIC, what="the canary panel's page"),
    Rule(("/v1/runs", "/v1/runs/stats"), Who.ADMIN, what="listing every run, run stats"),
    Rule(
        ("/v1/training*", "/v1/admin/*"),
        Who.ADMIN,
        what="training data (steps, rollouts, shadow checks); adapter control; apps' keys",
    ),
    Rule(
        # the ones ending `/runs/reward` name no route, but get the reward bound as any such path did
        (
            "*/runs/*/reward",
            "*/runs/*/complete",
            "/v1/completions/*/reward",
            "/v1/completions/*/complete",
            "*/runs/reward",
            "*/runs/complete",
            "/v1/completions/reward",
            "/v1/completions/complete",
        ),
        Who.AGENT,
        Body.REWARD,
        what="a run's reward or completion, an untagged reply's reward",
    ),
)


def _matcher(patterns: list[str]) -> Callable[[str], bool]:
    """One predicate for `patterns`: a set of exact paths, a tuple of prefixes, one regex for the rest."""
    exact = frozenset(p for p in patterns if "*" not in p)
    prefixes = tuple(p[:-1] for p in patterns if p.endswith("*") and "*" not in p[:-1])
    globs = [p for p in patterns if "*" in p[:-1]]
    # a glob's literal ending, checked before its regex (the hot path mostly misses them all)
    endings = tuple(g.rpartition("*")[2] for g in globs)
    regex = re.compile("|".join(fnmatch.translate(g) for g in globs)) if globs else None

    def match(path: str) -> bool:
        if path in exact or (prefixes and path.startswith(prefixes)):
            return True
        return regex is not None and path.endswith(endings) and regex.match(path) is not None

    return match


class Rules:
    """`RULES` compiled: `is_public(path)`, `is_admin(path)`, `is_reward_body(path)`, `is_capped(path)`."""

    def __init__(self, rules: tuple[Rule, ...] = RULES) -> None:
        self.rules = rules

        def where(keep: Callable[[Rule], bool]) -> list[str]:
            return [p for r in rules if keep(r) for p in r.patterns]

        self.public_paths = tuple(where(lambda r: r.who is Who.PUBLIC))
        assert all("*" not in p for p in self.public_paths), "public routes are exact paths"
        self.public = frozenset(self.public_paths)
        self.is_admin = _matcher(where(lambda r: r.who is Who.ADMIN))
        self.is_reward_body = _matcher(where(lambda r: r.body is Body.REWARD))
        self.uncapped = frozenset(where(lambda r: not r.capped))
        assert all("*" not in p for p in self.uncapped), "uncapped routes are exact paths"

    def is_public(self, path: str) -> bool:
        return path in self.public

    def is_capped(self, path: str) -> bool:
        return path not in self.uncapped


ROUTE_RULES = Rules()
PUBLIC_PATHS: tuple[str, ...] = ROUTE_RULES.public_paths


def rules_markdown(rules: tuple[Rule, ...] = RULES) -> str:
    """The Markdown table of `rules` (docs/security.md, between its `rules` markers)."""
    lines = [
        "| paths | who may call | body limit | in flight cap | what |",
        "|---|---|---|---|---|",
    ]
    for r in rules:
        paths = ", ".join(f"`{p}`" for p in r.patterns)
        capped = "counted" if r.capped else "exempt"
        lines.append(f"| {paths} | {r.who.value} | `{r.body.value}` | {capped} | {r.what} |")
    rest = "the OpenAI routes and the rest"
    lines.append(f"| any other path | {Who.AGENT.value} | `{Body.ANY.value}` | counted | {rest} |")
    return "\n".join(lines)
