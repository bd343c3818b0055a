"""The writer process: the SQL of `storage/writer.py`, run in a process of its own.

Started by the proxy (`storage/writer_link.py` says why and what travels), as
`python -m rlproxy.storage.writer_process FD`, FD one end of a socketpair. It runs the writer's
batch loop (`runner.LoopRunner`: batches, one transaction each, retries and splits) on operations
that arrive as messages, and sends its reports back. Its signals are ignored (a Ctrl-C or a
SIGTERM to the process group reaches the proxy, which drains this process through a stop message);
the end of the socket ends it at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys

from rlproxy.storage.db import create_engine, writer_engine
from rlproxy.storage.journal import decode
from rlproxy.storage.runner import Flush, Item, LoopRunner, Op, Reward, Stop
from rlproxy.storage.writer_link import Framed, dump_error, encode_outcome

log = logging.getLogger("rlproxy.storage.writer")


def _op(msg: tuple) -> Op:
    """One operation from the proxy (writer_link.py's wire), as the proxy's writer queued it."""
    kind, key = msg[0], msg[1]
    op: Op
    if kind == "I":
        op = Item(decode(msg[2]), len(msg[2]), None, msg[3])
    elif kind == "R":  # its future is never resolved here: the outcome travels in the report
        op = Reward(*msg[2:6], asyncio.get_running_loop().create_future(), msg[6], msg[7], deadline=msg[8])
    elif kind == "F":
        op = Flush(asyncio.get_running_loop().create_future())
    else:
        op = Stop(msg[2])
    op.key = key
    return op


def _keyed(msg: tuple) -> tuple:
    """A report of the runner with keys for its operations (writer_link.py's wire)."""
    if msg[0] == "settle":
        pairs = [(op.key, encode_outcome(o)) for op, o in zip(msg[1], msg[2], strict=True)]
        return ("settle", pairs, msg[-1])
    if msg[0] == "give_up":
        return ("give_up", [op.key for op in msg[1]], dump_error(msg[2]), msg[3], msg[-1])
    return msg


def _idle_priority() -> None:
    """Run at the scheduler's idle priority (settings.writer_idle_priority).

    Why: on a box whose cores are all taken for a moment, a request's next process (the upstream, the
    client, the proxy itself) woken onto the core running a batch waited for the scheduler's wakeup
    granularity (~2 ms on 2 cores) behind this process's SQL. A SCHED_IDLE process yields at once, and
    its core counts as free when the scheduler places a woken task. The cost: it runs only on spare
    CPU. If it starves, the proxy raises it to the normal priority for a while, or, without
    CAP_SYS_NICE (which leaving SCHED_IDLE needs), replaces it with one started there
    (`writer_link.ProcessRunner._watch_priority`).
    """
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:  # not Linux, or refused: the normal priority then
        log.warning("writer process: idle priority not available (%s); running at normal priority", exc)


async def _serve(fd: int) -> None:
    loop = asyncio.get_running_loop()
    runner: LoopRunner | None = None
    started = loop.create_future()

    def on_message(msg: tuple) -> None:
        nonlocal runner
        if runner is not None:
            try:
                runner.put(_op(msg))
            except Exception as exc:  # never the link's end: that one operation is given up
                log.exception("writer process: operation %r could not be queued", msg[:2])
                link.send(("give_up", [msg[1]], dump_error(exc), False, runner.stats()))
            return
        config = msg[1]  # the first message: ("config", {...})
        logging.basicConfig(
            level=config.get("log_level", logging.WARNING),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        if config.get("idle_priority"):
            _idle_priority()
        engine = create_engine(config["url"], busy_timeout_ms=config["busy_timeout_ms"])
        db = writer_engine(engine)
        runner = LoopRunner(db, config["flush_interval"], config["max_batch"])
        started.set_result((runner, db, engine))

    def on_lost(exc: Exception | None) -> None:
        if runner is None or runner.task is None or not runner.task.done():
            os._exit(0)  # the proxy is gone: what was not committed is in its journal (module doc)

    link = Framed(on_message, on_lost)
    await loop.create_unix_connection(lambda: link, sock=socket.socket(fileno=fd))
    writer, db, engine = await started
    await writer.start(lambda msg: link.send(_keyed(msg)))
    # What exists now (modules, SQLAlchemy's tables and dialect) lives as long as the process: out
    # of the collector's sight, a full collection walks only the batches' objects (it walked all of
    # it: ~40 ms per generation-2 pass, a tenth of this process's CPU under bench/proxy.py's load;
    # ~12 ms frozen)
    gc.collect()
    gc.freeze()
    try:
        await writer.join()
    finally:
        await db.dispose()
        await engine.dispose()
    await asyncio.sleep(0)  # the last message is written on the next loop iteration
    if link.transport is not None:
        link.transport.close()  # after what is buffered is written


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    asyncio.run(_serve(int(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
