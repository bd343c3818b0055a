"""Traces in and out: rlproxy's calls as OpenTelemetry GenAI spans (`otlp_*.py`: live export to an
OTLP endpoint and `rlproxy export --format otlp`), and other tools' traces as runs (`rlproxy import`).

Everything here imports the OTLP proto classes (the `traces` extra) and is imported only where the
feature is used, so the rest of rlproxy runs without them.
"""
