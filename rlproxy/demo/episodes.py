"""What the demo's agents (demo/number_game.py, demo/directory.py) share, written once: the episode
record, the arguments (and headers) of its model calls, the reward post, a batch of episodes played
at the same time (so the server can batch them) and the agents' command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from openai import OpenAI

log = logging.getLogger(__name__)


@dataclass
class Episode:
    run_id: str
    group_id: str
    reward: float
    replies: list[str]
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    calls: int = 0  # model calls made


def sampled(
    model: str, temperature: float, max_tokens: int, run_id: str, group_id: str | None, split: str | None
) -> dict[str, Any]:
    """An episode's arguments to every model call, its headers among them: no group header for None
    (the store groups by the first prompt); `split="val"` makes it a validation run (served and stored,
    never trained: the demo's rungs)."""
    headers = {"X-Run-Id": run_id, **({"X-Group-Id": group_id} if group_id else {})}
    headers |= {"X-Split": split} if split else {}
    return {"model": model, "temperature": temperature, "max_tokens": max_tokens, "extra_headers": headers}


def post_reward(base_url: str, api_key: str, run_id: str, reward: float, metrics: dict[str, float]) -> None:
    """Report the episode's outcome; the proxy stores it on the run and the trainer picks it up."""
    response = httpx.post(
        f"{base_url.rstrip('/')}/runs/{run_id}/reward",
        json={"reward": reward, "metrics": metrics},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=60.0,
    )
    response.raise_for_status()


def play_all(
    n: int,
    play: Callable[[int], Episode],
    base_url: str,
    *,
    api_key: str = "not-needed",
    post: bool = True,
    workers: int | None = None,
) -> list[Episode]:
    """Episodes `play(0)` .. `play(n - 1)` at the same time (`workers` at once, default all), each
    reward posted as its episode ends (unless `post` is False: the scorer signal posts none)."""

    def one(i: int) -> Episode:
        episode = play(i)
        if post:
            post_reward(base_url, api_key, episode.run_id, episode.reward, episode.metrics)
        return episode

    with ThreadPoolExecutor(max_workers=workers or max(n, 1)) as pool:
        return list(pool.map(one, range(n)))


def default_model(client: OpenAI) -> str:
    """The first model the server lists: behind rlproxy, the default policy (the base model's name)."""
    return client.models.list().data[0].id


def main(agent: Any, argv: list[str] | None = None) -> int:
    """`python -m rlproxy.demo.<agent>`: play `--groups` groups against `OPENAI_BASE_URL`."""
    p = argparse.ArgumentParser(
        description=agent.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--groups", type=int, default=10, help="groups to play, one after the other")
    p.add_argument("--group-size", type=int, default=8, help="episodes per group, played concurrently")
    p.add_argument("--model", default=None, help="model (policy) name; default: the server's first model")
    p.add_argument("--temperature", type=float, default=agent.TEMPERATURE)
    p.add_argument("--max-tokens", type=int, default=agent.MAX_TOKENS, help="tokens per model call")
    p.add_argument("--seed", type=int, default=None, help="sampling seeds (and questions); default random")
    p.add_argument("--json", action="store_true", help="print one JSON line per episode")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    base_url = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    api_key = os.environ.get("OPENAI_API_KEY", "not-needed")
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=1)
    model = args.model or default_model(client)
    for g in range(args.groups):
        seed = None if args.seed is None else args.seed * 10_000 + g
        episodes = agent.run_group(
            client, model, base_url, api_key, args.group_size, args.temperature, args.max_tokens, seed
        )
        if args.json:
            for e in episodes:
                sys.stdout.write(json.dumps(asdict(e)) + "\n")
        mean = sum(e.reward for e in episodes) / len(episodes)
        log.info("group %d/%d: mean reward %.3f  e.g. %r", g + 1, args.groups, mean, episodes[0].replies)
    return 0
