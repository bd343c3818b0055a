"""`python -m rlproxy.cli ...` is `rlproxy ...`."""

from rlproxy.cli.main import app

app()
