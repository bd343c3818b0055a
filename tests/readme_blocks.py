"""The README's fenced code blocks and the tag before each one that says how the tests run it.

Every fenced block in README.md and in docs/**/*.md is preceded (on its own line, blank lines
allowed) by a comment that GitHub does not render:

    <!-- test: python setups=open,key -->     run with .venv's python in each setup
    <!-- test: bash setups=path,path-key -->  run with `bash -e` in each setup
    <!-- test: node setups=open,key -->       run as an ES module with `node`
    <!-- test: sql -->                        run with the sqlite3 program on a short real run's database
    <!-- test: shell setups=db -->            run with `bash -e` in a folder holding that `rlproxy.db`
    <!-- test: cli -->                        not run: each `rlproxy ...` line's options must be in its --help
    <!-- test: skip: REASON -->               not run, and REASON says why (a diagram, a GPU box)

Setups (tests/test_readme.py): `open` (no key; `OPENAI_BASE_URL=http://127.0.0.1:PORT/v1`), `key`
(the proxy started with an agents' key, `OPENAI_API_KEY` set to it), `path` and `path-key` (the same
with `OPENAI_BASE_URL=http://127.0.0.1:PORT/runs/ep-1/v1`), `db` (no proxy: a working folder whose
`rlproxy.db` holds a short real run), `hosted` (docs/hosted.md: the proxy with a `teacher` policy
on a hosted-provider stand-in, `gpt-4o-mini` mapped to it). An untagged block, an unknown kind or
setup, or a skip without a reason fails the test, so a new block is either run or explicitly excused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

KINDS = {"python", "bash", "node", "sql", "shell", "cli", "skip"}
SETUPS = {"open", "key", "path", "path-key", "db", "hosted"}
NEEDS_SETUPS = {"python", "bash", "node", "shell"}

_TAG = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(```+)\s*([\w+-]*)")


@dataclass
class Block:
    """One fenced block: where it starts (1-based line of the fence), its code, and its tag."""

    line: int
    lang: str
    code: str
    tag: str | None  # the tag's text, None when the block has none
    heading: str  # the nearest heading above it
    kind: str = ""
    setups: tuple[str, ...] = ()
    reason: str = ""
    problems: list[str] = field(default_factory=list)
    file: str = "README.md"  # the Markdown file it is in, relative to the repository root

    @property
    def name(self) -> str:
        return f"{self.file}:{self.line} ({self.heading})"


def _parse_tag(block: Block) -> None:
    if block.tag is None:
        block.problems.append(
            "no `<!-- test: KIND ... -->` line before it: tag it to run it, or `<!-- test: skip: why -->`"
        )
        return
    kind, _, rest = block.tag.partition(" ")
    if kind.endswith(":"):
        kind, rest = kind[:-1], rest
    block.kind = kind
    if kind not in KINDS:
        block.problems.append(f"unknown kind {kind!r} (one of {sorted(KINDS)})")
        return
    if kind == "skip":
        block.reason = rest.strip()
        if len(block.reason) < 10:
            block.problems.append("a skipped block needs a reason: `<!-- test: skip: why it cannot run -->`")
        return
    opts = dict(part.split("=", 1) for part in rest.split() if "=" in part)
    unknown = set(opts) - {"setups"}
    if unknown or any("=" not in part for part in rest.split()):
        block.problems.append(f"unknown options in tag {block.tag!r} (only setups=a,b)")
    block.setups = tuple(s for s in opts.get("setups", "").split(",") if s)
    if kind in NEEDS_SETUPS and not block.setups:
        block.problems.append(f"a {kind} block names its setups: setups=open,key,...")
    bad = set(block.setups) - SETUPS
    if bad:
        block.problems.append(f"unknown setups {sorted(bad)} (known: {sorted(SETUPS)})")


def blocks(text: str, file: str = "README.md") -> list[Block]:
    """Every fenced block of `text` (the Markdown file `file`) with its tag parsed."""
    lines = text.splitlines()
    out: list[Block] = []
    heading = "top"
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        fence = _FENCE.match(line)
        if not fence:
            i += 1
            continue
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        tag = _TAG.match(lines[j]) if j >= 0 else None
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence.group(1)):
            end += 1
        block = Block(
            line=i + 1,
            lang=fence.group(2),
            code="\n".join(lines[i + 1 : end]) + "\n",
            tag=tag.group(1) if tag else None,
            heading=heading,
            file=file,
        )
        _parse_tag(block)
        out.append(block)
        i = end + 1
    return out


def cli_lines(code: str) -> list[tuple[list[str], list[str]]]:
    """(command words, options) of each `rlproxy CMD [SUB]` in a synopsis or shell block.

    Backslash continuations are joined, and in a synopsis an indented line without `rlproxy`
    continues the command above it; ` | `, `#` and the next `rlproxy` end a command (a `|` without
    spaces is a synopsis' alternative, `embedded|vllm`); `[--a/--b]` names two options.
    """
    found: list[tuple[list[str], list[str]]] = []
    cmd = re.compile(r"(?:^|[\s/(])rlproxy((?:\s+[a-z][a-z0-9-]*)+)(.*?)(?=\s\|\s|#|\brlproxy\s|$)")
    for line in code.replace("\\\n", " ").splitlines():
        matches = list(cmd.finditer(line))
        if not matches and found and line[:1].isspace():
            found[-1][1].extend(_options(line.split("#", 1)[0]))
        for m in matches:
            found.append((m.group(1).split(), _options(m.group(2))))
    return found


def _options(text: str) -> list[str]:
    return re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text)
