"""Where the serving process's CPU goes, measured inside it under the load users make.

End to end, a figure on a small shared box moves 20-40% within the hour, and a profiler's
overhead inflates small functions several times. This measures the serving thread's own CPU time
(`time.thread_time_ns`) around named synchronous functions of `rlproxy serve` while bench/proxy.py's
tagged load runs (wrk at concurrency 1, an instant stub upstream, a run id per `--turns`
requests, rewards posted for half of the runs): per request, each function's CPU and calls, next to
the serving thread's whole CPU. Repeated slices of the same function agree within a few percent
here, so a change to one function can be judged by its own figure, in the process that runs it.

How: `rlproxy serve` starts with a `sitecustomize` (in a temporary folder on its PYTHONPATH) that
wraps the functions named by `--fn` (or the route's defaults below) before the command line
imports them; SIGUSR1 starts a slice, SIGUSR2 ends it and writes the sums to a file. A wrapped call
costs the clock reads around it (printed as "wrapper"): a function's figure includes the wrappers
of the functions it calls. A coroutine function's figure is its steps' (from each resumption to
the next suspension, what it awaits on the network excluded, what runs inside it included).

    python bench/where.py                            # chat, non-streaming
    python bench/where.py --stream --route responses
    python bench/where.py --fn rlproxy.proxy.capture:shape_problem --fn rlproxy.storage.writer:encode
"""

from __future__ import annotations

import argparse
import asyncio
import collections.abc
import functools
import importlib
import inspect
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# what a request runs, synchronously, outside the server stack (every figure includes the functions
# it calls: `_answer` holds the capture, `submit` and `observe`)
DEFAULTS = [
    "rlproxy.proxy.server:LimitedHttpToolsProtocol.data_received",  # the request's head and body
    "rlproxy.proxy.validate:parse_body",
    "rlproxy.proxy.validate:check",
    "rlproxy.proxy.runstate:RunState.admit",
    "rlproxy.proxy.policies:Policies.resolve",
    "rlproxy.proxy.forward:request_headers",
    "rlproxy.proxy.http11:_Connection.data_received",  # the upstream's answer
]
NON_STREAM = [
    "rlproxy.proxy.routes_openai:_answer",
    "rlproxy.proxy.capture:shape_problem",
    "rlproxy.proxy.capture:from_response",
    "rlproxy.storage.writer:Writer.submit",
    "rlproxy.proxy.metrics:Metrics.observe",
]
STREAM = [
    "rlproxy.proxy.stream:StreamRelay._event",
    "rlproxy.proxy.capture:StreamAssembler.feed",
    "rlproxy.proxy.stream:StreamRelay._report",
    "rlproxy.storage.writer:Writer.submit",
]
ROUTE = {
    "chat": [],
    "responses": ["rlproxy.proxy.responses:Call.answer", "rlproxy.proxy.stream:EventStream.chunk"],
    "messages": [
        "rlproxy.proxy.messages:prepare",
        "rlproxy.proxy.messages:Call.answer",
        "rlproxy.proxy.stream:EventStream.chunk",
    ],
}


# ---- inside `rlproxy serve` (imported by the generated sitecustomize) ----


def install(specs: list[str], out: str) -> None:
    """Wrap each `module:Qual.name` of `specs`; SIGUSR1 zeroes and starts, SIGUSR2 stops and writes `out`."""
    clock = time.thread_time_ns
    sums: dict[str, list[int]] = {}
    on = [False]

    def wrap(spec: str) -> None:
        module, _, qual = spec.partition(":")
        owner = importlib.import_module(module)
        *path, name = qual.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, name)
        acc = sums[spec] = [0, 0]
        if inspect.iscoroutinefunction(fn):  # each of its steps timed, its awaits not

            @functools.wraps(fn)
            def timed_coro(*args, **kwargs):
                coro = fn(*args, **kwargs)
                return _Timed(coro, acc, clock) if on[0] else coro

            # still a coroutine function to whoever asks asyncio (uvicorn tells ASGI 3 apps by it)
            timed_coro._is_coroutine = asyncio.coroutines._is_coroutine  # type: ignore[attr-defined]
            setattr(owner, name, timed_coro)
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not on[0]:
                return fn(*args, **kwargs)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[0] += clock() - t0
                acc[1] += 1

        setattr(owner, name, timed)

    for spec in specs:
        wrap(spec)
    started = [0]

    def start(*_: object) -> None:
        for acc in sums.values():
            acc[0] = acc[1] = 0
        started[0] = clock()
        on[0] = True

    def stop(*_: object) -> None:
        on[0] = False
        Path(out).write_text(json.dumps({"thread_ns": clock() - started[0], "sums": sums}))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


class _Timed(collections.abc.Coroutine):
    """A coroutine whose every step (from a resumption to its next suspension) is timed: its
    time on the thread, its awaits excluded; counted once, when it ends."""

    __slots__ = ("coro", "acc", "clock", "ns")

    def __init__(self, coro, acc: list[int], clock) -> None:
        self.coro, self.acc, self.clock, self.ns = coro, acc, clock, 0

    def __await__(self):
        return self

    def __iter__(self):
        return self

    def __next__(self):
        return self.send(None)

    def _step(self, call, *args):
        t0 = self.clock()
        try:
            return call(*args)
        except BaseException:  # StopIteration too: the coroutine ended
            self.acc[0] += self.ns + self.clock() - t0
            self.acc[1] += 1
            raise
        finally:
            self.ns += self.clock() - t0

    def send(self, value):
        return self._step(self.coro.send, value)

    def throw(self, *exc):
        return self._step(self.coro.throw, *exc)

    def close(self):
        return self.coro.close()


def wrapper_cost_ns() -> float:
    """What one wrapped call adds: the two clock reads and the wrapper's own Python (best of 5)."""
    clock = time.thread_time_ns
    acc = [0, 0]

    def f() -> None:
        return None

    def timed() -> None:
        t0 = clock()
        try:
            return f()
        finally:
            acc[0] += clock() - t0
            acc[1] += 1

    best = float("inf")
    for _ in range(5):
        t0 = clock()
        for _ in range(20_000):
            timed()
        bare = clock()
        for _ in range(20_000):
            f()
        best = min(best, ((bare - t0) - (clock() - bare)) / 20_000)
    return best


SITECUSTOMIZE = """\
import os, sys
if os.environ.get("WHERE_FNS") and "serve" in sys.argv:
    sys.path.insert(0, {here!r})
    import where
    where.install(os.environ["WHERE_FNS"].split(","), os.environ["WHERE_OUT"])
"""


# ---- the bench ----


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--route", choices=sorted(ROUTE), default="chat")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument(
        "--fn", action="append", default=[], help="module:Qual.name (repeatable; replaces the defaults)"
    )
    ap.add_argument("--seconds", type=float, default=5.0, help="per slice")
    ap.add_argument("--rounds", type=int, default=3, help="slices")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--conns", type=int, default=1, help="wrk's connections (concurrency)")
    ap.add_argument(
        "--delay-ms", type=float, default=0.0, help="the stub's answer time (a stream spreads it)"
    )
    ap.add_argument("--reward-share", type=float, default=0.5)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import proxy as bench  # bench/proxy.py: the stub, `serve`, wrk and the rewarder

    specs = args.fn or DEFAULTS + (STREAM if args.stream else NON_STREAM) + ROUTE[args.route]
    tmp = Path(tempfile.mkdtemp(prefix="rlproxy-where-"))
    (tmp / "sitecustomize.py").write_text(SITECUSTOMIZE.format(here=str(HERE)))
    script = tmp / "post.lua"
    script.write_text(bench.LUA)
    port = bench.free_port()
    stub_url = f"http://127.0.0.1:{port}"
    stub = subprocess.Popen(
        [sys.executable, str(bench.ROOT / "tests" / "stub_upstream.py"), "--port", str(port)],
        stdout=subprocess.DEVNULL,
    )
    out = tmp / "sums.json"
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "WHERE_FNS", "WHERE_OUT")}
    os.environ.update(PYTHONPATH=str(tmp), WHERE_FNS=",".join(specs), WHERE_OUT=str(out))
    px = rewarder = None
    try:
        bench.wait_http(f"{stub_url}/health")
        px = bench.Proxy(stub_url + "/v1", tmp / "store.db")
        for k, v in saved.items():  # the rest of this run (wrk, the rewarder) without the hook
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        rewarder = bench.Rewarder(px.url, tmp / "store.db", args.reward_share, args.turns)
        path = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
        url = px.url + path[args.route]
        delay = args.delay_ms / 1000
        bench.wrk(url, script, args.conns, 2, "warm", delay, args.stream, route=args.route, turns=args.turns)
        slices = []
        for r in range(args.rounds):
            out.unlink(missing_ok=True)
            rewarder.watch(f"w{r}")
            os.kill(px.proc.pid, signal.SIGUSR1)
            cpu0 = px.serving_cpu()
            w = bench.wrk(
                url,
                script,
                args.conns,
                args.seconds,
                f"w{r}",
                delay,
                args.stream,
                route=args.route,
                turns=args.turns,
            )
            os.kill(px.proc.pid, signal.SIGUSR2)
            cpu = px.serving_cpu() - cpu0
            for _ in range(50):
                if out.exists():
                    break
                time.sleep(0.1)
            slices.append((w["requests"], cpu, json.loads(out.read_text())))
        codes, _ = rewarder.drain(1.0)
    finally:
        if rewarder is not None:
            rewarder.close()
        if px is not None:
            px.stop()
        stub.terminate()
        shutil.rmtree(tmp, ignore_errors=True)

    mode = "stream" if args.stream else "non-stream"
    print(
        f"# bench/where.py: {args.route} {mode}, tagged (a run id per {args.turns} requests),"
        f" c={args.conns}, stub delay {args.delay_ms:g} ms, rewards for {args.reward_share:g} of the runs"
        f" ({sum(codes.values())} posted, status {codes}); {args.rounds} slices of {args.seconds:g} s;"
        f" {bench.machine()}"
    )
    print(f"# a wrapped call adds ~{wrapper_cost_ns() / 1000:.2f} us (measured here), counted in its callers")
    thread = [s[2]["thread_ns"] / s[0] / 1000 for s in slices]
    proc = [s[1] / s[0] * 1e6 for s in slices]
    print(f"{'serving thread, us per request':58} " + "  ".join(f"{x:7.1f}" for x in thread))
    print(f"{'serving process (all threads), us per request':58} " + "  ".join(f"{x:7.1f}" for x in proc))
    print(f"{'function: us per request (calls per request), each slice':58}")
    for spec in specs:
        cells = []
        for n, _, data in slices:
            ns, calls = data["sums"][spec]
            cells.append(f"{ns / n / 1000:7.1f} ({calls / n:5.2f})")
        med = statistics.median(data["sums"][spec][0] / n / 1000 for n, _, data in slices)
        share = med / statistics.median(thread)
        print(f"  {spec.split('.', 1)[1]:56} " + "  ".join(cells) + f"   {share:6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
