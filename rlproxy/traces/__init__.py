"""Traces in and out: other tools' traces imported as runs (`imports.py`, `readers/`), ours exported
as OpenTelemetry GenAI spans (`export*.py`). `genai.py` names the attributes both sides read and write."""
