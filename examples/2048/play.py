"""An agent that plays 2048 through any OpenAI-compatible server: an ordinary OpenAI-SDK program.

What ties it to rlproxy is three things, all optional for the program to work at all:
  * `OPENAI_BASE_URL` points at the proxy (e.g. http://127.0.0.1:8000/v1);
  * every request of one game carries the header `X-Run-Id: <game id>` (and the games started from
    the same board share an `X-Group-Id`, so GRPO compares like with like);
  * when the game ends, the reward in [0, 1] is POSTed to `{OPENAI_BASE_URL}/runs/{run_id}/reward`.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python examples/2048/play.py --episodes 16 --group-size 8
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from game import Game, parse_move, reward  # noqa: E402

log = logging.getLogger("play2048")

SYSTEM = (
    "You are playing the game 2048 on a 4x4 board. A move slides all tiles up, down, left or right; "
    "two equal tiles that collide merge into their sum. Get the largest tile you can. "
    "Reply with exactly one word: up, down, left or right."
)


@dataclass
class EpisodeResult:
    run_id: str
    group_id: str
    reward: float
    max_tile: int
    score: int
    moves: int
    invalid: int
    over: bool
    seconds: float


def prompt_for(game: Game, note: str) -> str:
    """The environment's message for one turn: the board, the score and what happened last turn."""
    lines = [f"Board (score {game.score}):", game.render()]
    if note:
        lines.append(note)
    lines.append("Your move (up, down, left or right)?")
    return "\n".join(lines)


def post_reward(base_url: str, api_key: str, run_id: str, value: float, metrics: dict[str, float]) -> None:
    """Tell the proxy how the game went; the trainer learns from the reward of the whole run."""
    response = httpx.post(
        f"{base_url.rstrip('/')}/runs/{run_id}/reward",
        json={"reward": value, "metrics": metrics},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=60.0,
    )
    response.raise_for_status()


def play_episode(
    client: OpenAI,
    model: str,
    seed: int,
    group_id: str,
    max_moves: int = 200,
    max_invalid: int = 3,
    temperature: float = 1.0,
    max_tokens: int = 8,
    history: int = 2,
) -> EpisodeResult:
    """Play one game; every model call carries the game's run id. Does not post the reward."""
    run_id = f"2048-{uuid.uuid4().hex[:16]}"
    headers = {"X-Run-Id": run_id, "X-Group-Id": group_id}
    game = Game(seed=seed)
    started = time.monotonic()
    invalid = 0
    note = ""
    # The conversation keeps the last `history` exchanges so the model sees what it just did,
    # without the prompt growing with every move.
    turns: list[dict[str, str]] = []
    while game.moves < max_moves and not game.over and not game.won:
        user = {"role": "user", "content": prompt_for(game, note)}
        recent = turns[-2 * history :] if history else []
        messages = [{"role": "system", "content": SYSTEM}, *recent, user]
        completion = client.chat.completions.create(
            model=model,
            messages=messages,
            temperature=temperature,
            max_tokens=max_tokens,
            extra_headers=headers,
        )
        text = completion.choices[0].message.content or ""
        turns += [user, {"role": "assistant", "content": text}]
        move = parse_move(text)
        if move is None:
            invalid += 1
            note = f"Your reply {text.strip()[:40]!r} was not a move."
        elif not game.step(move):
            invalid += 1
            note = f"Moving {move} changes nothing; pick another direction."
        else:
            note = f"You moved {move}."
        if invalid >= max_invalid:
            break
    return EpisodeResult(
        run_id=run_id,
        group_id=group_id,
        reward=reward(game.max_tile),
        max_tile=game.max_tile,
        score=game.score,
        moves=game.moves,
        invalid=invalid,
        over=game.over,
        seconds=round(time.monotonic() - started, 3),
    )


def run(args: argparse.Namespace) -> list[EpisodeResult]:
    """Play `episodes` games, `concurrency` at a time; games of one group start from the same board."""
    base_url = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    api_key = os.environ.get("OPENAI_API_KEY", "not-needed")
    client = OpenAI(base_url=base_url, api_key=api_key, timeout=args.timeout, max_retries=1)
    batch = uuid.uuid4().hex[:8]

    def one(i: int) -> EpisodeResult:
        group = i // args.group_size
        result = play_episode(
            client,
            args.model,
            seed=args.seed + group,
            group_id=f"2048-{batch}-{group}",
            max_moves=args.max_moves,
            max_invalid=args.max_invalid,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            history=args.history,
        )
        metrics = {"max_tile": result.max_tile, "score": result.score, "moves": result.moves}
        metrics["invalid"] = result.invalid
        post_reward(base_url, api_key, result.run_id, result.reward, metrics)
        log.info(
            "game %s: reward %.3f, max tile %d, %d moves, %d invalid, %.1fs",
            result.run_id, result.reward, result.max_tile, result.moves, result.invalid, result.seconds,
        )  # fmt: skip
        return result

    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        return list(pool.map(one, range(args.episodes)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=8, help="games to play in all")
    p.add_argument("--group-size", type=int, default=8, help="games per group (same first board)")
    p.add_argument("--concurrency", type=int, default=8, help="games played at the same time")
    p.add_argument("--max-moves", type=int, default=200, help="valid moves after which a game stops")
    p.add_argument("--max-invalid", type=int, default=3, help="invalid replies after which a game ends")
    p.add_argument("--model", default=os.environ.get("MODEL", "default"), help="model (policy) name")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per reply (one word is enough)")
    p.add_argument("--history", type=int, default=2, help="previous exchanges kept in the prompt")
    p.add_argument("--seed", type=int, default=0, help="board seed of the first group")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print one JSON line per game")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.model == "default":
        # The proxy's default policy is the served base model: ask the server for its name.
        base_url = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
        client = OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "not-needed"))
        args.model = client.models.list().data[0].id
    results = run(args)
    if args.json:
        for r in results:
            print(json.dumps(asdict(r)))
    mean = sum(r.reward for r in results) / max(len(results), 1)
    best = max((r.max_tile for r in results), default=0)
    print(f"{len(results)} games, mean reward {mean:.3f}, best tile {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
