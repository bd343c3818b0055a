"""Errors map themselves: the handler reads each class's status, type and code."""

from __future__ import annotations

import orjson
import pytest

from rlproxy.errors import BackendTimeout, BackendUnavailable, ConfigError, RLProxyError
from rlproxy.proxy.errors import public_message, render
from rlproxy.storage.errors import RewardConflict, RunNotFound, StoreUnavailable


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code"),
    [
        (BackendUnavailable("down"), 502, "server_error", "upstream_unavailable"),
        (BackendTimeout("slow"), 504, "server_error", "upstream_timeout"),
        (RunNotFound("r1"), 404, "invalid_request_error", "not_found"),
        (RewardConflict("r1", 1.0, 0.0), 409, "invalid_request_error", "conflict"),
        (StoreUnavailable("busy", retry_after=2.5), 503, "server_error", "store_unavailable"),
    ],
)
def test_each_class_says_its_status_and_code(exc, status, type_, code):
    response = render(exc)
    error = orjson.loads(response.body)["error"]
    assert (response.status_code, error["type"], error["code"]) == (status, type_, code)
    assert error["message"] == public_message(exc)
    if status in (502, 504):  # about the model server: its own words never reach the client (issue 22)
        assert str(exc) not in error["message"]
    else:
        assert error["message"] == str(exc)


def test_retry_after_is_rounded_up():
    assert render(StoreUnavailable("busy", retry_after=2.5)).headers["retry-after"] == "3"


def test_a_new_class_needs_no_handler_change():
    class Teapot(RLProxyError):
        status, type, code = 418, "invalid_request_error", "teapot"

    response = render(Teapot("short and stout"))
    assert response.status_code == 418 and orjson.loads(response.body)["error"]["code"] == "teapot"


def test_anything_else_of_ours_is_a_500_that_says_nothing():
    response = render(ConfigError("secret detail"))
    error = orjson.loads(response.body)["error"]
    assert response.status_code == 500 and error["code"] == "internal_error"
    assert "secret" not in error["message"]
