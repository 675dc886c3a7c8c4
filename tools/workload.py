"""The chat workload of ``kvoffload demo`` (``demo.py``, ``demo_p2p.py``), the end-to-end tests and
the vLLM benchmarks: deterministic maintenance logs, conversations about them run in rounds, one
streamed chat completion per turn (TTFT, token ids, cached prompt tokens).

Its own module so that both demos import it and neither imports the other's.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

SYSTEM = "You are a terse assistant for a railway maintenance team. Answer in one short sentence."
_SITES = [
    "North Yard",
    "Harbor Depot",
    "Cedar Junction",
    "Mill Street",
    "Old Quarry",
    "Riverside",
    "Summit Pass",
    "Glass Works",
    "East Loop",
    "Copper Hill",
]
_PARTS = [
    "brake valve",
    "signal relay",
    "pantograph",
    "axle bearing",
    "door motor",
    "coupler",
    "traction inverter",
    "horn",
    "wiper",
    "battery pack",
    "cab heater",
    "track circuit",
]
_EVENTS = [
    "a pressure drop",
    "an intermittent fault",
    "a loud knock",
    "overheating",
    "a short circuit",
    "slow response",
    "a cracked housing",
    "low voltage",
    "an oil leak",
    "a stuck contact",
]
_ACTIONS = [
    "replaced the part",
    "tightened the fittings",
    "reset the controller",
    "logged it for the night shift",
    "cleaned the contacts",
    "ordered a spare",
    "ran a full test",
    "isolated the unit",
    "updated the firmware",
    "inspected the wiring",
]
FOLLOW_UPS = [
    "Which site is mentioned first?",
    "Name one part that failed.",
    "What did the crew do most often?",
    "Was anything isolated?",
    "Which event sounds most serious?",
    "Give the busiest hour.",
    "Was a spare ordered?",
    "Name another site.",
]


def maintenance_log(tokenizer, seed: int, n_tokens: int) -> str:
    """A deterministic maintenance log of about ``n_tokens`` tokens."""
    rng = random.Random(seed)
    lines = [f"Maintenance log {seed} of the {rng.choice(_SITES)} district."]
    text = lines[0]
    i = 0
    while True:
        for _ in range(8):
            i += 1
            lines.append(
                f"Entry {i}: at {rng.randrange(24):02d}:{rng.randrange(60):02d} the "
                f"{rng.choice(_PARTS)} on unit {rng.randrange(100, 999)} at {rng.choice(_SITES)} "
                f"showed {rng.choice(_EVENTS)}; the crew {rng.choice(_ACTIONS)}."
            )
        text = "\n".join(lines)
        if len(tokenizer.encode(text, add_special_tokens=False)) >= n_tokens:
            ids = tokenizer.encode(text, add_special_tokens=False)[:n_tokens]
            return tokenizer.decode(ids)


@dataclass
class Turn:
    """One turn of one conversation: tokens in and out, TTFT (seconds), cached prompt tokens."""

    conversation: int
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""


@dataclass
class RunResult:
    """One configuration's run: its turns, wall time (seconds), prompt tokens per source."""

    name: str
    turns: list[Turn]
    wall_s: float
    tokens_from: dict[str, int]
    offload: dict | None = None
    reloads_from: str | None = None
    """The ``tokens_from`` source this configuration exists to show reloads from (``host``,
    ``fs``), or None (the reference)."""


def doc_question(doc: str, follow: str | None = None) -> list[dict]:
    """The benchmarks' conversation about one maintenance log: the system prompt and ``doc`` with
    a question; with ``follow``, a fixed first reply and ``follow`` as the second turn (the turn
    that re-sends the history)."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{doc}\n\nQuestion: Which site is mentioned first?"},
    ]
    if follow:
        messages += [
            {"role": "assistant", "content": "North Yard."},
            {"role": "user", "content": follow},
        ]
    return messages


def chat(url: str, messages: list[dict], max_tokens: int, extra: dict | None = None) -> Turn:
    """One streamed chat completion: TTFT, token ids and usage. ``extra``: more request fields
    (``kv_transfer_params``, ``cache_salt``)."""
    body = {
        "model": "demo",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        **(extra or {}),
    }
    t = Turn(-1, -1)
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and not t.token_ids:
                    t.ttft_s = time.perf_counter() - t0
                t.token_ids.extend(ids)
                t.text += (choice.get("delta") or {}).get("content") or ""
            usage = chunk.get("usage")
            if usage:
                t.prompt_tokens = usage["prompt_tokens"]
                t.completion_tokens = usage.get("completion_tokens", 0)
                details = usage.get("prompt_tokens_details") or {}
                t.cached_tokens = details.get("cached_tokens") or 0
    t.latency_s = time.perf_counter() - t0
    return t


def round_order(n: int, r: int) -> list[int]:
    """Zig-zag order of conversations in round ``r``: forwards, then backwards, so neighbouring
    turns of a conversation are sometimes close (device or host hits) and sometimes far (fs)."""
    order = list(range(n))
    return order if r % 2 == 0 else order[::-1]


def opening(docs: list[str]) -> list[list[dict]]:
    """Each conversation's first prompt: the system prompt, its document and a question."""
    return [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{doc}\n\nQuestion: {FOLLOW_UPS[i % len(FOLLOW_UPS)]}"},
        ]
        for i, doc in enumerate(docs)
    ]


def run_workload(
    url: str,
    docs: list[str],
    turns: int,
    max_tokens: int,
    concurrency: int,
    reference: RunResult | None,
    histories: list[list[dict]] | None = None,
    extra: Callable[[int, int], dict | None] | None = None,
) -> list[Turn]:
    """Run every conversation's turns in rounds; with ``reference``, replay its replies.

    ``histories`` (from :func:`opening`), when given, is extended in place: afterwards each ends
    with the follow-up question of the next turn. ``extra(conversation, turn)``: more request
    fields for that turn (see :func:`chat`).
    """
    if histories is None:
        histories = opening(docs)
    ref = {(t.conversation, t.turn): t for t in reference.turns} if reference else {}
    results: list[Turn] = []

    def one(c: int, r: int) -> Turn:
        t = chat(url, histories[c], max_tokens, extra(c, r) if extra else None)
        t.conversation, t.turn = c, r
        return t

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for r in range(turns):
            done = list(pool.map(lambda c, r=r: one(c, r), round_order(len(docs), r)))
            for t in done:
                results.append(t)
                reply = ref[(t.conversation, r)].text if ref else t.text
                follow = FOLLOW_UPS[(t.conversation + r + 1) % len(FOLLOW_UPS)]
                histories[t.conversation] += [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": follow},
                ]
    return results


def log_name(name: str) -> str:
    """A configuration's name as part of a file name: no spaces or ``+`` (``host + fs`` ->
    ``host-fs``), so a path copied from a message needs no quoting."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")
