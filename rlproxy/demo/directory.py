"""The directory task: a tool-using agent that looks people up in a small local table, and its reward.

An ordinary OpenAI-SDK agent with one tool, `lookup(name)`, over a company directory kept in plain
Python (`DIRECTORY`). Each episode asks for the phone extensions of two people; the model has to call
the tool for each of them (one call per reply), read the results and answer:

    user:      What are the phone extensions of Alice and Frank?
    assistant: <tool_call> {"name": "lookup", "arguments": {"name": "Alice"}} </tool_call>
    tool:      {"name": "Alice", "team": "sales", "extension": "4821"}
    assistant: <tool_call> {"name": "lookup", "arguments": {"name": "Frank"}} </tool_call>
    tool:      {"name": "Frank", "team": "support", "extension": "3307"}
    assistant: Alice: 4821, Frank: 3307

At least three model calls (two lookups, one answer). The tools reach the model through the `tools`
field and its chat template (hermes: `<tool_call>{json}</tool_call>`); the server parses the calls
back into `tool_calls`. The extensions are made up, so no model knows them without the tool.

The agent's guard rail, as many agent loops have: a reply that is not a tool call while someone the
question names has not been looked up yet is answered with a reminder that shows the call to make
(`NUDGE`), up to `MAX_CALLS` model calls in all. An untrained SmolLM2-135M never writes a valid
tool call unprompted (0 of 96 samples); after a reminder about one reply in eight starts a
`<tool_call>` block and a few are well-formed copies: enough for GRPO to start from.

Reward in [0, 1], computed by code, the final answer dominating:
  0.35 for each of the two extensions found in the final answer (0.7),
  0.1 for each of the two people looked up with a well-formed call (0.2),
  0.1 once the model has tried a call at all (a reply with `<tool_call>`, parsed or not).
The last is the first rung: about one reminded reply in eight starts a `<tool_call>` block, while a
well-formed call is far rarer at first; without it most groups' rewards are all zero (no gradient).
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
import uuid
from typing import Any

from openai import OpenAI

from rlproxy.demo.episodes import Episode, main, play_all, sampled

TOOL_OPEN = "<tool_call>"

NAME = "directory"
TEMPERATURE = 0.7  # an untrained 135M model at 1.0 rarely stays on topic; greedy would never explore
MAX_TOKENS = 32  # a tool call is 28 tokens, an answer about 12; untrained replies run to the limit
MAX_CALLS = 5  # model calls per episode: two lookups and an answer, plus two reminders
GOAL = 0.3  # last-3 minus first-3 mean reward that counts as learned
ANSWER_WEIGHT = 0.35  # per extension in the final answer
CALL_WEIGHT = 0.1  # per person looked up with a well-formed call
ATTEMPT_WEIGHT = 0.1  # once, for any reply that starts a <tool_call> block (well-formed or not)
MAX_REWARD = round(2 * ANSWER_WEIGHT + 2 * CALL_WEIGHT + ATTEMPT_WEIGHT, 6)  # an episode done right

DIRECTORY: dict[str, dict[str, str]] = {
    "Alice": {"team": "sales", "extension": "4821"},
    "Bob": {"team": "engineering", "extension": "1954"},
    "Carol": {"team": "finance", "extension": "7310"},
    "David": {"team": "support", "extension": "2687"},
    "Emma": {"team": "engineering", "extension": "5093"},
    "Frank": {"team": "support", "extension": "3307"},
    "Grace": {"team": "sales", "extension": "8462"},
    "Henry": {"team": "legal", "extension": "6175"},
    "Irene": {"team": "finance", "extension": "9238"},
    "Jack": {"team": "legal", "extension": "4516"},
}

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "a person's phone extension",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string"}},
                "required": ["name"],
            },
        },
    }
]

SYSTEM = (  # short: every call re-reads it, and prompt tokens are most of an episode's cost on a CPU
    "Look people up one per call, then answer with the extensions only. A call:\n"
    '<tool_call>\n{"name": "lookup", "arguments": {"name": "Sam"}}\n</tool_call>'
)
QUESTION = "What are the phone extensions of {a} and {b}?"
NUDGE = "Look up {name}. Reply with only this, nothing else:\n" + (  # copied 5 times in 32, "Reply with:" 1
    '<tool_call>\n{{"name": "lookup", "arguments": {{"name": "{name}"}}}}\n</tool_call>'
)


def lookup(arguments: str | dict[str, Any] | None) -> tuple[dict[str, str], str | None]:
    """Run the tool: (result shown to the model, the name found or None). Plain Python, no model."""
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else (arguments or {})
    except ValueError:
        return {"error": "arguments are not JSON"}, None
    name = args.get("name") if isinstance(args, dict) else None
    if not isinstance(name, str):
        return {"error": 'missing argument "name"'}, None
    key = name.strip().capitalize()
    if key not in DIRECTORY:
        return {"error": f"no person named {name!r} in the directory"}, None
    return {"name": key, "extension": DIRECTORY[key]["extension"]}, key


def score(
    people: tuple[str, str], answer: str | None, looked_up: set[str], attempted: bool = False
) -> tuple[float, dict[str, float]]:
    """(reward, metrics) of one episode: extensions in the final answer, who was looked up, and
    whether any reply tried a tool call (a valid lookup counts as one)."""
    digits = set(re.findall(r"\d+", answer or ""))
    found = sum(DIRECTORY[p]["extension"] in digits for p in people)
    called = sum(p in looked_up for p in people)
    tried = attempted or bool(looked_up)
    reward = ANSWER_WEIGHT * found + CALL_WEIGHT * called + ATTEMPT_WEIGHT * tried
    metrics = {
        "extensions_found": float(found),
        "people_looked_up": float(called),
        "tried_a_call": float(tried),
    }
    return round(reward, 6), metrics


_ASKED = re.compile(r"extensions of (\w+) and (\w+)\?")


def expert(body: dict[str, Any]) -> dict[str, Any]:
    """The scripted teacher (demo/provider.py serves it as a stand-in for a hosted model): look up
    each person the question names, one call per reply, then answer with what the lookups said."""
    messages = body.get("messages") or []
    asked = next((_ASKED.search(str(m.get("content"))) for m in messages if m.get("role") == "user"), None)
    people = asked.groups() if asked else ()
    found: dict[str, str] = {}
    for m in messages:
        if m.get("role") == "tool":
            try:
                result = json.loads(m.get("content") or "{}")
            except ValueError:
                continue
            if isinstance(result, dict) and "extension" in result:
                found[str(result.get("name"))] = str(result["extension"])
    for person in people:
        if person not in found:
            arguments = json.dumps({"name": person})
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": "lookup", "arguments": arguments}}  # fmt: skip
            return {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"role": "assistant", "content": ", ".join(f"{p}: {found[p]}" for p in people)}


def _show(message: Any) -> str:
    """A reply as one short string for the progress lines: its text, or its tool call."""
    if message.tool_calls:
        fn = message.tool_calls[0].function
        return f"{fn.name}({fn.arguments})"
    return message.content or ""


def question(people: tuple[str, str], topic: str | None = None) -> str:
    """The user's question; `topic` (the unique-task variant, `rlproxy demo --signal ...`) adds what
    the call is about, which changes nothing the reward reads."""
    asked = QUESTION.format(a=people[0], b=people[1])
    return asked if topic is None else f"{asked} I need to call them about the {topic}."


def play_episode(
    client: OpenAI,
    model: str,
    group_id: str | None,
    people: tuple[str, str],
    temperature: float = TEMPERATURE,
    max_tokens: int = MAX_TOKENS,
    seed: int | None = None,
    split: str | None = None,
    topic: str | None = None,
) -> Episode:
    """The agent loop: call the model, run its tool call, repeat; ends on an answer or MAX_CALLS.
    (`group_id`, `split`: episodes.sampled)."""
    run_id = f"dir-{uuid.uuid4().hex[:16]}"
    well_formed = 0  # replies the server parsed into a lookup tool call (the first reward component)
    started = time.monotonic()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question(people, topic)},
    ]
    looked_up: set[str] = set()
    replies: list[str] = []
    answer: str | None = None
    attempted = False
    sampling = sampled(model, temperature, max_tokens, run_id, group_id, split)
    for call in range(MAX_CALLS):
        seed_n = None if seed is None else seed * 100 + call
        completion = client.chat.completions.create(messages=messages, tools=TOOLS, seed=seed_n, **sampling)
        message = completion.choices[0].message
        replies.append(_show(message))
        attempted = attempted or bool(message.tool_calls) or TOOL_OPEN in (message.content or "")
        if message.tool_calls:
            tool_call = message.tool_calls[0]  # one person per call: further calls are not run
            well_formed += tool_call.function.name == "lookup"
            result, found = (
                lookup(tool_call.function.arguments)
                if tool_call.function.name == "lookup"
                else ({"error": f"unknown tool {tool_call.function.name!r}"}, None)
            )
            if found:
                looked_up.add(found)
            answer = None  # the answer is the last reply, and only if it is not a tool call
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content,
                    "tool_calls": [
                        {
                            "id": tool_call.id,
                            "type": "function",
                            "function": {
                                "name": tool_call.function.name,
                                "arguments": tool_call.function.arguments,
                            },
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": json.dumps(result)})
            continue
        answer = message.content or ""
        missing = [p for p in people if p not in looked_up]
        if missing and call + 2 < MAX_CALLS:  # room for the lookup and an answer after it
            messages.append({"role": "assistant", "content": answer})
            messages.append({"role": "user", "content": NUDGE.format(name=missing[0])})
            continue
        break
    reward, metrics = score(people, answer, looked_up, attempted)
    metrics["well_formed_calls"] = float(well_formed)  # not part of the reward: shown per rung
    return Episode(
        run_id, group_id or "", reward, replies, metrics, round(time.monotonic() - started, 3), len(replies)
    )


def run_group(
    client: OpenAI, model: str, base_url: str, api_key: str = "not-needed", group_size: int = 8,
    temperature: float = TEMPERATURE, max_tokens: int = MAX_TOKENS, seed: int | None = None,
) -> list[Episode]:  # fmt: skip
    """Play one group (the same question for every episode) at the same time; post each reward.

    `seed` makes the question and every sampling call reproducible (the group's n-th episode gets
    sampling seeds derived from seed and n); None draws them at random.
    """
    rng = random.Random(seed)
    people = tuple(rng.sample(sorted(DIRECTORY), 2))
    group_id = f"dir-{uuid.uuid4().hex[:12]}"

    def one(i: int) -> Episode:
        episode_seed = None if seed is None else seed * 1000 + i
        return play_episode(client, model, group_id, people, temperature, max_tokens, episode_seed)  # type: ignore[arg-type]

    return play_all(group_size, one, base_url, api_key=api_key)


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
