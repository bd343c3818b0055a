"""Rewards and the read side: runs, training steps, health and metrics.

`POST /v1/runs/{run_id}/reward` first waits (up to `store_wait_timeout`) until no request of that
run is still on its way to the writer (a stream still running), then lets the writer store it: the
writer commits the run's completions before the reward. Outcomes: stored 200, the same reward again
200 (`"stored": false`), unknown run 404, a different reward 409, a missing or non-finite reward
422, a stream of the run still running or a store that cannot commit in time 503 + Retry-After
(retryable: the reward was not stored, or a retry finds the same one).

Apps whose base URL carries the run (`OPENAI_BASE_URL=http://host/runs/{run_id}/v1`) post the same
reward at `$OPENAI_BASE_URL/reward` ("this run": `POST /runs/{run_id}/v1/reward`) or at
`$OPENAI_BASE_URL/runs/{run_id}/reward` (`POST /runs/{run_id}/v1/runs/{run_id}/reward`; two
different ids are a 400 `run_id_mismatch`). Neither is ever relayed to the upstream.

Validation runs (README: Validation runs): `"split": "val"` in a reward body (or `X-Split: val` on the
run's first request) makes the run `validated` instead of `completed`: stored, measured per adapter
step, never trained. A body contradicting the run's split is a 409 `split_conflict`.

Judge rewards (README: Judge rewards): `POST /v1/runs/{run_id}/complete` with an optional body
`{"rubric": str?, "metadata": {...}?}` (or a reward body `{"judge": true, "rubric"?: ...}`) ends a run
without a number; the judge (trainer/judge.py) scores its group when it is ready. The same outcomes
as a reward, and: completing again 200 (`"stored": false`), a run with an app reward 409, a reward
for a run waiting for the judge 409, the judge off (`RLPROXY_JUDGE=off`, no policy set) 409
`judge_off`. Path forms: `/runs/{run_id}/v1/complete`, `/runs/{run_id}/v1/runs/{run_id}/complete`.
"""

from __future__ import annotations

import hmac
import logging
import math
import time

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from rlproxy.errors import APIError, StorageError
from rlproxy.proxy import keys, runkey, validate
from rlproxy.proxy.validate import Int64
from rlproxy.storage import queries
from rlproxy.storage.errors import StoreUnavailable
from rlproxy.storage.training import singleton_notice

logger = logging.getLogger(__name__)
router = APIRouter()

_JSON = "application/json"


def _json(obj, status: int = 200) -> Response:
    return Response(orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS), status_code=status, media_type=_JSON)


def _number(value, field: str, bound: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise APIError(422, f"{field}: must be a number", param=field, code="invalid_type")
    try:
        value = float(value)
    except OverflowError:  # an integer beyond any float (a 401-digit one): out of range, not a 500
        value = math.inf
    if not math.isfinite(value):
        raise APIError(422, f"{field}: must be a finite number", param=field, code="invalid_value")
    if bound is not None and abs(value) > bound:
        msg = f"{field}: must be between -{bound:g} and {bound:g} (the reward_bound setting)"
        raise APIError(422, msg, param=field, code="invalid_value")
    return value


def parse_reward(body: dict, bound: float | None = None) -> tuple[float, dict | None, dict | None]:
    """(reward, metrics, metadata) of a reward body; 422 for a missing or non-finite reward, one outside
    [-bound, bound] (`reward_bound`, issue 22), or bad types."""
    if "reward" not in body or body["reward"] is None:
        raise APIError(422, "reward: required (a finite number)", param="reward", code="missing")
    reward = _number(body["reward"], "reward", bound)
    metrics = body.get("metrics")
    if metrics is not None:
        if not isinstance(metrics, dict):
            raise APIError(422, "metrics: must be an object of numbers", param="metrics", code="invalid_type")
        metrics = {str(k): _number(v, f"metrics.{k}") for k, v in metrics.items()}
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise APIError(422, "metadata: must be an object", param="metadata", code="invalid_type")
    return reward, metrics, metadata


def parse_split(body: dict) -> str | None:
    """The body's `"split"`: "val" makes the run a validation run (never trained), "train" asserts it is
    not one (409 split_conflict if it is), absent keeps what its first request's X-Split said; 422 else."""
    split = body.get("split")
    if split is not None and split not in runkey.SPLITS:
        raise APIError(422, 'split: must be "train" or "val"', param="split", code="invalid_value")
    return split


MAX_RUBRIC_CHARS = 8000  # a rubric longer than this is a 422


def parse_complete(body: dict) -> tuple[str | None, dict | None]:
    """(rubric, metadata) of a complete body (or a reward body with `"judge": true`); 422 on bad types."""
    rubric = body.get("rubric")
    if rubric is not None and (not isinstance(rubric, str) or not rubric.strip()):
        raise APIError(422, "rubric: must be a non-empty string", param="rubric", code="invalid_type")
    if rubric is not None and len(rubric) > MAX_RUBRIC_CHARS:
        raise APIError(
            422, f"rubric: at most {MAX_RUBRIC_CHARS} characters", param="rubric", code="invalid_value"
        )
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise APIError(422, "metadata: must be an object", param="metadata", code="invalid_type")
    return rubric, metadata


# The reward routes are served by `routes_openai.HotPath` before FastAPI sees the request (a
# reward per run is on the hot path's scale: FastAPI's routing and middleware were ~4/5 of its CPU):
#   POST /v1/runs/{run_id}/reward            POST /v1/runs/{run_id}/complete
#   POST /runs/{run_id}/v1/reward            POST /runs/{run_id}/v1/complete
#   POST /runs/{run_id}/v1/runs/{named}/reward and .../complete (the ids must agree, else 400)
_ACTIONS = {"reward": False, "complete": True}  # the path's last segment -> a judge request?


def reward_route(path: str) -> tuple[str, str | None, str] | None:
    """(run_id, named or None, action) when `path` is a reward or complete route, else None.

    Matches what FastAPI's `{run_id}` did: one non-empty segment each, no trailing slash (any other
    path under /v1 is the pass-through's)."""
    parts = path.split("/")
    n = len(parts)
    if n == 5 and parts[1] == "v1" and parts[2] == "runs":
        run_id, named, action = parts[3], None, parts[4]
    elif n == 5 and parts[1] == "runs" and parts[3] == "v1":
        run_id, named, action = parts[2], None, parts[4]
    elif n == 7 and parts[1] == "runs" and parts[3] == "v1" and parts[4] == "runs":
        run_id, named, action = parts[2], parts[5], parts[6]
    else:
        return None
    if action not in _ACTIONS or not run_id or named == "" or parts[0]:
        return None
    return run_id, named, action


async def post_reward(px, scope, receive, run_id: str, named: str | None, action: str) -> Response:
    """A reward (or a judge request: `action` "complete") for a run (the module doc)."""
    if named is None:
        runkey.check_id(run_id)
    else:
        _same_run(run_id, named, action)
    declared = None
    for k, v in scope["headers"]:
        if k == b"content-length":
            declared = v
    key = keys.of(scope)  # an app's key: its runs only (another app's run is not found, 404)
    return await _reward(
        px, receive, declared, keys.scoped(key, run_id), judge=_ACTIONS[action], shown=run_id
    )


def _same_run(run_id: str, named: str, action: str) -> str:
    runkey.check_id(run_id)
    runkey.check_id(named)
    if named != run_id:
        raise APIError(
            400,
            f"the base URL names run {run_id!r} but the {action} names run {named!r}: post to "
            f"/runs/{run_id}/v1/{action} (this run) or /v1/runs/{named}/{action}",
            param="run_id",
            code="run_id_mismatch",
        )
    return run_id


async def _reward(
    px, receive, declared: bytes | None, run_id: str, judge: bool = False, shown: str | None = None
) -> Response:
    """Store a reward (or judge request) for stored run `run_id`; `shown`: the id the app used."""
    shown = run_id if shown is None else shown
    raw = await validate.read_body(receive, declared, px.settings.max_body_bytes)
    # orjson rejects NaN/Infinity literals as invalid JSON; accept them so they get the 422 they deserve
    body = (
        {}
        if judge and not raw.strip()
        else validate.parse_body(raw, px.settings.max_json_depth, non_finite=True)
    )
    rubric = None
    split = parse_split(body)
    if judge or body.get("judge") is True:
        if "reward" in body and body["reward"] is not None:
            raise APIError(422, "reward: a run completed for the judge has no reward", param="reward")
        if px.settings.judge == "off" and not px.settings.judge_policies:
            raise APIError(
                409,
                "the judge is off (RLPROXY_JUDGE=off): post a reward, or set RLPROXY_JUDGE=missing",
                code="judge_off",
            )
        reward, metrics = None, None
        rubric, metadata = parse_complete(body)
    else:
        reward, metrics, metadata = parse_reward(body, px.settings.reward_bound)
    fault = _file_fault(px)
    if fault is not None:  # the writes would land in an unlinked file, lost at the next start
        raise StoreUnavailable(
            f"the store's database file is {fault.split('_')[1]} (deleted or replaced while serving): "
            "rewards are not acknowledged; the operator must restore it and restart rlproxy serve",
            retry_after=30.0,
        )
    # Acknowledged only once the run's completions are committed: a completion still streaming or a
    # store that cannot commit within the bound is a 503 with Retry-After, never a late 200.
    bound = px.settings.store_wait_timeout
    deadline = time.monotonic() + bound
    if not await px.inflight.wait_idle(run_id, bound):
        raise StoreUnavailable(
            f"run {run_id!r} has a completion still in flight (a stream not finished); "
            "post the reward again once it has ended",
            retry_after=1.0,
        )
    remaining = max(0.05, deadline - time.monotonic())
    with px.runs.closing(run_id):
        try:
            stored = await px.writer.reward(
                run_id, reward, metrics, metadata, timeout=remaining, rubric=rubric, split=split
            )
        except StorageError as exc:
            if exc.status < 500:  # the client's to fix (no such run, a conflict): a line, not an error
                logger.info(
                    "%s of run %r refused (%d %s): %s",
                    "completion" if judge else "reward",
                    run_id,
                    exc.status,
                    exc.code,
                    exc,
                )
            raise
        px.runs.close(run_id)  # no more turns into this reward (proxy/runstate.py)
    if reward is None:
        return _json({"run_id": shown, "reward": None, "judge": True, "stored": stored})
    return _json({"run_id": shown, "reward": reward, "stored": stored})


@router.get("/v1/runs")
async def list_runs(
    request: Request, status: str | None = None, group_id: str | None = None, limit: Int64 = 50,
    cursor: str | None = None,
) -> Response:  # fmt: skip
    """Recent runs, newest first; pass `next_cursor` back as `cursor` for the next page."""
    if not 1 <= limit <= 1000:
        raise APIError(422, "limit: must be between 1 and 1000", param="limit", code="invalid_value")
    px = request.app.state.proxy
    try:
        runs, next_cursor = await queries.list_runs(
            px.engine, status=status, group_id=group_id, limit=limit, cursor=cursor
        )
    except ValueError as exc:
        raise APIError(422, f"cursor: {exc}", param="cursor", code="invalid_value") from None
    return _json({"object": "list", "data": runs, "next_cursor": next_cursor})


@router.get("/v1/runs/stats")
async def run_stats(request: Request) -> Response:
    """Runs per status (the dashboard's counters), and a notice when most rewarded runs are ungrouped."""
    counts = await queries.run_status_counts(request.app.state.proxy.engine)
    notice = singleton_notice(counts)  # None, or what to set when every task looks unique
    total = sum(counts.values())
    return _json({"object": "run_stats", "by_status": counts, "total": total, "notice": notice})


@router.get("/v1/runs/{run_id}")
async def get_run(request: Request, run_id: str) -> Response:
    """One run with its completions in order and its messages; a 404 only once the writer has
    committed what it holds (a run whose first call was just answered may still be queued)."""
    px = request.app.state.proxy
    key = keys.of(request.scope)  # an app's key reads its own runs only: another's is not found
    if keys.SEP in run_id and key is None and _is_admin(request, px.settings.admin_key):
        stored = run_id  # an operator reads an app's run by its stored id (`key_...~id`)
        runkey.check_id(run_id.partition(keys.SEP)[2])
    else:
        runkey.check_id(run_id)
        stored = keys.scoped(key, run_id)
    run = await queries.get_run(px.engine, stored)
    if run is None and px.writer is not None:  # read your writes: its completions may still be queued
        await px.writer.flush()
        run = await queries.get_run(px.engine, stored)
    if run is None:
        raise APIError(404, f"run {run_id!r} not found", code="not_found")
    if key is not None or not _operator(px.settings, request):
        _agents_view(run)  # an app never sees the upstream's address or 5xx body (the operator does)
    if key is not None:
        run["id"] = run_id
        run["group_id"] = keys.unscoped(key, run.get("group_id"))
        for c in run.get("completions") or ():
            c["run_id"] = run_id
    return _json(run)


AGENTS_ERROR = "the model server failed (status {status}); the operator's log and store have the detail"


def _is_admin(request: Request, admin_key: str | None) -> bool:
    """Whether the request carries the operators' key (the guard checked it is a valid key)."""
    if not admin_key:
        return False
    sent = request.headers.get("authorization") or (
        "Bearer " + request.headers["x-api-key"] if "x-api-key" in request.headers else ""
    )
    return hmac.compare_digest(sent.encode(), f"Bearer {admin_key}".encode())


def _operator(settings, request: Request) -> bool:
    """Whether the caller holds the admin key, or the proxy has no key at all (then every route,
    the operator's included, is open: nothing here is hidden from anyone)."""
    if settings.admin_key is None:
        return settings.api_key is None
    return _is_admin(request, settings.admin_key)


def _agents_view(run: dict) -> None:
    """A run as an agent sees it: a failed call's error says what the agent was told, not what the
    store keeps (the upstream's address, its 5xx body with paths and a traceback). A 4xx error is
    the refusal the client got, and stays."""
    for c in run.get("completions") or ():
        status = c.get("status_code")
        if isinstance(status, int) and 400 <= status < 500:
            continue
        if c.get("error"):
            c["error"] = AGENTS_ERROR.format(status=status)
        if c.get("status") == "error" and not (isinstance(status, int) and status < 400):
            c["response"] = None


@router.get("/v1/training/steps")
async def training_steps(request: Request, policy: str | None = None, limit: Int64 = 100) -> Response:
    """Training steps, newest first."""
    if not 1 <= limit <= 1000:
        raise APIError(422, "limit: must be between 1 and 1000", param="limit", code="invalid_value")
    px = request.app.state.proxy
    steps = await queries.list_training_steps(px.engine, policy=policy, limit=limit)
    return _json({"object": "list", "data": steps, "policies": px.policies.steps})


@router.get("/healthz")
async def healthz(request: Request) -> Response:
    """200 when the proxy, its upstream and its store work; 503 with the reason when one does not.

    The store is unhealthy when work has waited longer than `store_unhealthy_after` seconds without
    a commit (a locked or unreachable database); `rlproxy_store_healthy` says the same on /metrics.
    """
    px = request.app.state.proxy
    replicas = getattr(px.upstream, "snapshot", None)  # several upstreams: the pool knows each one
    try:
        ok = px.upstream.healthy() if replicas is not None else await px.backend.health()
    except Exception:
        ok = False
    writer = px.writer
    stalled = writer.stalled_for()
    file_fault = _file_fault(px)
    store_ok = stalled <= px.settings.store_unhealthy_after and file_fault is None
    status = "ok" if ok and store_ok else ("upstream_unhealthy" if not ok else "store_unhealthy")
    body = {
        "status": status,  # public route: never the upstream's address (README, Security)
        "policies": {p: px.policies.step(p) for p in sorted({px.policies.default, *px.policies.steps})},
        "write_queue_depth": writer.depth,
        "store": {
            "status": "ok" if store_ok else "unhealthy",
            "stalled_s": round(stalled, 3),
            "queue_bytes": writer.queue_bytes,
            # public route: the class of the last fault only, never its SQL, parameters or text
            # (issue 22 case 5); the message is in the log and on admin /metrics
            "last_error": fault_class(writer.last_error),
            "file": file_fault,  # file_missing | file_replaced | None (storage/db.py StoreFile)
            "dropped": writer.dropped,
        },
    }
    if replicas is not None:  # by index (the order of --upstream), never by address
        body["upstreams"] = replicas()
    return _json(body, 200 if ok and store_ok else 503)


def fault_class(last_error: str | None) -> str | None:
    """`"OperationalError"` of the writer's `"OperationalError: (sqlite3...) ... [SQL: ...]"`."""
    if not last_error:
        return None
    name = last_error.split(":", 1)[0].strip()
    return name if name.isidentifier() else "error"


def _file_fault(px) -> str | None:
    store_file = getattr(px, "store_file", None)
    return store_file.fault() if store_file is not None else None


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    px = request.app.state.proxy
    for policy, step in px.policies.steps.items():
        px.metrics.policy_step.labels(policy).set(step)
    return Response(px.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
