"""Which runs are closed: a run past `open` takes no more turns into its reward (issue 22, case 2).

A run is *closed* once its reward (or its request for the judge's) is stored: it is then
`completed`, `trained`, `validated`, `skipped`, `failed` or `ungrouped`. (`expired` is not closed:
it never had a reward and a late one still lands.) The hot path asks `RunState.admit` once per
request, which decides the run the turn joins:

    X-Run-Id (or /runs/{id}/v1) of a closed run            -> 409 `run_closed` (OpenAI's error shape)
    previous_response_id of a closed run, no run key        -> served and stored outside any run
                                                               (run_id NULL: visible, never trained)
    previous_response_id of run A with a run key B != A     -> 409 `previous_response_run_mismatch`:
                                                               a response id never copies one run's
                                                               conversation into another run

Why 409 rather than a new run: the app named the run and will post its reward by that id; a
silently made new run would be one the app cannot reward. A chained Responses call that names no
run inherited the run of its previous response; that run is over, so the turn is served (the
conversation goes on for its user) but belongs to no run and is never trained.

No store work on the hot path: the state keeps two bounded LRU sets in memory, runs known open
and runs known closed, and `admit` answers from them alone. At start (`load`) a replica reads the
ids of the runs closed most recently (up to its capacity): one query, so a restarted replica
refuses a closed run's next turn at once. The reward route closes a run here as soon as its reward
is stored (`close`); and `poll` reads every `run_state_poll_interval` seconds the ids of the runs
closed since its last look on any replica (a multi-writer PostgreSQL: a reward on replica B closes
the run for replica A too, within one interval). A run this replica has never seen is admitted as
open at once and checked in the background (`check_unseen`, at each poll: one query for every run
first seen since the last look, off the request): a run closed before the window `load` read
(older than the newest `capacity` closed runs) is known closed within one poll interval. A turn
that slips in within either window is stored, and never trained with that reward: the trainer
takes only completions created before it (storage/training.py `load_runs`). A store that cannot
answer leaves the run open (capture never breaks the user's response; the trainer's rule holds).

Why not one read per new run on the request (issue 24): each was a pooled connection, a thread hop
and a SQLAlchemy statement, ~2.5 ms of CPU; with a few turns per run it was most of a tagged
request's cost, and 64 concurrent first turns queued on the pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from rlproxy.errors import APIError
from rlproxy.storage import queries
from rlproxy.storage.errors import RunClosed

log = logging.getLogger(__name__)

SKEW_S = 5.0  # the poll reads back this much before its last look (replicas' clocks, slow commits)


class _LRU:
    """A bounded set with least-recently-used eviction."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        if key in self._d:
            self._d.move_to_end(key)
            return True
        return False

    def add(self, key: str) -> None:
        self._d[key] = None
        self._d.move_to_end(key)
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)

    def discard(self, key: str) -> None:
        self._d.pop(key, None)

    def __len__(self) -> int:
        return len(self._d)


class RunState:
    """The closed runs this replica knows of (see the module doc)."""

    def __init__(self, engine, *, poll_interval: float = 1.0, capacity: int = 100_000) -> None:
        self.engine = engine
        self.poll_interval = poll_interval
        self.capacity = capacity
        self.open = _LRU(capacity)
        self.closed = _LRU(capacity)
        self.lookups = 0  # store reads made for unseen runs (tests: one per run, never one per request)
        self.refused = 0  # turns refused (409) or moved out of a closed run
        self.late = 0  # turns admitted to a run the background check then found closed
        self._unseen: list[str] = []  # runs admitted before their check (`check_unseen`)
        self._closing: dict[str, int] = {}  # runs whose reward this replica is storing (`closing`)

    async def load(self) -> None:
        """At start: the runs closed most recently, up to `capacity` (module doc)."""
        try:
            ids = await queries.recently_closed(self.engine, self.capacity)
        except Exception as exc:  # a store that cannot answer: start with none known (module doc)
            log.warning("run state: could not read the closed runs at start (%s)", exc)
            return
        for run_id in reversed(ids):  # oldest first: the newest end up most recently used
            self.closed.add(run_id)

    def close(self, run_id: str) -> None:
        """The reward route stored a reward (or a judge request) for `run_id`."""
        self.open.discard(run_id)
        self.closed.add(run_id)

    @contextmanager
    def closing(self, run_id: str) -> Iterator[None]:
        """Around the reward route's store of `run_id`'s reward: a background check that finds the
        run closed meanwhile (the commit lands before the route hears of it) is seeing this
        replica's own reward, not a late turn. If the route then fails, `poll` still learns of a
        reward that was committed after all (`closed_since`)."""
        self._closing[run_id] = self._closing.get(run_id, 0) + 1
        try:
            yield
        finally:
            left = self._closing.pop(run_id) - 1
            if left:
                self._closing[run_id] = left

    def is_closed(self, run_id: str) -> bool:
        """From memory only; a run never seen is open, and checked in the background (`poll`)."""
        if run_id in self.closed:
            return True
        if run_id in self.open:
            return False
        self.open.add(run_id)
        self._unseen.append(run_id)
        return False

    def admit(self, run_id: str | None, inherited: str | None = None) -> str | None:
        """The run a turn joins: `run_id` is its own run key (X-Run-Id or the path), `inherited` the
        run of the response its `previous_response_id` names. Raises 409 as the module doc says."""
        if run_id is not None:
            if inherited is not None and inherited != run_id:
                self.refused += 1
                raise APIError(
                    409,
                    f"previous_response_id names a response of another run than {run_id!r}: continue "
                    "a conversation in its own run (send no run key, or that run's key)",
                    param="previous_response_id",
                    code="previous_response_run_mismatch",
                )
            if self.is_closed(run_id):
                self.refused += 1
                raise RunClosed(run_id)
            return run_id
        if inherited is not None and self.is_closed(inherited):
            self.refused += 1
            log.info("a turn continuing closed run %r is served outside any run", inherited)
            return None
        return inherited

    async def check_unseen(self, batch: int = 500) -> None:
        """Check the runs admitted unseen since the last look against the store (module doc).

        Only the runs queued when it is called: the ones admitted while its queries run wait for
        the next poll (looping until none was left, it queried back to back under steady traffic,
        ~60 queries a second for a few runs each, all of it on the serving loop: issue 24)."""
        pending, self._unseen = self._unseen, []
        for start in range(0, len(pending), batch):
            ids = pending[start : start + batch]
            self.lookups += len(ids)
            try:
                closed = await queries.closed_runs(self.engine, ids)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a slow or failing store: the runs stay open (module doc)
                log.warning("run state: could not check %d runs (%s); they stay open", len(ids), exc)
                continue
            for run_id in closed:
                if run_id in self.closed or run_id in self._closing:  # this replica's own reward
                    continue
                self.late += 1
                log.warning("run %r was closed before this replica saw it: no more turns", run_id)
                self.close(run_id)

    async def poll(self) -> None:
        """Forever: check the runs first seen since the last look, and learn the runs closed on other
        replicas since then (module doc)."""
        since = datetime.now(UTC) - timedelta(seconds=SKEW_S)
        while True:
            await asyncio.sleep(self.poll_interval)
            started = datetime.now(UTC)
            await self.check_unseen()
            try:
                for run_id in await queries.closed_since(self.engine, since):
                    if run_id in self.open:  # only runs this replica serves: memory stays bounded
                        self.close(run_id)
                since = started - timedelta(seconds=SKEW_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("run state: could not read the closed runs (%s)", exc)
