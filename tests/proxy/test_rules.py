"""The route rules table (`proxy/rules.py`): the guard's and the limits' answers derive from it, and
they are the answers the hand-kept lists gave before it (the old predicates are kept here as the
oracle)."""

from __future__ import annotations

import itertools

import pytest

from rlproxy.proxy import dashboard
from rlproxy.proxy.auth import Principals, Refusal, is_admin_path
from rlproxy.proxy.limits import Limits
from rlproxy.proxy.rules import ROUTE_RULES, RULES, Body, Rule, Rules, Who, rules_markdown
from rlproxy.settings import LimitsSettings

SMALL = LimitsSettings(max_body_bytes=2048, max_reward_body_bytes=1024)

# The lists the rules replaced (auth.py, limits.py, dashboard.py, routes_rollouts.py, compose.py).
OLD_ADMIN_PATHS = frozenset({"/v1/runs", "/v1/runs/stats", "/metrics"})
OLD_ADMIN_PREFIXES = ("/v1/training", "/v1/admin/")
OLD_PUBLIC = {
    "/healthz",
    "/rollouts",
    "/",
    "/dashboard/app.js",
    "/dashboard/chart.js",
    "/dashboard/dig.js",
    "/dashboard/rollouts.js",
    "/dashboard/style.css",
}
OLD_EXEMPT = {"/healthz", "/metrics"}


def old_reward_body(path: str) -> bool:
    ends = path.endswith(("/reward", "/complete"))
    return ends and ("/runs/" in path or path.startswith("/v1/completions/"))


PATHS = [
    "/",
    "/healthz",
    "/healthz/",
    "/metrics",
    "/metrics/x",
    "/rollouts",
    "/dashboard/app.js",
    "/dashboard/nope.js",
    "/v1/runs",
    "/v1/runs/",
    "/v1/runs/stats",
    "/v1/runs/r1",
    "/v1/runs/r1/reward",
    "/v1/runs/r1/complete",
    "/runs/r1/v1/reward",
    "/runs/r1/v1/complete",
    "/runs/r1/v1/runs/r2/reward",
    "/runs/r1/v1/runs/r2/complete",
    "/runs/r1/v1/chat/completions",
    "/runs/r1/v1/models",
    "/v1/completions/abc/reward",
    "/v1/completions/abc/complete",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/chat/completions/",
    "/v1/responses",
    "/v1/messages",
    "/v1/training",
    "/v1/trainingx",
    "/v1/training/steps",
    "/v1/training/rollouts",
    "/v1/admin/",
    "/v1/admin/untagged",
    "/v1/admin",
    "/v1/models",
    "/v1/foo/runs/x/reward",  # relayed upstream: still the reward bound, as before
    "/v1/runs/reward",  # no route: the reward bound, as before
    "/runs/complete",
    "/v1/completions/reward",
    "/v1/completions/complete",
    "/v1/rewardx",
    "/x/reward",
]


@pytest.mark.parametrize("path", PATHS)
def test_rules_give_the_old_answers(path: str) -> None:
    assert is_admin_path(path) == (path in OLD_ADMIN_PATHS or path.startswith(OLD_ADMIN_PREFIXES))
    assert ROUTE_RULES.is_public(path) == (path in OLD_PUBLIC)
    assert ROUTE_RULES.is_reward_body(path) == old_reward_body(path)
    assert ROUTE_RULES.is_capped(path) == (path not in OLD_EXEMPT)
    assert Limits(None, SMALL).limit(path) == (1024 if old_reward_body(path) else 2048)


def test_rules_give_the_old_answers_on_every_short_path() -> None:
    """Every path of up to four segments from the routes' words: the same answers as the old lists."""
    words = ["", "v1", "runs", "x", "reward", "complete", "completions", "training", "admin", "stats"]
    words += ["metrics", "healthz", "dashboard", "app.js", "rollouts"]
    wrong = []
    for n in range(1, 5):
        for segments in itertools.product(words, repeat=n):
            path = "/" + "/".join(segments)
            old = (
                path in OLD_ADMIN_PATHS or path.startswith(OLD_ADMIN_PREFIXES),
                path in OLD_PUBLIC,
                old_reward_body(path),
                path not in OLD_EXEMPT,
            )
            new = (
                ROUTE_RULES.is_admin(path),
                ROUTE_RULES.is_public(path),
                ROUTE_RULES.is_reward_body(path),
                ROUTE_RULES.is_capped(path),
            )
            if old != new:
                wrong.append(path)
    assert not wrong, wrong[:10]


def test_no_path_is_named_by_two_rules() -> None:
    for path in PATHS:
        naming = [r for r in RULES if _names(r, path)]
        assert len(naming) <= 1, (path, naming)


def _names(rule: Rule, path: str) -> bool:
    one = Rules((rule,))
    return one.is_public(path) or one.is_admin(path) or one.is_reward_body(path) or not one.is_capped(path)


def test_dashboard_public_paths_are_its_assets() -> None:
    assert set(dashboard.PUBLIC_PATHS) == {"/", *(f"/dashboard/{n}" for n in dashboard.ASSETS)}


def test_principals_read_the_rules_they_are_given() -> None:
    """A different table changes what the key check answers: nothing else decides it."""
    table = (Rule(("/open",), Who.PUBLIC), Rule(("/ops*",), Who.ADMIN))
    principals = Principals("agent", "admin", rules=Rules(table))
    principals.check("/open", None)
    principals.check("/healthz", b"Bearer agent")  # an agent route in this table
    with pytest.raises(Refusal) as refused:
        principals.check("/healthz", None)
    assert refused.value.status == 401
    with pytest.raises(Refusal) as refused:
        principals.check("/ops/x", b"Bearer agent")
    assert refused.value.status == 403
    limits = Limits(None, SMALL, rules=Rules((Rule(("/small",), body=Body.REWARD),)))
    assert limits.limit("/small") == 1024 and limits.limit("/v1/runs/r/reward") == 2048


def test_markdown_has_a_row_per_rule() -> None:
    rows = rules_markdown().splitlines()[2:]
    assert len(rows) == len(RULES) + 1 and all(rows[i].startswith("| `") for i in range(len(RULES)))
