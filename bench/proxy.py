"""What the proxy costs as its users drive it: added latency, event-loop lag, throughput, CPU, rows.

One run, several processes: a plain-asyncio stub upstream (tests/stub_upstream.py), the proxy
(`rlproxy serve` attached to the stub, capture on, SQLite, no trainer, no access log), `wrk` (Debian
package `wrk`) with a small Lua script as the load generator (a Python client saturates near 600
req/s and would hide the proxy's cost), and, while the load runs, this process posting rewards and
(in the `+poll` cases) a subprocess running the trainer's poll against the same SQLite file. Every
case runs against the stub directly and through the proxy in alternating slices of the same run, so
the printed ratios compare like with like.

What users do, and so what is measured: every request carries an `X-Run-Id` (a run is `--turns`
consecutive requests of one wrk thread, 4 by default; each slice has its own run ids), and a reward
is posted for `--reward-share` of the runs (half by default) as soon as the store holds all of their
turns (`runs.next_seq >= turns`, read from the file), on a few keep-alive connections, while the
load runs: the reward path (which waits for its run's commit) competes with the completions. The
trainer poll (`--poller`, the `+poll` cases) is the storage poll query at the trainer's interval:
`ungroup_runs` + `ready_groups` every `poll_interval` (1 s) in its own process on the same file,
what `TrainerService._select` reads when no step is ready (no torch, no step: the proxy's side of
a trainer sharing its store). The event loop's lag is the proxy's own histogram
`rlproxy_event_loop_lag_seconds` (/metrics), read before and after each proxy slice; next to it,
how long the serving thread waited for a core while runnable (`/proc/<pid>/schedstat`): a lag the
box's scheduler made (wrk, the stub and the writer share the cores), not the proxy's code.

    1. delay 0, concurrency 1, non-streaming, untagged and tagged: latency added by the proxy at p50
       and p99 (goal, tagged: p50 <= 0.3 ms, p99 <= 2 ms) and loop lag p99 (goal <= 1 ms).
    2. delay 50 ms (a model's pace), concurrency 64, chat and Responses, stream and not, tagged with
       rewards flowing: throughput via proxy / direct (goal >= 0.95).
    3. CPU seconds of the proxy (its serving and writer processes together) per 1,000 requests
       (goal <= 0.35 tagged non-stream chat, stream <= 1.5x that).
    4. rows stored == requests the proxy forwarded, in every case; every reward answered 200.
    5. `POST /v1/responses` (served over the upstream's chat completions) against the equivalent
       chat request sent directly, so "added" includes the translation both ways.
    6. `POST /v1/messages` (Anthropic's Messages API, served the same way): latency at c=1 (goal
       added p50 <= 1 ms) and streaming throughput at 64 (goal >= 0.9x).
    7. The floor, in the chat cases: bench/bare_relay.py (uvicorn as `serve` runs it and the same
       upstream client, nothing checked or captured) in the same alternating slices, so what rlproxy's
       own work adds is read off this machine, not against absolute goals set on another.
    8. Before the cases, the proxy idle (no request for 1.5 s): the CPU its two processes use a
       second doing nothing, what a laptop pays for leaving `serve` running.
    9. `--keys` (issue 55): the tagged c=1 case also through a second `rlproxy serve` on the same
       stub whose store holds one app key (`rlproxy keys create` before it starts; no limits, every
       policy), with that key's bearer, its rewards too: keys on, against the proxy without keys
       (keys off) in the same rounds, the two in swapped order every round. Prints keys on's line,
       p50/p99 keys on - keys off (goal: p50 within 0.05 ms) and added over direct for each, and its
       rows (stored under the key's namespace, `<key id>~<run id>`) == requests forwarded.
   10. `--otlp` (issue 58): the same, with a second `rlproxy serve` that exports every call live as an
       OTLP span (`RLPROXY_OTLP_ENDPOINT`) to a sink in this process (it answers 200, counts what it
       got): export on against export off (the proxy above); p50 on - off (goal: within 0.05 ms), its
       rows == requests forwarded, and its spans exported / dropped / failed (its /metrics).

`--pin` gives the serving process (and the floor) a core of its own and puts wrk, the stub, the
writer process and this process on the others: the layout of a deployment, where the app and the
model server run elsewhere. Unpinned, all of them share the cores, as on a laptop.

    python bench/proxy.py            # 10 s per measurement
    python bench/proxy.py --quick    # 3 s per measurement
    python bench/proxy.py --quick --route responses   # only the Responses API cases
    python bench/proxy.py --quick --route messages    # only the Messages API cases (Anthropic's)
    python bench/proxy.py --compare litellm           # direct vs rlproxy vs LiteLLM (make litellm)
    python bench/proxy.py --quick --pin               # the proxy on a core of its own
    python bench/proxy.py --quick --only '^tagged c=1 delay=0$' --keys   # keys on vs keys off
    python bench/proxy.py --quick --only '^tagged c=1 delay=0$' --otlp   # live OTLP export on vs off
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import functools
import math
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

LUA = r"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local run_id = os.getenv("BENCH_RUN_ID")
local turns = tonumber(os.getenv("BENCH_TURNS") or "0") or 0
if run_id and run_id ~= "" and turns == 0 then wrk.headers["X-Run-Id"] = run_id end
local delay = os.getenv("BENCH_DELAY")
if delay and delay ~= "" then wrk.headers["x-stub-delay"] = delay end
local auth = os.getenv("BENCH_AUTH")
if auth and auth ~= "" then wrk.headers["Authorization"] = auth end
local stream = os.getenv("BENCH_STREAM") == "1"
if os.getenv("BENCH_ROUTE") == "responses" then
  -- the same conversation as a Responses request: instructions + input (the chat body below)
  wrk.body = '{"model":"stub-model","instructions":"You are a helpful agent.",'
    .. '"input":"Find the weather in Paris and answer in one word.",'
    .. '"max_output_tokens":8,"temperature":0.7' .. (stream and ',"stream":true' or '') .. '}'
elseif os.getenv("BENCH_ROUTE") == "messages" then
  -- the same conversation as an Anthropic Messages request: system + messages
  wrk.headers["anthropic-version"] = "2023-06-01"
  wrk.body = '{"model":"stub-model","system":"You are a helpful agent.",'
    .. '"messages":[{"role":"user","content":"Find the weather in Paris and answer in one word."}],'
    .. '"max_tokens":8,"temperature":0.7' .. (stream and ',"stream":true' or '') .. '}'
else
  wrk.body = '{"model":"stub-model","messages":[{"role":"system","content":"You are a helpful agent."},'
    .. '{"role":"user","content":"Find the weather in Paris and answer in one word."}],'
    .. '"max_tokens":8,"temperature":0.7' .. (stream and ',"stream":true' or '') .. '}'
end
-- tagged traffic: run "<BENCH_RUN_ID>-<thread>-<k>" is this thread's requests k*turns .. k*turns+turns-1
local nthreads = 0
setup = function(thread)
  nthreads = nthreads + 1
  thread:set("tid", nthreads)
end
if run_id and run_id ~= "" and turns > 0 then
  local counter = 0
  request = function()
    local k = math.floor(counter / turns)
    counter = counter + 1
    wrk.headers["X-Run-Id"] = run_id .. "-" .. tid .. "-" .. k
    return wrk.format()
  end
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %d %d %d %d %.1f %.1f %.1f\n", summary.requests, summary.duration,
    e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def wrk_env(
    run_id: str, delay: float | None, stream: bool, auth: str = "", route: str = "chat", turns: int = 0
) -> dict[str, str]:
    """What the Lua script reads: no delay = no x-stub-delay header (the stub's own delay applies);
    `route` "responses" sends the Responses form of the request; `turns` > 0 tags the requests with
    a run id per `turns` requests (`run_id` is then the prefix), else every request has `run_id`."""
    return {
        **os.environ,
        "BENCH_RUN_ID": run_id,
        "BENCH_TURNS": str(turns),
        "BENCH_DELAY": "" if delay is None else str(delay),
        "BENCH_STREAM": "1" if stream else "0",
        "BENCH_AUTH": auth,
        "BENCH_ROUTE": route,
    }


def wrk(
    url: str,
    script: Path,
    conns: int,
    seconds: float,
    run_id: str,
    delay: float | None,
    stream: bool,
    auth: str = "",
    route: str = "chat",
    turns: int = 0,
) -> dict:
    """Run wrk; its Lua `done` prints: requests, duration us, non-2xx, socket errors, p50, p99, mean (us)."""
    env = wrk_env(run_id, delay, stream, auth, route, turns)
    threads = 1 if conns == 1 else 2
    secs = max(1, round(seconds))  # wrk takes whole seconds only ("-d2.4s" exits 1)
    cmd = ["wrk", f"-t{threads}", f"-c{conns}", f"-d{secs}s", "--timeout", "10s", "-s", str(script), url]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    n, dur, non2xx, sockerr, p50, p99, mean = line.split()[1:]
    return {
        "requests": int(n),
        "rps": int(n) / (int(dur) / 1e6),
        "non2xx": int(non2xx),
        "socket_errors": int(sockerr),
        "p50_ms": float(p50) / 1000,
        "p99_ms": float(p99) / 1000,
        "mean_ms": float(mean) / 1000,
    }


def combine(results: list[dict]) -> dict:
    """Rounds of one side: summed requests and rate, median of each round's percentiles."""
    return {
        "requests": sum(r["requests"] for r in results),
        "rps": sum(r["rps"] for r in results) / len(results),
        "non2xx": sum(r["non2xx"] for r in results),
        "socket_errors": sum(r["socket_errors"] for r in results),
        "p50_ms": statistics.median(r["p50_ms"] for r in results),
        "p99_ms": statistics.median(r["p99_ms"] for r in results),
    }


def stub_count(stub_url: str) -> int:
    return httpx.get(f"{stub_url}/stub/stats").json()["requests"]


def rows_for(db_path: Path, run_id: str, expect: int, wait_s: float = 15.0, prefix: bool = False) -> int:
    """Completions stored for `run_id` (every run id starting `run_id-` when `prefix`), once the
    writer has caught up with `expect` (or wait_s passed)."""
    deadline = time.monotonic() + wait_s
    n = -1
    query = "SELECT count(*) FROM completions WHERE " + (
        "run_id >= ? AND run_id < ?" if prefix else "run_id = ? AND ? IS NOT NULL"
    )
    args = (run_id + "-", run_id + ".") if prefix else (run_id, 1)  # "." sorts right after "-"
    while time.monotonic() < deadline:
        con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)
        try:
            n = con.execute(query, args).fetchone()[0]
        finally:
            con.close()
        if n >= expect:
            break
        time.sleep(0.2)
    return n


class Rewarder:
    """Posts rewards while the load runs: for `share` of the runs whose prefix is `prefix`, as soon
    as the store holds all `turns` of their completions (read from the SQLite file, read-only).
    `auth` (an app key's `Bearer rk-...`, `--keys`) goes with each reward; its runs are stored as
    `scope` + the run id (`<key id>~`, proxy/keys.py) and rewarded by the id the app sent."""

    def __init__(
        self,
        proxy_url: str,
        db_path: Path,
        share: float,
        turns: int,
        workers: int = 4,
        auth: str = "",
        scope: str = "",
    ) -> None:
        self.url, self.db_path, self.share, self.turns = proxy_url, db_path, share, turns
        self.scope = scope
        self.client = httpx.Client(
            base_url=proxy_url,
            timeout=30.0,
            limits=httpx.Limits(max_connections=workers),
            headers={"Authorization": auth} if auth else None,
        )
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="bench-reward")
        self.prefix: str | None = None
        self.seen: set[str] = set()
        self.codes: dict[int, int] = {}
        self.latencies: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-rewarder", daemon=True)
        self._thread.start()

    def watch(self, prefix: str | None) -> None:
        """Reward the runs of `prefix` from now on (None: none); the counts restart."""
        with self._lock:
            self.prefix, self.codes, self.latencies = prefix, {}, []

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            prefix = self.prefix
            if prefix is None:
                continue
            prefix = self.scope + prefix
            try:
                con = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=10)
                try:
                    ids = [
                        r[0]
                        for r in con.execute(
                            "SELECT id FROM runs WHERE id >= ? AND id < ?"
                            " AND next_seq >= ? AND reward IS NULL",
                            (prefix + "-", prefix + ".", self.turns),
                        )
                    ]
                finally:
                    con.close()
            except sqlite3.Error:
                continue
            for rid in ids:
                if rid in self.seen:
                    continue
                self.seen.add(rid)
                rid = rid.removeprefix(self.scope)  # the id the app sent
                crc = zlib.crc32(rid.encode())
                if crc % 1000 < self.share * 1000:
                    self.pool.submit(self._post, rid, (crc % 11) / 10)

    def _post(self, run_id: str, reward: float) -> None:
        t0 = time.perf_counter()
        try:
            code = self.client.post(f"/v1/runs/{run_id}/reward", json={"reward": reward}).status_code
        except httpx.HTTPError:
            code = -1
        with self._lock:
            self.codes[code] = self.codes.get(code, 0) + 1
            self.latencies.append(time.perf_counter() - t0)

    def drain(self, wait_s: float = 3.0) -> tuple[dict[int, int], list[float]]:
        """Let the last runs' rewards go out; the status counts and latencies since `watch`."""
        time.sleep(wait_s)
        with self._lock:
            return dict(self.codes), list(self.latencies)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()


def poll_store(db_path: str, interval: float) -> int:
    """`--poller`: the trainer's poll (`ungroup_runs` + `ready_groups`, as TrainerService._select
    runs them when no step is ready) every `interval` s on `db_path`, until killed; prints each
    poll's time when stopped (SIGTERM)."""
    import asyncio
    import signal

    sys.path.insert(0, str(ROOT))
    from rlproxy.storage.db import create_engine
    from rlproxy.storage.training import ready_groups, ungroup_runs
    from rlproxy.trainer.config import TrainerConfig

    cfg = TrainerConfig()
    times: list[float] = []

    async def loop() -> None:
        engine = create_engine(f"sqlite+aiosqlite:///{db_path}")
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        while not stop.is_set():
            t0 = time.perf_counter()
            await ungroup_runs(engine, group_timeout=cfg.group_timeout)
            await ready_groups(engine, group_size=cfg.group_size, group_timeout=cfg.group_timeout)
            times.append(time.perf_counter() - t0)
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass
        await engine.dispose()

    asyncio.run(loop())
    if times:
        print(f"POLLS {len(times)} {statistics.median(times) * 1000:.1f} {max(times) * 1000:.1f}", flush=True)
    return 0


class Poller:
    """`bench/proxy.py --poller DB` in its own process (its CPU is not the proxy's)."""

    def __init__(self, db_path: Path, interval: float) -> None:
        cmd = [sys.executable, __file__, "--poller", str(db_path), "--poll-interval", str(interval)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        atexit.register(self.proc.kill)  # a benchmark that fails leaves no poller behind

    def stop(self) -> str:
        self.proc.terminate()
        out = self.proc.communicate(timeout=30)[0]
        line = next((ln for ln in out.splitlines() if ln.startswith("POLLS")), None)
        if line is None:
            return "trainer poll: no poll finished"
        n, med, worst = line.split()[1:]
        return f"trainer poll: {n} polls, median {med} ms, worst {worst} ms"


def loop_lag(proxy_url: str) -> dict[float, float]:
    """The proxy's `rlproxy_event_loop_lag_seconds` buckets: upper bound -> cumulative count."""
    out: dict[float, float] = {}
    for line in httpx.get(f"{proxy_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("rlproxy_event_loop_lag_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.split()[-1])
    return out


def lag_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The q-quantile of the lag samples between two scrapes, as its bucket's upper bound (s)."""
    diff = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    total = diff.get(float("inf"), 0.0)
    if total <= 0:
        return float("nan")
    for le, n in diff.items():
        if n >= q * total:
            return le
    return float("inf")


def _run_ns(pid: int) -> int:
    """Nanoseconds all threads of `pid` have run (0 for a process gone)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return total


class Proxy:
    """`rlproxy serve` attached to the stub, in its own process (so its CPU time is its own)."""

    def __init__(
        self, stub_url: str, db_path: Path, label: str = "rlproxy serve", env: dict | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.label = label  # names it in the lines it prints
        env = {
            **os.environ,
            "RLPROXY_MODEL": "stub-model",
            "RLPROXY_UPSTREAM": stub_url,
            "RLPROXY_BACKEND": "vllm",
            "RLPROXY_TRAIN": "false",
            "RLPROXY_DB_URL": f"sqlite+aiosqlite:///{db_path}",
            **(env or {}),
        }
        cmd = [
            str(VENV_BIN / "rlproxy"),
            "serve",
            "--port",
            str(self.port),
            "--no-access-log",
            "--log-level",
            "warning",
        ]
        # its log goes to a file: a pipe nobody reads fills up and blocks the proxy's next write
        self.log = open(db_path.with_suffix(".serve.log"), "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        wait_http(f"{self.url}/healthz")
        self.ps = psutil.Process(self.proc.pid)

    def cpu(self) -> float:
        """CPU seconds of `rlproxy serve` and its writer process (storage/writer_link.py), together."""
        return self.serving_cpu() + self.writer_cpu()

    def waited(self) -> float:
        """Seconds the serving thread has spent runnable but not running (its run-queue wait, from
        /proc/<pid>/schedstat; 0 where there is none): time the box's scheduler gave its core to
        another process (wrk, the stub, the writer), which no change to the proxy's code removes."""
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/schedstat") as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def run_ns(self) -> tuple[int, int]:
        """Nanoseconds the serving process and its writer process have run (schedstat: finer than
        `cpu_times`' clock ticks, for an idle process's few milliseconds a second)."""
        return _run_ns(self.proc.pid), sum(_run_ns(c.pid) for c in self.ps.children(recursive=True))

    def serving_cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def writer_cpu(self) -> float:
        """The writer process's CPU seconds (and those of writer processes that exited)."""
        t = self.ps.cpu_times()
        total = t.children_user + t.children_system
        for child in self.ps.children(recursive=True):
            try:
                c = child.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += c.user + c.system
        return total

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        warnings = [
            ln for ln in Path(self.log.name).read_text().splitlines() if " WARNING " in ln or " ERROR " in ln
        ]
        if warnings:
            print(f"\n## {self.label} logged {len(warnings)} warnings or errors; the first: {warnings[0]}")


class Sink:
    """`--otlp`: an OTLP/HTTP endpoint that answers every export 200 (an empty
    ExportTraceServiceResponse) and counts the requests and bytes it got, on a thread of this process."""

    def __init__(self) -> None:
        self.requests = self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                sink.bytes += len(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                sink.requests += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True, name="bench-otlp-sink").start()


class KeysOn:
    """`--keys`: a second `rlproxy serve` on the same stub whose store holds one app key, made as an
    operator makes it (`rlproxy keys create`, no limits, every policy) before it starts, so that
    every request it serves is keyed (hashed bearer, ids namespaced per key, policy check, cache
    salt, counters). The keyed cases also run through it with that key's bearer, in the same rounds
    as the proxy without keys (`Proxy`, keys off), and their rewards go with the same bearer.

    `--otlp` (`sink` given): the second proxy has no key and exports every call live to `sink`
    instead (`RLPROXY_OTLP_ENDPOINT`): export on, against the proxy above (export off)."""

    NAME = "bench-app"

    def __init__(
        self, stub_url: str, db_path: Path, share: float, turns: int, sink: Sink | None = None
    ) -> None:
        self.db_path, self.stub_url, self.sink = db_path, stub_url, sink
        self.what = "otlp" if sink is not None else "keys"
        if sink is not None:
            self.key_id, self.auth, self.scope = "", "", ""
            self.proxy = Proxy(
                stub_url, db_path, "rlproxy serve (--otlp: export on)", {"RLPROXY_OTLP_ENDPOINT": sink.url}
            )
            self.rewarder = Rewarder(self.proxy.url, db_path, share, turns)
            self.start(None)
            return
        out = subprocess.run(
            [str(VENV_BIN / "rlproxy"), "keys", "create", "--name", self.NAME],
            env={**os.environ, "RLPROXY_DB_URL": f"sqlite+aiosqlite:///{db_path}"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        found = re.search(rf"key (key_\w+) \({self.NAME}\): (rk-\S+)", out)
        if found is None:
            raise RuntimeError(f"rlproxy keys create printed no key: {out!r}")
        self.key_id, self.auth = found[1], f"Bearer {found[2]}"
        self.scope = self.key_id + "~"  # its runs' stored ids (proxy/keys.py `scoped`)
        self.proxy = Proxy(stub_url, db_path, "rlproxy serve (--keys: keys on)")
        self.rewarder = Rewarder(self.proxy.url, db_path, share, turns, auth=self.auth, scope=self.scope)
        self.start(None)

    def start(self, run_id: str | None) -> None:
        """A new case (`run_id` None: one the keyed proxy sits out): its counts restart."""
        self.rewarder.watch(run_id)
        self.slices: list[dict] = []
        self.forwarded, self.cpu = 0, 0.0

    def slice(self, url: str, script: Path, conns: int, secs: float, slice_id: str, **kw) -> None:
        """One wrk slice through the keyed proxy (`kw`: wrk's delay, stream, route, turns)."""
        before_stub, before_cpu = stub_count(self.stub_url), self.proxy.cpu()
        self.slices.append(wrk(url, script, conns, secs, slice_id, auth=self.auth, **kw))
        self.forwarded += settled(self.stub_url, before_stub, quiet_s=0.3)
        self.cpu += self.proxy.cpu() - before_cpu

    def close(self) -> None:
        self.rewarder.close()
        self.proxy.stop()


def keys_on(keys: KeysOn, name: str, run_id: str, d: dict, off: dict, tagged: bool) -> list[str]:
    """`--keys` (`--otlp`): print the keyed (exporting) side of case `name` against keys off (export
    off: `off`, the proxy's slices) and direct (`d`) of the same rounds; return the goals it missed."""
    failures: list[str] = []
    what, on = keys.what, combine(keys.slices)
    codes, _ = keys.rewarder.drain(0.0) if tagged else ({}, [])  # the keys-off drain waited already
    rows = rows_for(keys.db_path, keys.scope + run_id, keys.forwarded, prefix=tagged)
    print(
        f"  {what} on: {on['rps']:8.0f} req/s  p50 {on['p50_ms']:.3f} ms  p99 {on['p99_ms']:.3f} ms"
        f"  (non-2xx {on['non2xx']}, socket errors {on['socket_errors']})"
        f"  {keys.cpu / max(keys.forwarded, 1) * 1000:.3f} CPU-s per 1,000"
        + (" (an app key's bearer)" if what == "keys" else " (live OTLP export)")
    )
    diff50, diff99 = on["p50_ms"] - off["p50_ms"], on["p99_ms"] - off["p99_ms"]
    ok = abs(diff50) <= GOALS[f"{what}_p50_ms"]
    print(
        f"  {what} on - {what} off: p50 {diff50:+.3f} ms (goal within {GOALS[f'{what}_p50_ms']}),"
        f" p99 {diff99:+.3f} ms; added over direct: p50 {on['p50_ms'] - d['p50_ms']:.3f} ms ({what} off"
        f" {off['p50_ms'] - d['p50_ms']:.3f}), p99 {on['p99_ms'] - d['p99_ms']:.3f} ms ({what} off"
        f" {off['p99_ms'] - d['p99_ms']:.3f})  {'OK' if ok else 'MISSED'}"
    )
    if not ok:
        failures.append(f"{name} {what} p50")
    same = rows == keys.forwarded and on["non2xx"] == 0
    rewarded = f"rewards posted {sum(codes.values())}: {codes}; " if tagged else ""
    print(
        f"  {what} on: {rewarded}rows stored {rows} == requests forwarded {keys.forwarded}"
        f" (wrk completed {on['requests']}): {'OK' if same else 'MISMATCH'}"
    )
    if not same:
        failures.append(f"{name} {what} rows")
    if tagged and (codes.get(200, 0) != sum(codes.values()) or not codes):
        failures.append(f"{name} {what} rewards")
    if keys.sink is not None:  # what the export did so far (the last batch may still be queued)
        metrics = httpx.get(f"{keys.proxy.url}/metrics").text
        counts = re.findall(r"^rlproxy_otlp_spans_(\w+)_total (\S+)$", metrics, re.M)
        print(
            f"  otlp on: spans {', '.join(f'{k} {float(v):.0f}' for k, v in counts)}; the sink got"
            f" {keys.sink.requests} export requests, {keys.sink.bytes} bytes"
        )
    return failures


# ---- --compare litellm: direct vs rlproxy vs LiteLLM's proxy, same stub, same wrk, same run ----

RAMP_S = 2.0  # wrk runs this long before the window opens: LiteLLM's first 64 answers take ~2 s


class Floor:
    """bench/bare_relay.py under uvicorn as `serve` runs it: the stack's own cost, nothing captured."""

    def __init__(self, stub_url: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "BARE_RELAY_UPSTREAM": stub_url.removeprefix("http://")}
        cmd = [sys.executable, "-m", "uvicorn", "bench.bare_relay:app", "--port", str(self.port)]
        cmd += ["--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        atexit.register(self.proc.kill)
        wait_http(f"{self.url}/healthz")  # any answer: the relay forwards it to the stub
        self.ps = psutil.Process(self.proc.pid)

    def cpu(self) -> float:
        return cpu_seconds(self.ps)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def cpu_seconds(ps: psutil.Process | None) -> float:
    if ps is None:
        return 0.0
    t = ps.cpu_times()
    return t.user + t.system


def steady(
    url: str, script: Path, conns: int, env: dict, count_url: str, ps: psutil.Process | None, window: float
) -> dict:
    """One wrk run of RAMP_S + window seconds; requests/s and CPU per request over the window only.

    A server that answers 64 concurrent requests at ~30 req/s completes nothing in its first ~2 s,
    so wrk's own count over a short run understates its rate. The stub's count of arriving
    requests, read after the ramp, is the steady rate; wrk still gives the latency percentiles.
    """
    seconds = math.ceil(RAMP_S + window + 0.5)  # wrk takes whole seconds
    cmd = ["wrk", f"-t{1 if conns == 1 else 2}", f"-c{conns}", f"-d{seconds}s", "--timeout", "20s"]
    w = subprocess.Popen([*cmd, "-s", str(script), url], env=env, stdout=subprocess.PIPE, text=True)
    time.sleep(RAMP_S)
    n0, c0, t0 = stub_count(count_url), cpu_seconds(ps), time.monotonic()
    time.sleep(window)
    n1, c1, t1 = stub_count(count_url), cpu_seconds(ps), time.monotonic()
    out = w.communicate()[0]
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    n, _dur, non2xx, sockerr, p50, p99, _mean = line.split()[1:]
    return {
        "requests": int(n),
        "rps": (n1 - n0) / (t1 - t0),
        "cpu_ms": (c1 - c0) / max(n1 - n0, 1) * 1000,
        "errors": int(non2xx) + int(sockerr),
        "p50_ms": float(p50) / 1000,
        "p99_ms": float(p99) / 1000,
    }


def write_backlog(proxy_url: str) -> int:
    """Records rlproxy has accepted but not yet committed (its writer's queue), from /metrics."""
    for line in httpx.get(f"{proxy_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("rlproxy_write_queue_depth"):
            return int(float(line.split()[-1]))
    return -1


def settled(stub_url: str, before: int, quiet_s: float = 0.5) -> int:
    """Requests the stub saw since `before`, once its count has stopped moving for `quiet_s`."""
    last, now = -1, stub_count(stub_url)
    while now != last:
        time.sleep(quiet_s)
        last, now = now, stub_count(stub_url)
    return now - before


def _pin(pid: int, cpus: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, OSError):  # a thread that ended meanwhile
            pass


def pin_layout(stub: subprocess.Popen, proxy: Proxy, floor: Floor, keys: KeysOn | None = None) -> str:
    """`--pin`: the proxy's serving process and the floor (and `--keys`' proxy) on the last core, the
    rest (this process, so wrk and the poller, the stub, the writer processes) on the others; says
    so in a line."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or not sys.platform.startswith("linux"):
        return "unpinned (--pin needs Linux and 2 cores)"
    own, rest = {cpus[-1]}, set(cpus[:-1])
    _pin(os.getpid(), rest)
    _pin(stub.pid, rest)
    for serving in [proxy] + ([keys.proxy] if keys is not None else []):
        _pin(serving.proc.pid, own)
        for child in serving.ps.children(recursive=True):  # the writer process (idle priority)
            _pin(child.pid, rest)
    _pin(floor.proc.pid, own)
    others = ",".join(str(c) for c in cpus[:-1])
    serving = "serving processes (keys off, keys on)" if keys is not None else "serving process"
    return f"pinned: {serving} and floor on CPU {cpus[-1]}; wrk, stub, writer on CPU {others}"


def machine() -> str:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        "unknown CPU",
    )
    return f"nproc {len(os.sched_getaffinity(0))}, {cpu}"


def compare_litellm(window: float, rounds: int, delay: float) -> int:
    """Direct, rlproxy and LiteLLM per concurrency (1, 16, 64) and mode; prints a markdown table."""
    sys.path.insert(0, str(ROOT))  # bench/ as a namespace package
    from bench.litellm import LOGGING, LiteLLM
    from bench.litellm import version as litellm_version

    tmp = Path(tempfile.mkdtemp(prefix="rlproxy-bench-"))
    script = tmp / "post.lua"
    script.write_text(LUA)
    # Two identical stubs: rlproxy gets its own so that what it forwarded can be counted exactly
    # (a request it accepted just before wrk stopped reaches the stub a moment later). The delay is
    # the stub's own, not a request header: LiteLLM does not forward unknown headers.
    ports = [free_port(), free_port()]
    stubs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "stub_upstream.py"),
                "--port",
                str(port),
                "--delay",
                str(delay),
            ],
            stdout=subprocess.DEVNULL,
        )
        for port in ports
    ]
    shared_url, own_url = (f"http://127.0.0.1:{p}" for p in ports)
    proxy: Proxy | None = None
    lite: LiteLLM | None = None
    try:
        wait_http(f"{shared_url}/health")
        wait_http(f"{own_url}/health")
        proxy = Proxy(own_url, tmp / "bench.db")
        lite = LiteLLM(shared_url).start()
        sides = {  # name: (url, stub that counts its requests, its process for CPU time)
            "direct": (f"{shared_url}/v1/chat/completions", shared_url, None),
            "rlproxy": (f"{proxy.url}/v1/chat/completions", own_url, proxy.ps),
            "litellm": (f"{lite.url}/v1/chat/completions", shared_url, psutil.Process(lite.proc.pid)),
        }
        # the same request to all three: LiteLLM's key as a Bearer token, no x-stub-delay header
        auth = lite.headers["Authorization"]
        for url, _, _ in sides.values():  # warm up: pools, lazy imports, the SQLite file
            for stream in ("0", "1"):
                wrk(url, script, 4, 2, "warmup", None, stream == "1", auth)
        now = datetime.datetime.now(datetime.UTC)
        print(f"# bench/proxy.py --compare litellm, {now:%Y-%m-%d %H:%M} UTC, {machine()}")
        print(f"# LiteLLM {litellm_version()}, what it was doing: {LOGGING}")
        print(
            f"# rlproxy: capture on, SQLite (WAL), no trainer. Stub delay {delay * 1000:g} ms. wrk, ramp"
            f" {RAMP_S:g} s + {window:g} s window per side, {rounds} alternating round(s), medians."
        )
        results = []
        for conns in (1, 16, 64):
            for stream in (False, True):
                run_id = f"cmp-{conns}-{int(stream)}"
                env = wrk_env(run_id, None, stream, auth)
                runs: dict[str, list[dict]] = {name: [] for name in sides}
                before, backlog = stub_count(own_url), 0
                for _ in range(rounds):  # alternate, so background load hits all three alike
                    for name, (url, count_url, ps) in sides.items():
                        runs[name].append(steady(url, script, conns, env, count_url, ps, window))
                        if name == "rlproxy":  # at the end of the window: is the writer keeping up?
                            backlog = max(backlog, write_backlog(proxy.url))
                forwarded = settled(own_url, before)
                rows = rows_for(tmp / "bench.db", run_id, forwarded)
                med = {name: median_of(r) for name, r in runs.items()}
                results.append((conns, stream, med, forwarded, rows, backlog))
        return print_compare(results)
    finally:
        if lite is not None:
            lite.stop()
        if proxy is not None:
            proxy.stop()
        for stub in stubs:
            stub.terminate()
            stub.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def median_of(runs: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in runs) for k in ("rps", "cpu_ms", "p50_ms", "p99_ms")}
    out["errors"] = sum(r["errors"] for r in runs)
    return out


def print_compare(results: list) -> int:
    """The table for bench/README.md, then the goals; returns the exit status."""
    failures: list[str] = []
    print(
        "\n| conc | stream | req/s direct | req/s rlproxy | req/s LiteLLM | **req/s rlproxy / LiteLLM**"
        " | added p50 ms rlproxy / LiteLLM | added p99 ms rlproxy / LiteLLM | CPU ms/req rlproxy / LiteLLM"
        " | rows stored / forwarded | writer backlog |"
    )
    print("|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for conns, stream, m, forwarded, rows, backlog in results:
        d, r, lt = m["direct"], m["rlproxy"], m["litellm"]
        ratio = r["rps"] / lt["rps"] if lt["rps"] else float("inf")
        add = {k: (r[k] - d[k], lt[k] - d[k]) for k in ("p50_ms", "p99_ms")}
        print(
            f"| {conns} | {'yes' if stream else 'no'} | {d['rps']:.0f} | {r['rps']:.0f} | {lt['rps']:.1f}"
            f" | **{ratio:.0f}x** | {add['p50_ms'][0]:.2f} / {add['p50_ms'][1]:.1f}"
            f" | {add['p99_ms'][0]:.2f} / {add['p99_ms'][1]:.1f} | {r['cpu_ms']:.2f} / {lt['cpu_ms']:.1f}"
            f" | {rows} / {forwarded} | {backlog} |"
        )
        tag = f"c={conns}{' stream' if stream else ''}"
        if conns == 64 and ratio < 10:
            failures.append(f"{tag} throughput {ratio:.1f}x < 10x")
        for k, (ours, theirs) in add.items():
            if ours >= theirs:
                failures.append(f"{tag} added {k[:3]} {ours:.2f} >= LiteLLM's {theirs:.2f}")
        if rows != forwarded or r["errors"]:
            failures.append(f"{tag} rows {rows} != forwarded {forwarded} (errors {r['errors']})")
        if lt["errors"]:
            failures.append(f"{tag} LiteLLM errors {lt['errors']}")
    print("\nRESULT:", "all goals met" if not failures else "missed: " + "; ".join(failures))
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description="proxy overhead benchmark")
    ap.add_argument("--quick", action="store_true", help="3 s per measurement instead of 10")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument(
        "--compare", choices=["litellm"], help="direct vs rlproxy vs LiteLLM's proxy (needs `make litellm`)"
    )
    ap.add_argument(
        "--route",
        choices=["all", "chat", "responses", "messages"],
        default="all",
        help="which proxy route the cases measure (the direct side is always the stub's chat route)",
    )
    ap.add_argument("--only", default="", help="only the cases whose name matches this regex")
    ap.add_argument("--turns", type=int, default=4, help="requests per run (tagged cases)")
    ap.add_argument("--reward-share", type=float, default=0.5, help="share of runs that get a reward, 0-1")
    ap.add_argument("--poll-interval", type=float, default=1.0, help="trainer poll period, seconds")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="the proxy's serving process (and the floor) on a core of its own, everything else on the"
        " others: the layout of a deployment, where the app and the model server are elsewhere",
    )
    ap.add_argument(
        "--keys",
        action="store_true",
        help="also run the tagged c=1 case through a second proxy whose store holds an app key, with"
        " that key's bearer (keys on), in the same rounds as the proxy without keys (keys off)",
    )
    ap.add_argument(
        "--otlp",
        action="store_true",
        help="also run the tagged c=1 case through a second proxy that exports every call live as an"
        " OTLP span to a local sink (otlp on), in the same rounds as the proxy without (otlp off)",
    )
    ap.add_argument("--poller", metavar="DB", help=argparse.SUPPRESS)  # the trainer-poll subprocess
    ap.add_argument("--delay-ms", type=float, default=0.0, help="--compare: the stub's delay per answer, ms")
    ap.add_argument(
        "--rounds", type=int, default=None, help="--compare: alternating rounds (1 quick, 2 full)"
    )
    args = ap.parse_args()
    if args.keys and args.otlp:
        ap.error("--keys and --otlp each run a second proxy: one at a time")
    if args.poller:
        return poll_store(args.poller, args.poll_interval)
    secs = args.seconds or (3.0 if args.quick else 10.0)
    if shutil.which("wrk") is None:
        print("bench/proxy.py needs wrk: apt-get install -y wrk", file=sys.stderr)
        return 2
    if args.compare == "litellm":
        window = args.seconds or (2.0 if args.quick else 4.0)
        return compare_litellm(window, args.rounds or (1 if args.quick else 2), args.delay_ms / 1000)
    return measure(secs, 3 if args.quick else 5, args)


# (name, concurrency, stub delay s, stream, proxy route, tagged + rewards, trainer poll)
CASES = [
    ("untagged c=1 delay=0", 1, 0.0, False, "chat", False, False),
    ("tagged c=1 delay=0", 1, 0.0, False, "chat", True, False),
    ("tagged c=1 delay=0 +poll", 1, 0.0, False, "chat", True, True),
    ("tagged c=64 delay=50ms", 64, 0.05, False, "chat", True, False),
    ("tagged c=64 delay=50ms stream", 64, 0.05, True, "chat", True, False),
    ("tagged c=64 delay=50ms +poll", 64, 0.05, False, "chat", True, True),
    ("responses: tagged c=1 delay=0", 1, 0.0, False, "responses", True, False),
    ("responses: tagged c=64 delay=50ms", 64, 0.05, False, "responses", True, False),
    ("responses: tagged c=64 delay=50ms stream", 64, 0.05, True, "responses", True, False),
    ("messages: tagged c=1 delay=0", 1, 0.0, False, "messages", True, False),
    ("messages: tagged c=64 delay=50ms stream", 64, 0.05, True, "messages", True, False),
]
KEYED = {"tagged c=1 delay=0"}  # the cases `--keys` also runs with an app key (issue 55's acceptance)
GOALS = {
    "add_p50_ms": 0.3,
    "add_p99_ms": 2.0,
    "lag_p99_ms": 1.0,
    "ratio": 0.95,
    "cpu_k": 0.35,
    "stream_x": 1.5,
    "keys_p50_ms": 0.05,  # --keys: |p50 keys on - p50 keys off| at c=1
    "otlp_p50_ms": 0.05,  # --otlp: |p50 export on - p50 export off| at c=1
}


def measure(secs: float, rounds: int, args: argparse.Namespace) -> int:
    """The cases above, each direct and through the proxy in alternating slices; prints the goals."""
    tmp = Path(tempfile.mkdtemp(prefix="rlproxy-bench-"))
    script = tmp / "post.lua"
    script.write_text(LUA)
    db_path = tmp / "bench.db"
    stub_port = free_port()
    stub_url = f"http://127.0.0.1:{stub_port}"
    stub = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "stub_upstream.py"), "--port", str(stub_port)],
        stdout=subprocess.DEVNULL,
    )
    proxy = rewarder = floor = keys = None
    failures: list[str] = []
    try:
        wait_http(f"{stub_url}/health")
        cases = [c for c in CASES if args.route in ("all", c[4]) and re.search(args.only, c[0])]
        proxy = Proxy(stub_url, db_path)
        floor = Floor(stub_url)
        rewarder = Rewarder(proxy.url, db_path, args.reward_share, args.turns)
        if (args.keys or args.otlp) and any(c[0] in KEYED for c in cases):
            sink = Sink() if args.otlp else None
            keys = KeysOn(
                stub_url, tmp / f"{'otlp' if sink else 'keys'}.db", args.reward_share, args.turns, sink
            )
        direct = f"{stub_url}/v1/chat/completions"
        via = {
            "chat": f"{proxy.url}/v1/chat/completions",
            "responses": f"{proxy.url}/v1/responses",
            "messages": f"{proxy.url}/v1/messages",
        }
        # warm up both paths (connection pools, code paths, SQLite file)
        wrk(direct, script, 4, 1, "", 0, False)
        wrk(f"{floor.url}/v1/chat/completions", script, 4, 1, "", 0, False)
        for route in via:
            wrk(via[route], script, 4, 1, "warmup", 0, False, route=route, turns=args.turns)
            wrk(via[route], script, 4, 1, "warmup-s", 0, True, route=route, turns=args.turns)
        if keys is not None:
            wrk(
                f"{keys.proxy.url}/v1/chat/completions",
                script,
                4,
                1,
                "warmup",
                0,
                False,
                keys.auth,
                turns=args.turns,
            )

        box = machine()  # before pinning this process to some of its cores
        layout = pin_layout(stub, proxy, floor, keys) if args.pin else "unpinned"
        load = os.getloadavg()
        print(
            f"# bench/proxy.py: {secs:g} s per measurement in {rounds} alternating direct/proxy rounds,"
            f" wrk, stub = plain asyncio, capture on (SQLite); tagged = a run id per {args.turns} requests,"
            f" rewards for {args.reward_share:g} of the runs while the load runs; +poll = the trainer's"
            f" poll query every {args.poll_interval:g} s; {box}; load {load[0]:.2f} {load[1]:.2f};"
            f" {layout}"
        )
        if keys is not None and keys.sink is not None:
            print(
                f"# --otlp: otlp on = a second `rlproxy serve` on the same stub exporting every call live"
                f" to an OTLP sink in this process ({keys.sink.url}); otlp off = the proxy above; both in"
                f" each round, their order swapped every round"
            )
        elif keys is not None:
            print(
                f"# --keys: keys on = a second `rlproxy serve` on the same stub whose store holds one app"
                f" key ({keys.key_id}, `rlproxy keys create`, no limits), sent as its bearer; keys off ="
                f" the proxy above, no key; both in each round, their order swapped every round"
            )
        time.sleep(1.5)  # no request for a while: the loop-lag sampler is at its idle pace
        idle = min(secs, 3.0)
        before = proxy.run_ns()
        time.sleep(idle)
        used = [(b - a) / idle / 1e6 for a, b in zip(before, proxy.run_ns(), strict=True)]
        print(f"# idle: serving process {used[0]:.1f} ms of CPU a second, writer {used[1]:.1f} ({idle:g} s)")
        total_req, total_cpu = 0, 0.0
        cpu_k: dict[str, float] = {}
        for i, (name, conns, delay, stream, route, tagged, poll) in enumerate(cases):
            # alternate direct and proxy slices so that background load hits both alike
            run_id = f"bench-{i}"
            ds, ps, fs = [], [], []
            forwarded, cpu, wcpu, fcpu, waited, span = 0, 0.0, 0.0, 0.0, 0.0, 0.0
            lag = {}
            poller = Poller(db_path, args.poll_interval) if poll else None
            rewarder.watch(run_id if tagged else None)
            turns = args.turns if tagged else 0
            on = keys is not None and name in KEYED
            if keys is not None:
                keys.start(run_id if on else None)
            keys_slice = (  # one keyed slice: keys_slice(its run id prefix)
                functools.partial(
                    keys.slice,
                    keys.proxy.url + via[route].removeprefix(proxy.url),
                    script,
                    conns,
                    secs / rounds,
                    delay=delay,
                    stream=stream,
                    route=route,
                    turns=turns,
                )
                if on
                else None
            )
            for r in range(rounds):
                ds.append(wrk(direct, script, conns, secs / rounds, "", delay, stream))
                if on and r % 2:  # keys on before keys off in odd rounds, after in even ones
                    keys_slice(f"{run_id}-{r}" if tagged else run_id)
                if route == "chat":  # the floor relays the same request (the stub's chat route)
                    before_fcpu = floor.cpu()
                    fs.append(
                        wrk(
                            f"{floor.url}/v1/chat/completions",
                            script,
                            conns,
                            secs / rounds,
                            "",
                            delay,
                            stream,
                        )
                    )
                    fcpu += floor.cpu() - before_fcpu
                before_stub, before_lag = stub_count(stub_url), loop_lag(proxy.url)
                before_cpu, before_wcpu = proxy.cpu(), proxy.writer_cpu()
                before_wait, before_t = proxy.waited(), time.monotonic()
                slice_id = (
                    f"{run_id}-{r}" if tagged else run_id
                )  # fresh runs per slice: a run is never reopened
                ps.append(
                    wrk(
                        via[route],
                        script,
                        conns,
                        secs / rounds,
                        slice_id,
                        delay,
                        stream,
                        route=route,
                        turns=turns,
                    )
                )
                # what the proxy accepted before wrk stopped still reaches the stub after it: count
                # until the stub's count stops moving (else it lands in the next direct slice)
                forwarded += settled(stub_url, before_stub, quiet_s=0.3)
                cpu += proxy.cpu() - before_cpu
                wcpu += proxy.writer_cpu() - before_wcpu
                waited += proxy.waited() - before_wait
                span += time.monotonic() - before_t
                after_lag = loop_lag(proxy.url)
                for le, n in after_lag.items():  # only the proxy slices' samples
                    lag[le] = lag.get(le, 0.0) + n - before_lag.get(le, 0.0)
                if on and not r % 2:
                    keys_slice(f"{run_id}-{r}" if tagged else run_id)
            codes, reward_s = rewarder.drain() if tagged else ({}, [])
            poll_line = poller.stop() if poller is not None else None
            d, p = combine(ds), combine(ps)
            rows = rows_for(db_path, run_id, forwarded, prefix=tagged)
            total_req += forwarded
            total_cpu += cpu
            lag50 = lag_quantile({}, lag, 0.5) * 1000
            lag99 = lag_quantile({}, lag, 0.99) * 1000
            print(f"\n## {name}")
            print(f"  direct : {d['rps']:8.0f} req/s  p50 {d['p50_ms']:.3f} ms  p99 {d['p99_ms']:.3f} ms")
            print(
                f"  proxy  : {p['rps']:8.0f} req/s  p50 {p['p50_ms']:.3f} ms  p99 {p['p99_ms']:.3f} ms"
                f"  (non-2xx {p['non2xx']}, socket errors {p['socket_errors']})"
            )
            if fs:
                f = combine(fs)
                print(
                    f"  floor  : {f['rps']:8.0f} req/s  p50 {f['p50_ms']:.3f} ms  p99 {f['p99_ms']:.3f} ms"
                    f"  {fcpu / max(f['requests'], 1) * 1000:.3f} CPU-s per 1,000"
                    " (bench/bare_relay.py: uvicorn + the same upstream client, nothing captured)"
                )
            print(
                f"  event-loop lag: p50 <= {lag50:g} ms, p99 <= {lag99:g} ms"
                f" (bucket bounds; {lag.get(float('inf'), 0):.0f} samples); the serving thread waited"
                f" for a core {waited / max(span, 1e-9) * 1000:.1f} ms per s (run queue)"
            )
            if conns == 1:
                add50, add99 = p["p50_ms"] - d["p50_ms"], p["p99_ms"] - d["p99_ms"]
                ok = (
                    add50 <= GOALS["add_p50_ms"]
                    and add99 <= GOALS["add_p99_ms"]
                    and lag99 <= GOALS["lag_p99_ms"]
                )
                print(
                    f"  added latency: p50 {add50:.3f} ms (goal <= {GOALS['add_p50_ms']}), p99 {add99:.3f} ms"
                    f" (goal <= {GOALS['add_p99_ms']}), loop lag p99 goal <= {GOALS['lag_p99_ms']} ms"
                    f"  {'OK' if ok else 'MISSED'}"
                )
                if fs:
                    print(
                        f"  added by the floor: p50 {f['p50_ms'] - d['p50_ms']:.3f} ms,"
                        f" p99 {f['p99_ms'] - d['p99_ms']:.3f} ms; rlproxy over the floor:"
                        f" p50 {p['p50_ms'] - f['p50_ms']:.3f} ms, p99 {p['p99_ms'] - f['p99_ms']:.3f} ms"
                    )
                if not ok and tagged:
                    failures.append(name)
            else:
                ratio = p["rps"] / d["rps"]
                ok = ratio >= GOALS["ratio"]
                print(
                    f"  throughput proxy/direct: {ratio:.3f} (goal >= {GOALS['ratio']})"
                    f"  {'OK' if ok else 'MISSED'}"
                    + (f"; floor/direct {f['rps'] / d['rps']:.3f}" if fs else "")
                )
                if not ok:
                    failures.append(name)
            per_k = cpu_k[name] = cpu / max(forwarded, 1) * 1000
            print(
                f"  proxy CPU: {cpu:.2f} s for {forwarded} requests = {per_k:.3f} CPU-s per 1,000 requests"
                f" (serving process {(cpu - wcpu) / max(forwarded, 1) * 1000:.3f},"
                f" writer process {wcpu / max(forwarded, 1) * 1000:.3f})"
            )
            if tagged:
                ok200 = codes.get(200, 0)
                reward_p99 = (
                    sorted(reward_s)[int(0.99 * (len(reward_s) - 1))] * 1000 if reward_s else float("nan")
                )
                print(f"  rewards posted {sum(codes.values())}: {codes} (p99 {reward_p99:.1f} ms)")
                if ok200 != sum(codes.values()) or not ok200:
                    failures.append(name + " rewards")
            if poll_line:
                print(f"  {poll_line}")
            same = rows == forwarded and p["non2xx"] == 0
            print(
                f"  rows stored {rows} == requests forwarded {forwarded} (wrk completed {p['requests']}):"
                f" {'OK' if same else 'MISMATCH'}"
            )
            if not same:
                failures.append(name + " rows")
            if on:
                failures += keys_on(keys, name, run_id, d, p, tagged)
        print(f"\n## overall proxy CPU: {total_cpu / max(total_req, 1) * 1000:.3f} CPU-s per 1,000 requests")
        base = cpu_k.get("tagged c=64 delay=50ms")
        if base is not None:
            ok = base <= GOALS["cpu_k"]
            print(
                f"  tagged chat non-stream: {base:.3f} CPU-s per 1,000 (goal <= {GOALS['cpu_k']})"
                f" {'OK' if ok else 'MISSED'}"
            )
            if not ok:
                failures.append("cpu per 1,000")
            for name in ("tagged c=64 delay=50ms stream", "responses: tagged c=64 delay=50ms stream"):
                if name in cpu_k:
                    x = cpu_k[name] / base
                    ok = x <= GOALS["stream_x"]
                    print(
                        f"  {name}: {x:.2f}x non-stream CPU (goal <= {GOALS['stream_x']})"
                        f" {'OK' if ok else 'MISSED'}"
                    )
                    if not ok:
                        failures.append(name + " cpu")
        print("RESULT:", "all goals met" if not failures else "missed: " + ", ".join(failures))
        return 1 if failures else 0
    finally:
        if rewarder is not None:
            rewarder.close()
        if keys is not None:
            keys.close()
        if proxy is not None:
            proxy.stop()
        if floor is not None:
            floor.stop()
        stub.terminate()
        stub.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
