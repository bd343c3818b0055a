"""The number game: the demo's task, its reward, and the agent that plays it.

The task, scored by code, two turns:
  Turn 1: "Pick a number between 1 and 10. Reply with digits only."  The model answers, say "7".
  Turn 2 (the environment's reply): "Add one to your number and reply with only the result."  -> "8".

Reward in [0, 1]: 0.3 when the first reply is digits only, plus 0.7 when the second reply is
exactly the first number plus one. The partial credit matters: an untrained SmolLM2-135M almost
never gets both turns right, and GRPO learns nothing from a group whose rewards are all equal, so
the easier half of the task gives the first gradients (see LEARNING_FACTS: 0.03 -> 0.95 in minutes).

The agent is written against the plain OpenAI SDK and knows three things about rlproxy, no more:
  * `OPENAI_BASE_URL` points at the proxy (e.g. http://127.0.0.1:8000/v1);
  * each episode's requests carry `X-Run-Id: <episode id>`, and the episodes of one group share an
    `X-Group-Id`, so the trainer compares episodes that started from the same task;
  * at the end of an episode it POSTs the reward to `{OPENAI_BASE_URL}/runs/{run_id}/reward`.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python -m rlproxy.demo.number_game --groups 20

The episodes of a group run concurrently (threads), so the server can batch them. It lives in the
package (not only under examples/) so that `rlproxy demo` runs from a plain `pip install rlproxy`.
"""

from __future__ import annotations

import re
import sys
import time
import uuid

from openai import OpenAI

from rlproxy.demo.episodes import Episode, main, play_all, sampled

FIRST_PROMPT = "Pick a number between 1 and 10. Reply with digits only."
SECOND_PROMPT = "Add one to your number and reply with only the result."
NAME = "number"
TEMPERATURE = 1.0  # the demo's sampling temperature for this task
MAX_TOKENS = 8  # tokens per reply: a number
GOAL = 0.5  # last-3 minus first-3 mean reward that counts as learned
DIGITS_WEIGHT = 0.3
CORRECT_WEIGHT = 0.7

_DIGITS = re.compile(r"\d+")
_INTEGER = re.compile(r"-?\d+")


def _clean(text: str | None) -> str:
    """Strip whitespace and one trailing full stop: "8." and " 8\n" both count as "8"."""
    text = (text or "").strip()
    return text[:-1].rstrip() if text.endswith(".") else text


def first_number(text: str | None) -> int | None:
    """The number the model picked: the first integer in its reply, wherever it is."""
    match = _INTEGER.search(text or "")
    return int(match.group()) if match else None


def score(first_reply: str | None, second_reply: str | None) -> tuple[float, dict[str, float]]:
    """(reward, metrics) for one episode; metrics say which half was earned."""
    digits_only = _DIGITS.fullmatch(_clean(first_reply)) is not None
    picked = first_number(first_reply)
    answer = _clean(second_reply)
    correct = picked is not None and _DIGITS.fullmatch(answer) is not None and int(answer) == picked + 1
    reward = DIGITS_WEIGHT * digits_only + CORRECT_WEIGHT * correct
    return round(reward, 6), {"digits_only": float(digits_only), "correct": float(correct)}


def task_prompt(low: int, high: int, topic: str) -> str:
    """A first prompt of the unique-task variant (`rlproxy demo --signal ...`): a range and a topic
    vary, the reward does not (digits only, then the number plus one)."""
    return f"Pick a number between {low} and {high} for the {topic}. Reply with digits only."


def play_episode(
    client: OpenAI,
    model: str,
    group_id: str | None,
    temperature: float = 1.0,
    max_tokens: int = 8,
    seed: int | None = None,
    prompt: str = FIRST_PROMPT,
    split: str | None = None,
) -> Episode:
    """Two model calls with the environment's message in between; returns the scored episode
    (`group_id`, `split`: episodes.sampled)."""
    run_id = f"num-{uuid.uuid4().hex[:16]}"
    started = time.monotonic()
    messages: list[dict[str, str]] = [{"role": "user", "content": prompt}]
    replies: list[str] = []
    sampling = sampled(model, temperature, max_tokens, run_id, group_id, split)
    for turn, follow_up in enumerate((SECOND_PROMPT, None)):
        seed_n = None if seed is None else seed * 10 + turn
        completion = client.chat.completions.create(messages=messages, seed=seed_n, **sampling)
        reply = completion.choices[0].message.content or ""
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    reward, metrics = score(replies[0], replies[1])
    return Episode(run_id, group_id or "", reward, replies, metrics, round(time.monotonic() - started, 3), 2)


def run_group(
    client: OpenAI, model: str, base_url: str, api_key: str = "not-needed", group_size: int = 8,
    temperature: float = 1.0, max_tokens: int = 8, seed: int | None = None, prompt: str = FIRST_PROMPT,
) -> list[Episode]:  # fmt: skip
    """Play one group of episodes at the same time and post each reward as its episode ends.

    `seed` makes every sampling call reproducible (episode n of the group gets seeds derived from
    seed and n); None samples at random. `prompt` is the group's first prompt.
    """
    group_id = f"num-{uuid.uuid4().hex[:12]}"

    def one(i: int) -> Episode:
        episode_seed = None if seed is None else seed * 1000 + i
        return play_episode(client, model, group_id, temperature, max_tokens, episode_seed, prompt)

    return play_all(group_size, one, base_url, api_key=api_key)


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
