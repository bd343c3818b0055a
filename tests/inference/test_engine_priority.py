"""Issue 54: the embedded engine admits waiting requests lowest `priority` first, FIFO within one.

An app request (priority 0) that arrives after the proxy's sibling requests (priority 10) while the
batch is full is admitted first; before the change the engine admitted strictly in arrival order.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from rlproxy.inference.protocol import ChatBody, CompletionBody


def test_app_request_queued_after_siblings_is_admitted_first(tiny_model_dir: Path) -> None:
    from rlproxy.inference.engine import Engine, GenRequest, RowDelta
    from rlproxy.inference.sampling import SamplingParams

    engine = Engine(str(tiny_model_dir), threads=1, max_batch=1)
    engine.start()
    started: list[str] = []  # request ids in the order their first token came: admission order
    done = threading.Semaphore(0)
    lock = threading.Lock()

    def sink_for(rid: str) -> Any:
        def sink(d: RowDelta) -> None:
            with lock:
                if rid not in started:
                    started.append(rid)
            if d.finish_reason is not None:
                done.release()

        return sink

    try:
        prompt = engine.tokenizer.encode("hello there")
        long = SamplingParams(max_tokens=24, ignore_eos=True, seed=0)
        short = SamplingParams(max_tokens=2, ignore_eos=True, seed=0)
        engine.submit(GenRequest("busy", prompt, long, sink_for("busy")))  # fills the one row
        for i in range(3):
            engine.submit(GenRequest(f"sib{i}", prompt, short, sink_for(f"sib{i}"), priority=10))
        engine.submit(GenRequest("app", prompt, short, sink_for("app"), priority=0))
        engine.submit(GenRequest("app2", prompt, short, sink_for("app2"), priority=0))
        for _ in range(6):
            assert done.acquire(timeout=120)
        assert started == ["busy", "app", "app2", "sib0", "sib1", "sib2"]
    finally:
        engine.close()


def test_bodies_carry_priority() -> None:
    body = CompletionBody(prompt=[1, 2, 3], priority=10)
    assert body.priority == 10
    assert ChatBody(messages=[{"role": "user", "content": "hi"}]).priority == 0
