"""Unique tasks: every episode names a task of its own (`rlproxy demo --signal singletons|scorer`).

Production agents rarely see the same task twice, so app-formed groups are rare there. These
generators give each episode a prompt no other episode of the demo has, by a part of the prompt that
the reward does not read:

  number     "Pick a number between LOW and HIGH for the TOPIC. Reply with digits only." (the
             reward: digits only, then the number plus one; the range is not checked, as in the
             original prompt);
  directory  the question about two people, plus what the call is about ("I need to call them about
             the TOPIC."): the reward reads the two names only.

A task is the keyword arguments of the agent's `play_episode` (`{"prompt": ...}` or
`{"people": (a, b), "topic": ...}`). The rungs stay fixed: `rung_tasks(task, seed, n)` are the same
`n` validation prompts for every signal (the directory's are `rungs.prompt_split`'s, without a
topic), and `UniqueTasks` never draws one of them.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from typing import Any

from rlproxy.demo import directory, number_game
from rlproxy.demo.rungs import prompt_split

TOPICS = (
    "raffle", "quiz", "lottery", "bingo night", "board game", "card trick", "dice game", "treasure hunt",
    "seating plan", "locker room", "parking lot", "bus route", "hotel floor", "race", "relay team",
    "chess club", "book club", "garden plot", "bake sale", "charity run", "school fair", "science fair",
    "talent show", "spelling bee", "football team", "choir", "orchestra", "film night", "picnic",
    "hiking trip", "camping trip", "ski trip", "museum visit", "zoo visit", "library", "cafeteria",
    "gym class", "art class", "music lesson", "dance class", "swim meet", "tennis match", "golf day",
    "boat trip", "fishing trip", "birthday party", "wedding", "office party",
)  # fmt: skip
Task = dict[str, Any]


def first_prompt(task: str, spec: Task) -> str:
    """The user's first message of a task: what makes it unique."""
    if task == "number":
        return str(spec["prompt"])
    return directory.question(spec["people"], spec.get("topic"))


def _number(rng: random.Random) -> Task:
    low = rng.randint(1, 40)
    return {"prompt": number_game.task_prompt(low, low + rng.randint(5, 20), rng.choice(TOPICS))}


def rung_tasks(task: str, seed: int, n: int) -> list[Task]:
    """The `n` fixed validation prompts of a seed (the rungs), the same for every signal."""
    if task == "directory":
        return [{"people": pair} for pair in prompt_split(seed, 0, n, 0)[1]]
    rng, out, seen = random.Random(f"number-rungs-{seed}"), [], set()
    while len(out) < n:
        spec = _number(rng)
        if spec["prompt"] not in seen:
            seen.add(spec["prompt"])
            out.append(spec)
    return out


class UniqueTasks:
    """`next()`: a task no earlier `next()` gave and no rung has (after every range and topic is used,
    the topic gets a serial number)."""

    def __init__(self, task: str, seed: int, rungs: Iterable[Task] = ()) -> None:
        self.task = task
        self.rng = random.Random(f"{task}-unique-{seed}")
        rungs = list(rungs)
        self.seen = {first_prompt(task, s) for s in rungs}
        used = {tuple(s["people"]) for s in rungs} if task == "directory" else set()
        pairs = list(itertools.permutations(sorted(directory.DIRECTORY), 2)) if task == "directory" else []
        self.pairs = [p for p in pairs if p not in used] or pairs  # the rungs' pairs are held out
        self.drawn = 0

    def _draw(self) -> Task:
        if self.task == "number":
            return _number(self.rng)
        return {"people": tuple(self.rng.choice(self.pairs)), "topic": self.rng.choice(TOPICS)}

    def next(self) -> Task:
        self.drawn += 1
        for _ in range(200):
            spec = self._draw()
            if first_prompt(self.task, spec) not in self.seen:
                break
        else:  # (almost) every combination is taken: a serial keeps it unique
            key = "prompt" if self.task == "number" else "topic"
            spec[key] = (
                spec[key].replace(" Reply", f" (#{self.drawn}) Reply", 1)
                if self.task == "number"
                else f"{spec[key]} #{self.drawn}"
            )
        self.seen.add(first_prompt(self.task, spec))
        return spec
