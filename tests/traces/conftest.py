"""Traces fixtures: the proxy tests' proxy factory (as tests/cli/conftest.py shares it) and an OTLP
receiver on loopback that decodes what it is sent with opentelemetry-proto's own classes."""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

PROXY_TESTS = Path(__file__).resolve().parents[1] / "proxy"
sys.path.insert(0, str(PROXY_TESTS))  # proxy_helpers, imported by the proxy conftest
_spec = importlib.util.spec_from_file_location("proxy_conftest", PROXY_TESTS / "conftest.py")
assert _spec is not None and _spec.loader is not None
_proxy_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_proxy_conftest)
make_proxy = _proxy_conftest.make_proxy


class Receiver:
    """An OTLP/HTTP traces endpoint: every POST's body decoded as an ExportTraceServiceRequest, its
    spans in `.spans`; `gate` (set) holds each answer until the test opens it."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list[Any] = []
        self.paths: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.gate = threading.Event()
        self.gate.set()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.gate.wait(60)
                request = ExportTraceServiceRequest.FromString(body)
                receiver.paths.append(self.path)
                receiver.headers.append(dict(self.headers))
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        receiver.spans.extend(ss.spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.gate.set()
    r.server.shutdown()
