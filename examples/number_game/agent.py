"""The demo's agent, as a script: a two-turn agent on the plain OpenAI SDK that rlproxy improves as it runs.

Its code lives in the package, `rlproxy/demo/number_game.py` (the task, the reward and the agent),
so that `rlproxy demo` works from a plain `pip install rlproxy`; read it there.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python examples/number_game/agent.py --groups 20
"""

from __future__ import annotations

import sys

from rlproxy.demo.number_game import main

if __name__ == "__main__":
    sys.exit(main())
