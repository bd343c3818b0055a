"""How the CLI prints what the store returns: tables, psql-style records, CSV, JSON lines, a run's
conversation and the training steps. Formatting only: the queries are in `rlproxy/storage/`.

Numbers print as sqlite3's shell prints them (15 significant digits, `1.0` not `1`), so
`rlproxy sql` and `sqlite3 rlproxy.db` agree; JSON output keeps every digit.
"""

from __future__ import annotations

import csv
import math
import re
import sys
from collections.abc import Sequence
from typing import Any

import orjson
import typer

CUT = 60  # table cells longer than this are cut (the vertical and wide modes never cut)

# C0 controls but newline and tab, DEL, and C1 controls: a stored message holding ESC sequences could
# clear the operator's screen, forge lines, set the title or write the clipboard (OSC 52).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def safe(text: str) -> str:
    """`text` for a terminal: every control character but newline and tab shown as `\\xNN`.

    The human formats (tables, `--vertical`, `runs show`) print through it; `--json` and `--csv`
    are data for programs and stay raw.
    """
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def sqlite_float(v: float) -> str:
    """`v` as sqlite3's shell prints a REAL (printf `%!.15g`): 0.325, 1.0, 1.0e+20, Inf."""
    if math.isnan(v):
        return ""  # SQLite stores NaN as NULL
    if math.isinf(v):
        return "Inf" if v > 0 else "-Inf"
    if v == 0:
        return "0.0"
    s = format(v, ".15g")
    if "e" in s:
        mantissa, exp = s.split("e")
        return f"{mantissa if '.' in mantissa else mantissa + '.0'}e{exp}"
    return s if "." in s else s + ".0"


def cell(v: Any) -> str:
    """One value as text: NULL empty, floats like sqlite3, JSON values compact, bytes as hex."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return sqlite_float(v)
    if isinstance(v, dict | list):
        return orjson.dumps(v, option=orjson.OPT_NON_STR_KEYS).decode()
    if isinstance(v, bytes):
        return v.hex()
    return str(v)


def json_value(v: Any) -> Any:
    """A value for JSON output: text holding a JSON object or array (a JSON column) is decoded."""
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if isinstance(v, str) and v[:1] in ("{", "[") and v[-1:] in ("}", "]"):
        try:
            return orjson.loads(v)
        except orjson.JSONDecodeError:
            return v
    return v


def print_table(cols: Sequence[str], rows: Sequence[Sequence[Any]], *, cut: int | None = CUT) -> None:
    """An aligned plain-text table and a row count; cells longer than `cut` are cut (None: never)."""

    def short(v: Any) -> str:
        s = safe(cell(v).replace("\n", "\\n"))
        return s if cut is None or len(s) <= cut else s[: cut - 3] + "..."

    cells = [[short(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    typer.echo("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip())
    typer.echo("  ".join("-" * w for w in widths))
    for row in cells:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    typer.echo(f"({len(rows)} row{'' if len(rows) == 1 else 's'})")


def print_vertical(cols: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """One block per row, one `column | value` line per column, nothing cut (psql's `\\x`)."""
    width = max((len(c) for c in cols), default=0)
    for n, row in enumerate(rows, 1):
        typer.echo(f"-[ RECORD {n} ]" + "-" * max(4, width - 8))
        for c, v in zip(cols, row, strict=True):
            lines = safe(cell(v)).split("\n")
            typer.echo(f"{c.ljust(width)} | {lines[0]}".rstrip())
            for line in lines[1:]:
                typer.echo(f"{' ' * width} | {line}".rstrip())
    typer.echo(f"({len(rows)} row{'' if len(rows) == 1 else 's'})")


def print_csv(cols: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """RFC 4180 CSV with a header line (sqlite3 `-csv -header`)."""
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(cols)
    for row in rows:
        writer.writerow([cell(v) for v in row])
    sys.stdout.flush()


def print_json_lines(cols: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """One JSON object per row; JSON columns nested (`jq .messages[0]` works), numbers exact."""
    out = sys.stdout.buffer
    for row in rows:
        obj = {c: json_value(v) for c, v in zip(cols, row, strict=True)}
        out.write(orjson.dumps(obj, default=str, option=orjson.OPT_NON_STR_KEYS) + b"\n")
    sys.stdout.flush()


# --- rlproxy steps ---------------------------------------------------------------------------------


def _num(v: Any, digits: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return f"{v:.{digits}f}" if isinstance(v, int | float) else str(v)


def _sig(v: Any) -> str:
    """A metric with the precision it has: 3 significant digits, never `-0.0000`."""
    if not isinstance(v, int | float) or isinstance(v, bool) or math.isnan(v):
        return ""
    if v == 0:
        return "0"
    return f"{v:.3g}"


STEP_COLUMNS = (
    "policy",
    "step",
    "kind",
    "runs",
    "reward",
    "val",
    "best",
    "loss",
    "KL",
    "clip lo/hi",
    "grad norm",
    "lag",
    "tok/s",
    "positions",  # merged/unmerged: what the forward passes ran after merging calls (issue 21)
    "breaks",
)


def _val(s: dict[str, Any]) -> str:
    """Mean reward of the val runs served by the previous step's adapter (step - 1), and their count."""
    return "" if s.get("val_reward") is None else f"{_num(s['val_reward'], 3)} ({s.get('val_runs') or 0})"


def step_cells(s: dict[str, Any]) -> list[str]:
    """One `rlproxy steps` row: blank where the store has no number."""
    reward = _num(s.get("mean_reward"), 3)
    if reward and s.get("reward_std") is not None:
        reward += f" ± {_num(s['reward_std'], 3)}"
    lo, hi = s.get("clip_frac_low"), s.get("clip_frac_high")
    clip = "" if lo is None and hi is None else f"{_num(lo, 3) or '-'}/{_num(hi, 3) or '-'}"
    return [
        safe(str(s.get("policy") or "")),  # a policy is named by the requests' `model`
        str(s.get("step")),
        str(s.get("kind") or ""),
        "" if s.get("num_runs") is None else str(s["num_runs"]),
        reward,
        _val(s),
        "best" if s.get("best") else "",
        _sig(s.get("loss")),
        _sig(s.get("kl")),
        clip,
        _sig(s.get("grad_norm")),
        _num(s.get("policy_lag_mean"), 2),
        _num(s.get("tokens_per_s"), 0),
        _positions(s),
        "" if s.get("segment_breaks") is None else str(s["segment_breaks"]),
    ]


def _positions(s: dict[str, Any]) -> str:
    """Token positions trained after merging a run's calls into segments / one sample per call."""
    merged, unmerged = s.get("positions_merged"), s.get("positions_unmerged")
    return "" if merged is None or unmerged is None else f"{int(merged)}/{int(unmerged)}"


def print_steps(steps: list[dict[str, Any]]) -> None:
    """The training steps as a rich table (oldest first)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for i, name in enumerate(STEP_COLUMNS):
        table.add_column(name, justify="left" if i in (0, 2) else "right", no_wrap=True)
    for s in steps:
        table.add_row(*step_cells(s))
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    typer.echo(f"({len(steps)} step{'' if len(steps) == 1 else 's'})")
    if any(s.get("val_reward") is not None for s in steps):
        typer.echo(
            "(val: mean reward (count) of the validation runs served by step N-1's adapter; "
            "best: the checkpoint kept for the best val, README: Validation runs)"
        )


# --- rlproxy runs show -----------------------------------------------------------------------------


def _content(c: Any) -> str:
    if isinstance(c, list):  # content parts: the text ones, a placeholder for the others
        return "".join(p.get("text", f"<{p.get('type')}>") if isinstance(p, dict) else str(p) for p in c)
    return "" if c is None else str(c)


def _message_lines(m: dict[str, Any]) -> list[str]:
    role = str(m.get("role", "?"))
    if m.get("tool_call_id"):
        role += f" ({m.get('name') or ''}{' ' if m.get('name') else ''}{m['tool_call_id']})"
    lines = [f"  {role}: {_content(m.get('content'))}".rstrip()]
    for call in m.get("tool_calls") or []:
        fn = call.get("function") or {}
        lines.append(f"    -> tool call {call.get('id', '')}: {fn.get('name')}({fn.get('arguments', '')})")
    return lines


def _key(m: Any) -> tuple[Any, ...]:
    """What makes two messages the same one (a client may send its reply back with keys dropped)."""
    if not isinstance(m, dict):
        return (m,)
    calls = tuple((t.get("id") if isinstance(t, dict) else t) for t in m.get("tool_calls") or [])
    return (m.get("role"), _content(m.get("content")), calls, m.get("tool_call_id"))


def run_lines(run: dict[str, Any]) -> list[str]:
    """A run as text: its header, then each completion with its token counts and the messages it
    added to the conversation (a call's request repeats the earlier ones; they are shown once)."""
    head = [
        f"run {run['id']}",
        f"  status {run.get('status')}"
        + (f" ({run['status_reason']})" if run.get("status_reason") else "")
        + f"   reward {cell(run.get('reward')) or '-'}"
        f"   group {run.get('group_id')}   policy {run.get('policy')}",
        f"  created {run.get('created_at')}   rewarded {run.get('completed_at') or '-'}"
        f"   trained in step {run.get('trained_step') or '-'}",
    ]
    if run.get("metrics"):
        head.append(f"  metrics {cell(run['metrics'])}")
    if run.get("metadata"):
        head.append(f"  metadata {cell(run['metadata'])}")
    lines = head
    shown: list[Any] = []
    for c in run.get("completions", []):
        token_ids = c.get("token_ids")
        sampled = c.get("completion_tokens")
        if sampled is None and isinstance(token_ids, list) and token_ids:
            sampled = len(token_ids[0]) if isinstance(token_ids[0], list) else len(token_ids)
        prompt = c.get("prompt_tokens")
        if prompt is None and isinstance(c.get("prompt_token_ids"), list):
            prompt = len(c["prompt_token_ids"])
        status = c.get("status") or ""
        if c.get("status_code") not in (None, 200):
            status += f" {c['status_code']}"
        lines.append("")
        lines.append(
            f"[{c.get('seq')}] {c.get('adapter') or c.get('policy')} (step {c.get('policy_step')})  "
            f"prompt {cell(prompt) or '?'} tok -> completion {cell(sampled) or '?'} tok  "
            f"{c.get('finish_reason') or ''}  {status}  {_num(c.get('latency_ms'), 1)} ms".rstrip()
        )
        request = c.get("request") or {}
        if isinstance(request.get("messages"), list):
            msgs = request["messages"]
            same = [_key(m) for m in msgs[: len(shown)]] == [_key(m) for m in shown]
            new = msgs[len(shown) :] if same else msgs
            if request.get("tools"):
                names = [
                    (t.get("function") or {}).get("name") for t in request["tools"] if isinstance(t, dict)
                ]
                lines.append(f"  tools: {', '.join(str(n) for n in names)}")
            for m in new:
                lines.extend(_message_lines(m))
            shown = list(msgs)
        elif "prompt" in request:
            lines.append(f"  prompt: {_content(request['prompt'])}")
        choices = (c.get("response") or {}).get("choices") or []
        if choices and isinstance(choices[0], dict):
            reply = choices[0].get("message")
            if isinstance(reply, dict):
                lines.extend(_message_lines(reply))
                shown.append(reply)
            elif "text" in choices[0]:
                lines.append(f"  completion: {choices[0]['text']}")
        if c.get("error"):
            lines.append(f"  error: {c['error']}")
    return lines
