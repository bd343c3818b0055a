"""The directory agent as a script: a tool-using agent on the plain OpenAI SDK that rlproxy improves.

Its code lives in the package, `rlproxy/demo/directory.py` (the tool, the agent loop and the reward),
so that `rlproxy demo --task directory` works from a plain `pip install rlproxy`; read it there.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python examples/directory/agent.py --groups 20
"""

from __future__ import annotations

import sys

from rlproxy.demo.directory import main

if __name__ == "__main__":
    sys.exit(main())
