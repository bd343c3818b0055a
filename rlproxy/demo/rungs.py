"""Rungs: a policy's reward on fixed, fresh prompts of the directory task, component by component.

Both directory demos measure with it: the RL-only one (`rlproxy demo --task directory`: base, then
after RL) and the distillation path (`--teacher`: base, after SFT, after RL). A rung is a set of
validation runs (`X-Split: val`: served and stored, never trained), one episode per prompt, with the
mean reward and each component in [0, 1]: `well_formed_call` (episodes in which the server parsed a
lookup tool call from a reply), `correct_lookup` (the two people looked up), `correct_answer` (the two
extensions in the final answer). The number game's rungs (`rlproxy demo --signal ...`) are measured
the same way on its fixed prompts (demo/tasks.py), with `digits_only` and `correct`.
"""

from __future__ import annotations

import itertools
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

from openai import OpenAI

from rlproxy.demo import directory, number_game
from rlproxy.demo.episodes import Episode, play_all

COMPONENTS = ("well_formed_call", "correct_lookup", "correct_answer")
NUMBER_COMPONENTS = ("digits_only", "correct")  # the number game's reward parts


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def prompt_split(seed: int, teacher: int, evaluation: int, rl: int) -> tuple[list, list, list]:
    """Disjoint lists of (person, person) for the teacher, the rungs and the RL groups."""
    pairs = list(itertools.permutations(sorted(directory.DIRECTORY), 2))
    random.Random(seed).shuffle(pairs)
    if teacher + evaluation + rl > len(pairs):
        raise ValueError(f"{teacher + evaluation + rl} prompts asked, the directory has {len(pairs)}")
    return pairs[:teacher], pairs[teacher : teacher + evaluation], pairs[teacher + evaluation :][:rl]


def components(episode: Episode) -> dict[str, float]:
    """One episode's reward components, each in [0, 1]."""
    m = episode.metrics
    return {
        "well_formed_call": float(m.get("well_formed_calls", 0.0) > 0),
        "correct_lookup": m.get("people_looked_up", 0.0) / 2,
        "correct_answer": m.get("extensions_found", 0.0) / 2,
    }


def play(
    client: OpenAI,
    base_url: str,
    model: str,
    pairs: list[tuple[str, str]],
    *,
    group_id: str | None = None,
    split: str | None = None,
    temperature: float,
    max_tokens: int,
    seed: int,
    post: bool = True,
) -> list[Episode]:
    """One episode per pair, concurrently (8 at a time), each reward posted (unless `post` is False)."""

    def one(i: int) -> Episode:
        gid = group_id or f"dir-{uuid.uuid4().hex[:12]}"
        return directory.play_episode(
            client, model, gid, pairs[i], temperature, max_tokens, seed * 1000 + i, split=split
        )

    return play_all(len(pairs), one, base_url, post=post, workers=8)


def rung(name: str, episodes: list[Any], seconds: float, task: str = "directory") -> dict[str, Any]:
    comps = [components(e) if task == "directory" else e.metrics for e in episodes]
    out: dict[str, Any] = {"rung": name, "episodes": len(episodes)}
    out["mean_reward"] = _mean([e.reward for e in episodes])
    for c in COMPONENTS if task == "directory" else NUMBER_COMPONENTS:
        out[c] = _mean([x[c] for x in comps])
    out["seconds"] = round(seconds, 1)
    out["example"] = episodes[0].replies if episodes else []
    return out


def line(r: dict[str, Any]) -> str:
    parts = "  ".join(f"{c} {r[c]:.3f}" for c in (*COMPONENTS, *NUMBER_COMPONENTS) if c in r)
    return (
        f"rung {r['rung']:>7}: reward {r['mean_reward']:.3f}  {parts}  "
        f"({r['episodes']} episodes, {r['seconds']:.0f}s)  e.g. {r['example']!r}"
    )


def table(rungs: list[dict[str, Any]]) -> list[str]:
    """Directory rungs as a table's lines: a rung a row, its mean reward and each component."""
    head = f"{'rung':>6}  {'reward':>6}  " + "  ".join(f"{c:>16}" for c in COMPONENTS)
    return [head] + [
        f"{r['rung']:>6}  {r['mean_reward']:>6.3f}  " + "  ".join(f"{r[c]:>16.3f}" for c in COMPONENTS)
        for r in rungs
    ]


def evaluate(
    client: OpenAI,
    base: str,
    policy: str,
    name: str,
    pairs: list,
    seed: int,
    echo: Callable[[str], None],
    post: bool = True,
) -> dict[str, Any]:
    """A rung: `policy` on the fresh prompts, as validation runs (never trained)."""
    t0 = time.monotonic()
    episodes = play(client, f"{base}/v1", policy, pairs, split="val", temperature=directory.TEMPERATURE,
                    max_tokens=directory.MAX_TOKENS, seed=seed + 7, post=post)  # fmt: skip
    r = rung(name, episodes, time.monotonic() - t0)
    echo(line(r))
    return r


def evaluate_number(
    client: OpenAI,
    base: str,
    policy: str,
    name: str,
    prompts: list[str],
    seed: int,
    echo: Callable[[str], None],
    post: bool = True,
) -> dict[str, Any]:
    """A number-game rung: one validation episode per fixed prompt (demo/tasks.py), components
    `digits_only` and `correct` (the reward's two parts) apart."""
    t0 = time.monotonic()

    def one(i: int) -> Episode:
        return number_game.play_episode(client, policy, None, number_game.TEMPERATURE, number_game.MAX_TOKENS,
                                        (seed + 7) * 1000 + i, prompts[i], split="val")  # fmt: skip

    episodes = play_all(len(prompts), one, f"{base}/v1", post=post, workers=8)
    r = rung(name, episodes, time.monotonic() - t0, task="number")
    echo(line(r))
    return r
