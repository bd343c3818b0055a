"""Several inference upstreams: replicas of one model behind one proxy (`--upstream` repeated).

`Upstreams` has `forward.Upstream`'s interface (`post`, `relay`, `aclose`) and holds one
`Upstream` per replica. `open_upstream` builds a plain `Upstream` when there is one URL, so the
single-upstream hot path is exactly what it was.

Choosing a replica (`choose`):
- A run sticks to one replica, so its growing conversation hits that replica's prefix cache.
  `least_loaded` (default): a new run (and a request without a run) goes to the healthy replica with
  the fewest requests in flight (ties take turns), and the choice is remembered per run in a bounded
  LRU map (`upstream_sticky_runs`). `hash`: the healthy replica with the highest rendezvous hash of
  (run id, URL): no memory, and every proxy of a fleet picks the same replica for a run.
- A run whose replica is ejected moves to another one and stays there (least_loaded; with `hash` it
  moves back when its replica returns). The first request after a move finds no cached prefix:
  that replica prefills the whole conversation again (a slower time to first token, once).

Failures (`eject`, probes):
- A request that could not connect (`BackendUnreachable`: nothing was sent) ejects the replica
  and goes to the next one; so when a replica stops, only the requests already in flight on it
  fail. Any other transport failure (a connection cut mid-answer) ejects it too, but the request
  is not sent again (a POST that may have reached an engine is never repeated).
- A 5xx answer probes the replica at once (a dead engine also fails `/health`; a bad request does not).
- A background task probes every replica each `upstream_probe_interval` seconds (`GET /health`,
  else `GET /v1/models` for servers without one): a healthy one that fails is ejected; an ejected one
  is probed with a doubling backoff up to `upstream_retry_max`. One that answers is `RESTORING`
  while `restore(url)` gives it the current adapters (`VLLMBackend.load_adapters_into`), and gets
  traffic only after that worked.

States of a replica:

    HEALTHY ──(connect/transport failure, failed probe)──> EJECTED ──(probe answers)──> RESTORING
       ^                                                      ^                              │
       └──────────────────(adapters loaded)───────────────────┴────(restore failed)──────────┘
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from rlproxy.errors import BackendError, BackendUnavailable, BackendUnreachable
from rlproxy.inference.backend import adapter_name
from rlproxy.proxy import http11
from rlproxy.proxy.forward import Upstream
from rlproxy.storage import queries

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0  # a replica that takes longer to answer /health is not healthy

Restore = Callable[[str], Awaitable[None]]


class State(enum.Enum):
    HEALTHY = "healthy"  # gets traffic
    EJECTED = "ejected"  # failed: no traffic; probed with a doubling backoff
    RESTORING = "restoring"  # answered a probe; being given the current adapters, no traffic yet


class Replica:
    """One upstream server and what the pool knows about it."""

    def __init__(self, index: int, upstream: Upstream) -> None:
        self.index = index
        self.upstream = upstream
        self.url = upstream.base_url
        self.state = State.HEALTHY
        self.inflight = 0  # requests sent and not yet answered in full (streams until they end)
        self.ejections = 0  # times ejected since start
        self.failed_probes = 0  # in a row, while ejected (the backoff's exponent)
        self.probe_at = 0.0  # time.monotonic() of the next probe while ejected
        self.reason = ""  # why it was last ejected

    @property
    def healthy(self) -> bool:
        return self.state is State.HEALTHY


class Upstreams:
    """The replicas behind the proxy: choose one per request, eject failed ones, probe and restore them."""

    def __init__(
        self,
        upstreams: Sequence[Upstream],
        restore: Restore | None = None,
        affinity: str = "least_loaded",
        sticky_runs: int = 100_000,
        probe_interval: float = 2.0,
        retry_max: float = 30.0,
    ) -> None:
        if affinity not in ("least_loaded", "hash"):
            raise ValueError(f"affinity must be least_loaded or hash, not {affinity!r}")
        self.replicas = [Replica(i, u) for i, u in enumerate(upstreams)]
        self.restore = restore
        self.affinity = affinity
        self.sticky_runs = sticky_runs
        self.probe_interval = probe_interval
        self.retry_max = max(retry_max, probe_interval)
        self.base_url = self.replicas[0].url  # what single-upstream callers log
        self._runs: OrderedDict[str, int] = OrderedDict()  # run id -> replica index (least_loaded)
        self._turn = itertools.count()
        self._probing: dict[int, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None

    # -- choosing ----------------------------------------------------------------------------

    def choose(self, run_id: str | None, exclude: frozenset[int] = frozenset()) -> Replica | None:
        """The replica for a request of `run_id` (None: no run), or None when no healthy one is left."""
        healthy = [r for r in self.replicas if r.healthy and r.index not in exclude]
        if not healthy:
            return None
        if run_id is None:
            return self._least_loaded(healthy)
        if self.affinity == "hash":
            return max(healthy, key=lambda r: _score(run_id, r.url))
        index = self._runs.get(run_id)
        if index is not None:
            replica = self.replicas[index]
            if replica.healthy and index not in exclude:
                self._runs.move_to_end(run_id)
                return replica
        replica = self._least_loaded(healthy)
        self._runs[run_id] = replica.index  # a new run, or one whose replica failed: it moves
        self._runs.move_to_end(run_id)
        if len(self._runs) > self.sticky_runs:
            self._runs.popitem(last=False)
        return replica

    def _least_loaded(self, healthy: list[Replica]) -> Replica:
        low = min(r.inflight for r in healthy)
        tied = [r for r in healthy if r.inflight == low]
        return tied[next(self._turn) % len(tied)]

    def _no_replica(self) -> BackendUnavailable:
        states = ", ".join(f"{r.url} {r.state.value}" for r in self.replicas)
        return BackendUnavailable(f"no healthy upstream replica ({states})")

    # -- forwarding (forward.Upstream's interface) -------------------------------------------

    async def post(
        self, path: bytes, headers: list, body: bytes, query: bytes, stream: bool, run_id: str | None = None
    ) -> http11.Response:
        """POST to the run's replica; one that cannot be connected to is ejected and the next one tried."""
        tried: frozenset[int] = frozenset()
        while True:
            replica = self.choose(run_id, tried)
            if replica is None:
                raise self._no_replica()
            replica.inflight += 1
            try:
                resp = await replica.upstream.post(path, headers, body, query, stream)
            except BackendUnreachable as exc:  # nothing was sent: the next replica takes it
                replica.inflight -= 1
                self.eject(replica, str(exc))
                tried |= {replica.index}
                continue
            except BaseException as exc:
                replica.inflight -= 1
                if isinstance(exc, BackendUnavailable):  # cut mid-answer: not sent again
                    self.eject(replica, str(exc))
                raise
            if resp.status_code >= 500:
                self._probe_soon(replica)
            if not stream:  # read whole already
                replica.inflight -= 1
            else:
                _on_close(resp, replica)
            return resp

    async def relay(self, request: Request, path: str, drop: frozenset[bytes]) -> Response:
        """Any other `/v1/*` request, to the least-loaded healthy replica (the next one if unreachable)."""
        tried: frozenset[int] = frozenset()
        while True:
            replica = self.choose(None, tried)
            if replica is None:
                raise self._no_replica()
            try:
                return await replica.upstream.relay(request, path, drop)
            except BackendUnreachable as exc:
                self.eject(replica, str(exc))
                tried |= {replica.index}

    # -- health ------------------------------------------------------------------------------

    def eject(self, replica: Replica, reason: str) -> None:
        """Take `replica` out of rotation; the probe loop tries it again after a backoff."""
        if replica.state is not State.HEALTHY:
            return
        replica.state = State.EJECTED
        replica.ejections += 1
        replica.failed_probes = 0
        replica.reason = reason
        replica.probe_at = time.monotonic() + self.probe_interval
        logger.warning("upstream replica %s ejected: %s", replica.url, reason)

    def _probe_soon(self, replica: Replica) -> None:
        """Check a replica that answered 5xx now, rather than at the next round."""
        if replica.index not in self._probing and replica.healthy:
            task = asyncio.create_task(self._check(replica), name=f"rlproxy-probe-{replica.index}")
            self._probing[replica.index] = task
            task.add_done_callback(lambda _t, i=replica.index: self._probing.pop(i, None))

    async def probe(self, replica: Replica) -> bool:
        """True when the replica answers `GET /health` (or `/v1/models` where /health is 404) with 200."""
        session = replica.upstream.session
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        try:
            for route in ("/health", "/v1/models"):
                async with session.get(replica.url + route, timeout=timeout) as resp:
                    if resp.status != 404:
                        return resp.status == 200
            return False
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def _check(self, replica: Replica) -> None:
        """One probe of one replica, and what follows from it."""
        ok = await self.probe(replica)
        if replica.state is State.HEALTHY:
            if not ok:
                self.eject(replica, "health probe failed")
            return
        if replica.state is not State.EJECTED:
            return
        if not ok:
            replica.failed_probes += 1
            wait = min(self.retry_max, self.probe_interval * 2**replica.failed_probes)
            replica.probe_at = time.monotonic() + wait
            return
        replica.state = State.RESTORING
        try:
            if self.restore is not None:
                await self.restore(replica.url)  # the current adapters, before any traffic
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            replica.state = State.EJECTED
            replica.failed_probes += 1
            replica.reason = f"restoring its adapters failed: {exc}"
            replica.probe_at = time.monotonic() + min(
                self.retry_max, self.probe_interval * 2**replica.failed_probes
            )
            logger.warning("upstream replica %s answers but %s", replica.url, replica.reason)
            return
        replica.state = State.HEALTHY
        replica.failed_probes = 0
        logger.info("upstream replica %s is back (ejected %d time(s) so far)", replica.url, replica.ejections)

    async def check_all(self) -> None:
        """Probe every replica that is due (all healthy ones, ejected ones past their backoff)."""
        now = time.monotonic()
        due = [
            r
            for r in self.replicas
            if r.index not in self._probing
            and (r.state is State.HEALTHY or (r.state is State.EJECTED and now >= r.probe_at))
        ]
        if due:
            await asyncio.gather(*(self._check(r) for r in due))

    async def run(self) -> None:
        """Forever: probe the replicas every `probe_interval` seconds (a lifespan task)."""
        while True:
            await asyncio.sleep(self.probe_interval)
            try:
                await self.check_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop the probes for good
                logger.exception("probing the upstream replicas failed")

    def start(self) -> None:
        """Start the probe loop (the first round of probes ran in `open_upstream`)."""
        self._task = asyncio.create_task(self.run(), name="rlproxy-upstream-probes")

    def healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)

    def snapshot(self) -> list[dict[str, Any]]:
        """Each replica's state for /healthz and /metrics (index, state, in flight, ejections)."""
        return [
            {"replica": r.index, "state": r.state.value, "inflight": r.inflight, "ejections": r.ejections}
            for r in self.replicas
        ]

    async def aclose(self) -> None:
        tasks = [t for t in (self._task, *self._probing.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except (asyncio.CancelledError, BackendError):
                pass
        for r in self.replicas:
            await r.upstream.aclose()


def _score(run_id: str, url: str) -> bytes:
    """Rendezvous hash of (run, replica): the replica with the highest score serves the run."""
    return hashlib.blake2b(f"{run_id}\x00{url}".encode(), digest_size=8).digest()


def _on_close(resp: http11.Response, replica: Replica) -> None:
    """Count the stream in flight on `replica` until the relay closes the response (however it ends)."""
    close = resp.close

    def closed() -> None:
        if not resp._released:  # noqa: SLF001 - close() is idempotent; the count must be too
            replica.inflight -= 1
        close()

    resp.close = closed  # type: ignore[method-assign]


def restorer(backend: Any, engine: Any) -> Restore | None:
    """`restore(url)` for `backend`: load into replica `url` the adapters the backend loaded itself
    and each policy's newest committed one (published by a separate `rlproxy train` process too)."""
    if len(backend.base_urls) < 2:  # one server: nothing to restore into
        return None

    async def restore(url: str) -> None:
        latest = await queries.latest_adapters(engine)
        await backend.load_adapters_into(
            url, {adapter_name(p, step): path for p, (step, path) in latest.items()}
        )

    return restore


async def open_upstream(
    urls: Sequence[str], settings: Any, api_key: str | None, restore: Restore | None = None
) -> Upstream | Upstreams:
    """A plain `Upstream` for one URL; else `Upstreams` over all of them, probed once (those that do
    not answer start ejected, and are restored when they do) with its probe loop started."""
    made = [Upstream.of(url, settings, api_key) for url in urls]
    if len(made) == 1:
        return made[0]
    pool = Upstreams(
        made,
        restore=restore,
        affinity=settings.upstream_affinity,
        sticky_runs=settings.upstream_sticky_runs,
        probe_interval=settings.upstream_probe_interval,
        retry_max=settings.upstream_retry_max,
    )
    await pool.check_all()
    pool.start()
    logger.info(
        "%d upstream replicas (%s): %s",
        len(made),
        settings.upstream_affinity,
        ", ".join(f"{r.url} {r.state.value}" for r in pool.replicas),
    )
    return pool
