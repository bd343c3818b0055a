"""The wire format: translation between the client's API (the Responses API, Anthropic's Messages API)
and the upstream's chat completions, as pure functions, in one room. Imports nothing of ours.

    responses.py   Responses request -> chat body; chat answer/chunks -> Responses object/events
    messages.py    Anthropic Messages request -> chat body; Anthropic's error shape
    message_events.py  chat answer/chunks -> `message` object / Messages events

Read by the proxy (each API's row in `proxy/apis.py`), the embedded engine (which serves the same
two APIs as vLLM does, `inference/server.py`) and the scorers.
"""
