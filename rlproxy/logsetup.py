"""Clean logs for the long-running commands: rlproxy's own lines, third-party noise at WARNING.

What filled `serve.log` before: Alembic's INFO lines on every start (plugin setup, one line per
revision), transformers' `Loading weights` progress bars (carriage returns in a log file), and
FutureWarnings about transformers' own deprecations (with the source line under each). Users can
act on none of them. With `--log-level debug` they all come back.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# Libraries whose INFO is about themselves, not about the user's proxy or training.
NOISY_LOGGERS: tuple[str, ...] = (
    "alembic",
    "httpx",  # one line per adapter/health call
    "httpcore",
    "transformers",
    "peft",
    "huggingface_hub",
    "filelock",
    "urllib3",
)


def quiet_third_party(level: str) -> None:
    """Third-party loggers at WARNING, progress bars off, FutureWarnings silenced, other warnings logged.

    Call it right after `logging.basicConfig`. At `debug` only the warnings' routing changes.
    """
    debug = level.lower() == "debug"
    if not debug:
        for name in NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        # read when transformers / huggingface_hub / tqdm are imported, and inherited by a launched vLLM
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")
        if "transformers" in sys.modules:  # imported already: its switch is set at import time
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        # libraries' notes to their own developers (`X is deprecated ... in v6`)
        warnings.filterwarnings("ignore", category=FutureWarning)
    # any other warning: one WARNING log line through `py.warnings`, not raw stderr text
    logging.captureWarnings(True)
