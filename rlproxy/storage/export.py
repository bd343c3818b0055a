"""Export: one record per run, in the formats people train from (`rlproxy export`).

A record is the run's conversation in OpenAI chat format with its reward and the exact tokens of
every completion (README, "Export"):

    run_id, group_id, policy, status, split (train | val), reward, reward_source (app | judge),
    metrics, metadata, created_at, completed_at (when rewarded), trained_step
    messages     the trajectory as the `trajectories` view has it: the last call's request messages
                 and the reply it got (SFT: TRL's `messages` column); content sent as text parts is
                 one string here, joined as the embedded engine joins it
    tools        the last call's `tools` (JSONL: only when it had some)
    prompt       messages up to the last assistant reply; completion: [that reply] (TRL's
                 conversational prompt-completion columns: GRPO/RLOO take `prompt`, KTO
                 `prompt`+`completion`+`label`)
    completions  per model call, in order: seq, policy_step, adapter, status, finish_reason,
                 prompt_tokens, completion_tokens, prompt_token_ids, token_ids, logprobs (the
                 sampled tokens and their sampling logprobs of choice 0, the one the run went on with)

Which runs: `where`, SQL over the `trajectories` view's columns (run_id, group_id, reward, status,
n_completions, messages); a name not in the view falls through to `runs` (e.g. `policy`). The
statement runs on a read-only engine, so `where` can read but never write.

JSONL is written here with no extra dependency. Parquet and a Hugging Face `datasets` folder go
through `datasets` (the `export` extra), imported only when asked for; a field whose shape differs
from row to row (content as text and as image parts, tool schemas) becomes its `Json` type.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import orjson
from sqlalchemy import bindparam, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.errors import StorageError
from rlproxy.storage.queries import COMPLETIONS, RUNS
from rlproxy.storage.times import iso

log = logging.getLogger(__name__)

Format = Literal["jsonl", "parquet", "hf"]
BATCH = 200  # runs read per round trip
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


def json_value(value: Any) -> Any:
    """A JSON column's value parsed when the driver handed back its text (else as it is)."""
    if isinstance(value, str | bytes):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def _content(content: Any) -> Any:
    """Content given as text parts joined into one string, as the embedded engine joins them for
    the model (chat templates of text models read strings); other parts (images) stay parts."""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return content


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message with the keys chat templates read: role, content (kept even when
    null; text parts joined), and name/tool_calls/tool_call_id when set."""
    out = {"role": m.get("role"), "content": _content(m.get("content"))}
    for key in MESSAGE_KEYS[2:]:
        if m.get(key):
            out[key] = m[key]
    return out


def _choice0(values: Any) -> list[Any] | None:
    """Choice 0 of a per-choice list of lists (`token_ids`, `logprobs`); a flat list as it is."""
    if not isinstance(values, list) or not values:
        return values if isinstance(values, list) else None
    return values[0] if isinstance(values[0], list) else values


def record(run: dict[str, Any], messages: Any, completions: list[dict[str, Any]]) -> dict[str, Any]:
    """The export record of one run (module doc): `run` is its row, `messages` the view's column,
    `completions` its rows in seq order."""
    msgs = [_message(m) for m in (json_value(messages) or []) if isinstance(m, dict)]
    last_reply = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    split = last_reply if last_reply is not None and last_reply == len(msgs) - 1 else len(msgs)
    tools = None
    for c in reversed(completions):
        request = json_value(c.get("request"))
        if isinstance(request, dict) and "messages" in request:
            tools = request.get("tools") or None
            break
    out: dict[str, Any] = {
        "run_id": run["id"],
        "group_id": run.get("group_id"),
        "policy": run.get("policy"),
        "status": run.get("status"),
        "split": run.get("split"),
        "reward": run.get("reward"),
        "reward_source": run.get("reward_source"),
        "metrics": json_value(run.get("metrics")),
        "metadata": json_value(run.get("metadata")),
        "created_at": iso(run.get("created_at")),
        "completed_at": iso(run.get("completed_at")),
        "trained_step": run.get("trained_step"),
        "messages": msgs,
        "tools": tools,
        "prompt": msgs[:split],
        "completion": msgs[split:],
        "completions": [
            {
                "seq": c.get("seq"),
                "policy_step": c.get("policy_step"),
                "adapter": c.get("adapter"),
                "status": c.get("status"),
                "finish_reason": c.get("finish_reason"),
                "prompt_tokens": c.get("prompt_tokens"),
                "completion_tokens": c.get("completion_tokens"),
                "prompt_token_ids": json_value(c.get("prompt_token_ids")),
                "token_ids": _choice0(json_value(c.get("token_ids"))),
                "logprobs": _choice0(json_value(c.get("logprobs"))),
            }
            for c in completions
        ],
    }
    return out


async def select_run_ids(
    engine: AsyncEngine, where: str | None = None, params: dict[str, Any] | None = None
) -> list[str]:
    """The ids of the runs `where` selects, oldest first: SQL over the `trajectories` view's columns,
    where a name the view lacks falls through to `runs` (`policy`, `split`, `created_at`, ...).
    `rlproxy export --where` and `rlproxy sft --where` both select with it.

    Raises what the database raises for a bad `where` (an SQLAlchemy error).
    """
    clause = f"WHERE {where}" if where and where.strip() else ""
    ids_sql = (
        "SELECT r.id FROM runs AS r WHERE r.id IN "
        f"(SELECT run_id FROM trajectories {clause}) ORDER BY r.created_at, r.id"
    )
    async with engine.connect() as conn:
        return [row[0] for row in (await conn.execute(text(ids_sql), params or {})).all()]


async def records(engine: AsyncEngine, where: str | None = None) -> AsyncIterator[dict[str, Any]]:
    """The export records of the runs `where` selects (all runs without it), oldest first.

    Raises what the database raises for a bad `where` (an SQLAlchemy error) before yielding.
    """
    async for run, messages, completions in runs(engine, where):
        yield record(run, messages, completions)


async def runs(
    engine: AsyncEngine, where: str | None = None
) -> AsyncIterator[tuple[dict[str, Any], Any, list[dict[str, Any]]]]:
    """The runs `where` selects, oldest first, as (its `runs` row, the trajectories view's
    `messages`, its `completions` rows in seq order), read BATCH runs at a time: what `record`
    takes (and the OTLP export, traces/otlp_file.py).

    Raises what the database raises for a bad `where` (an SQLAlchemy error) before yielding.
    """
    ids = await select_run_ids(engine, where)
    for start in range(0, len(ids), BATCH):
        batch = ids[start : start + BATCH]
        async with engine.connect() as conn:
            rows = {
                r.id: dict(r._mapping) for r in (await conn.execute(select(RUNS).where(RUNS.c.id.in_(batch))))
            }
            views = dict(
                (
                    await conn.execute(
                        text("SELECT run_id, messages FROM trajectories WHERE run_id IN :ids").bindparams(
                            bindparam("ids", expanding=True)
                        ),
                        {"ids": batch},
                    )
                ).all()
            )
            comps: dict[str, list[dict[str, Any]]] = {}
            q = select(COMPLETIONS).where(COMPLETIONS.c.run_id.in_(batch)).order_by(COMPLETIONS.c.seq)
            for c in await conn.execute(q):
                comps.setdefault(c.run_id, []).append(dict(c._mapping))
        for run_id in batch:
            yield rows[run_id], views.get(run_id), comps.get(run_id, [])


async def write(engine: AsyncEngine, fmt: Format, out: Path, where: str | None = None) -> int:
    """Write the records `where` selects to `out` as `fmt`; returns how many runs were written.

    jsonl: one JSON object per line (a key whose value is null is left out of the line, `tools` and
    `metadata` included). parquet: one file. hf: a `datasets.save_to_disk` folder.
    """
    out = Path(out)
    if fmt == "jsonl":
        lines = (
            orjson.dumps({k: v for k, v in rec.items() if v is not None}) + b"\n"
            async for rec in records(engine, where)
        )
        return await write_lines(out, lines)
    rows = [rec async for rec in records(engine, where)]
    write_dataset(rows, fmt, out)
    return len(rows)


async def write_lines(out: Path, lines: AsyncIterator[bytes]) -> int:
    """Write `lines` (each one run's bytes) to `out`, through `out.part`: a failed export leaves no
    half file under the name asked for. Returns how many were written."""
    n = 0
    tmp = out.with_name(out.name + ".part")
    try:
        with tmp.open("wb") as f:
            async for line in lines:
                f.write(line)
                n += 1
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def write_dataset(rows: list[dict[str, Any]], fmt: Format, out: Path) -> None:
    """Write `rows` as Parquet (`fmt="parquet"`) or a `datasets` folder (`"hf"`), through `datasets`."""
    try:
        import datasets
    except ImportError as exc:
        raise StorageError(
            f"--format {fmt} needs the `datasets` package: pip install 'rlproxy[export]'"
        ) from exc
    datasets.disable_progress_bars()
    if not rows:
        dataset = datasets.Dataset.from_dict({k: [] for k in record({"id": ""}, [], [])})
    else:
        dataset = datasets.Dataset.from_list(rows, on_mixed_types="use_json")
    if fmt == "parquet":
        dataset.to_parquet(str(out))
    else:
        dataset.save_to_disk(str(out))
    log.info("wrote %d runs to %s (%s)", len(rows), out, fmt)
