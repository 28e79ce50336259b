"""Shared pieces of the agent-framework tests: a `duplex serve` per test (echo or the tiny
Qwen3-Omni), speech to say, real-time pacing, waits with deadlines, the steps every framework
runs and the checks each session ends with.

Each framework drives the server through its own public API; what it received is recorded as
the raw server events (dicts), so a failure names the server's own error messages. A test
collects everything wrong across its sessions and fails once, listing it all.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest

from duplex.bench.synth import babble
from tests.waiting import eventually

RATE = 24000
CHUNK_MS = 40


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def utterance(speech_s: float, seed: int, lead_s: float = 0.3, tail_s: float = 0.9) -> bytes:
    """Synthetic speech silero-vad hears as speech, between silences: PCM16 at 24 kHz.

    The tail is longer than the server VAD's 500 ms of silence, so the turn ends inside it.
    """
    speech = babble(int(RATE * speech_s), seed=seed)
    lead = np.zeros(int(RATE * lead_s), np.float32)
    tail = np.zeros(int(RATE * tail_s), np.float32)
    return pcm16(np.concatenate([lead, speech, tail]))


async def stream(send: Callable[[bytes], Any], audio: bytes, chunk_ms: int = CHUNK_MS) -> None:
    """Say `audio` the way a microphone would: one chunk every chunk_ms, on a wall-clock
    schedule (the server refuses audio that runs far ahead of real time)."""
    step = RATE * 2 * chunk_ms // 1000
    start = time.monotonic()
    for n, i in enumerate(range(0, len(audio), step)):
        result = send(audio[i : i + step])
        if inspect.isawaitable(result):
            await result
        delay = start + (n + 1) * chunk_ms / 1000 - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


async def wait_until(condition: Callable[[], bool], timeout: float, what: str,
                     wire: Wire | None = None) -> None:
    """Poll `condition` until it holds; AssertionError naming `what` (and any server errors
    seen so far) once `timeout` seconds have passed."""
    def done_or_gone() -> bool:
        return condition() or (wire is not None and bool(wire.client_gone()))

    await eventually(done_or_gone, None, timeout)
    if condition():
        return
    seen = f"\nserver events so far: {wire.summary()}" if wire is not None else ""
    if wire is not None and (why := wire.client_gone()):
        raise AssertionError(f"gave up waiting for {what}: {why}{seen}")
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{seen}")


class Wire:
    """The raw server events one client received, in order, and what the client itself
    reported as wrong (validation failures, error callbacks)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.client_problems: list[str] = []
        self.gone: Callable[[], str | None] = lambda: None
        """Why the client will read no more events (a framework that stops on an error),
        or None: waits give up at once instead of running out their time."""

    def client_gone(self) -> str | None:
        return self.gone()

    def add(self, event: dict[str, Any] | str | bytes) -> None:
        if isinstance(event, (str, bytes)):
            event = json.loads(event)
        self.events.append(event)

    def of(self, type_: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == type_]

    def count(self, type_: str) -> int:
        return len(self.of(type_))

    def errors(self) -> list[dict[str, Any]]:
        return self.of("error")

    def responses_done(self) -> list[dict[str, Any]]:
        return [e["response"] for e in self.of("response.done")]

    def summary(self) -> str:
        errors = [e.get("error", {}) for e in self.errors()]
        text = ", ".join(f"{e.get('code')}: {e.get('message')}" for e in errors) or "none"
        return f"{len(self.events)} events; errors: [{text}]"


def error_lines(wire: Wire, allowed_codes: frozenset[str] = frozenset()) -> list[str]:
    return [
        f"server sent error {e['error'].get('code')!r} (param {e['error'].get('param')!r}): "
        f"{e['error'].get('message')}"
        for e in wire.errors()
        if e.get("error", {}).get("code") not in allowed_codes
    ]


def report(problems: list[str]) -> str:
    """The problems one per line, repeats folded into a count, first-seen order kept."""
    counts: dict[str, int] = {}
    for p in problems:
        counts[p] = counts.get(p, 0) + 1
    return "\n".join(p if n == 1 else f"{p} (x{n})" for p, n in counts.items())


async def active_sessions(server) -> int:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{server.url}/healthz", timeout=2)).json()["active_sessions"]


async def sessions_drained(server, timeout: float = 2.0) -> str | None:
    """None once /healthz reports no active session; else what it still reports."""
    async def drained() -> bool:
        return await active_sessions(server) == 0

    if await eventually(drained, None, timeout):
        return None
    count = await active_sessions(server)
    return f"/healthz still reports active_sessions={count} {timeout:.0f}s after the client closed"


async def voice_turns(c, problems: list[str]) -> None:
    """The spoken part every framework test runs, through the framework's client `c`:

    - `c.say(pcm)`: stream PCM16 into the framework as its audio input (real-time paced);
    - `c.wire`: the raw server events it received;
    - `c.heard(response_id)`: reply audio bytes the framework delivered for that response;
    - `c.truncate_sent(item_id)`: whether it sent conversation.item.truncate (None: can't tell).

    A spoken turn that server VAD ends, then a second one talked over once 600 ms of its
    reply has arrived (the framework truncates the reply it was playing, the server cancels
    it), then the turn that barge-in started, which must get a reply of its own (the session
    is closed while that reply plays). Wrong outcomes go into `problems`; a wait that runs
    out raises AssertionError (the rest stand on it).
    """
    wire = c.wire

    def created(n: int) -> str | None:
        ids = [e["response"]["id"] for e in wire.of("response.created")]
        return ids[n - 1] if len(ids) >= n else None

    await c.say(utterance(0.8, seed=1))
    await wait_until(lambda: len(wire.responses_done()) >= 1, 30, "response.done #1", wire)
    first = wire.responses_done()[0]
    if first["status"] != "completed":
        problems.append(f"turn 1: the reply ended {first['status']}")
    await wait_until(lambda: c.heard(first["id"]) > 0, 5, "turn 1's reply audio in the client", wire)

    await c.say(utterance(1.2, seed=2))
    await wait_until(lambda: created(2) is not None, 20, "the second response", wire)
    second = created(2)
    await wait_until(lambda: c.heard(second) >= RATE * 2 * 6 // 10, 20,
                     "600 ms of the second reply in the client", wire)
    item = next(e["item"]["id"] for e in wire.of("response.output_item.added")
                if e["response_id"] == second)
    await c.say(utterance(0.8, seed=3, lead_s=0.0, tail_s=0.7))
    await wait_until(lambda: any(r["id"] == second for r in wire.responses_done()), 10,
                     "response.done of the talked-over reply", wire)
    status = next(r["status"] for r in wire.responses_done() if r["id"] == second)
    if status != "cancelled":
        problems.append(f"barge-in: the talked-over reply ended {status}")

    await wait_until(lambda: created(3) is not None, 20,
                     "a response to the turn that talked over the reply", wire)
    await wait_until(lambda: c.heard(created(3)) > 0, 10,
                     "the reply audio of the turn after the barge-in in the client", wire)
    if c.truncate_sent(item) is False:
        problems.append("barge-in: the client sent no conversation.item.truncate for the "
                        "talked-over reply")
    elif not any(e["item_id"] == item for e in wire.of("conversation.item.truncated")):
        problems.append("barge-in: no conversation.item.truncated answered the client's "
                        "conversation.item.truncate of the talked-over reply")


async def text_reply_to_speech(c, problems: list[str]) -> None:
    """A spoken turn in a session configured for text output (output_modalities ["text"],
    as when the agent speaks through a TTS of its own): the reply must be text, spelled as
    text (response.output_text.*, content parts of type text, no audio events), and reach
    the framework (`c.text(response_id)`: characters of reply text it delivered)."""
    wire = c.wire
    await c.say(utterance(0.6, seed=4))
    await wait_until(lambda: len(wire.responses_done()) >= 1, 30, "response.done", wire)
    reply = wire.responses_done()[0]
    if reply["status"] != "completed":
        problems.append(f"text-only reply: it ended {reply['status']}")
    mine = [e for e in wire.events if e.get("response_id") == reply["id"]]
    audio = sorted({e["type"] for e in mine if "audio" in e["type"]})
    if audio:
        problems.append(f"text-only reply: the server sent {audio}, where a text reply has "
                        "response.output_text.delta / .done and no audio events")
    if not any(e["type"] == "response.output_text.done" for e in mine):
        problems.append("text-only reply: no response.output_text.done")
    parts = sorted({e["part"]["type"] for e in mine if e["type"].startswith("response.content_part.")})
    if parts != ["text"]:
        problems.append(f"text-only reply: content parts of type {parts}, not ['text']")
    content = [p.get("type") for i in reply.get("output") or [] for p in i.get("content") or []]
    if content != ["output_text"]:
        problems.append(f"text-only reply: response.done output content {content}, "
                        "not ['output_text']")
    await wait_until(lambda: c.text(reply["id"]) > 0, 5, "the reply text in the client", wire)


def session_config_problems(wire: Wire, tools: list[str], voice: str | None,
                            transcription: bool = False) -> list[str]:
    """What the last session.updated leaves out of what the framework configured."""
    session = wire.of("session.updated")[-1]["session"]
    out = []
    names = [t.get("name") for t in session.get("tools") or []]
    if names != tools:
        out.append(f"session.updated lists tools {names}, not the {tools} the client set")
    audio = session.get("audio") or {}
    if voice is not None and (got := (audio.get("output") or {}).get("voice")) != voice:
        out.append(f"session.updated has voice {got!r}, not the {voice!r} the client set")
    if transcription and not (got := (audio.get("input") or {}).get("transcription")):
        out.append(f"session.updated has input transcription {got!r}, not the one the client set")
    return out


async def run_sessions(server, make_client: Callable[..., Any],
                       phases: list[tuple[str, Callable[[Any, list[str]], Any]]]) -> list[str]:
    """One client session per phase, one after another, against `server`.

    The "text-only" phase's client is made with text output (`make_client(text_only=True)`).
    Each phase's steps get the open client and a list for what went wrong; then the client
    closes itself (its own close), its own complaints are added (`client.problems()`: error
    events, validation failures) and /healthz must be back to no active session. Returns
    everything found, each line prefixed with its phase.
    """
    problems: list[str] = []
    for name, steps in phases:
        client = make_client(text_only=name == "text-only")
        found: list[str] = []
        async with client as c:
            try:
                await steps(c, found)
            except AssertionError as exc:  # a step never finished: the rest stand on it
                found.append(str(exc))
        found += client.problems()
        if (leak := await sessions_drained(server)) is not None:
            found.append(leak)
        problems += [f"[{name}] {p}" for p in found]
    return problems


@pytest.fixture(params=["echo", "tiny-omni"])
def duplex_server(request, server_process):
    """`duplex serve` with the echo model or the tiny random-weight Qwen3-Omni."""
    if request.param == "echo":
        server = server_process("--model", "echo")
    else:
        server = server_process("--model", str(request.getfixturevalue("tiny_omni_dir")))
    server.model_kind = request.param
    return server


@pytest.fixture
def kit():
    """The helpers above, for the test modules (conftest is not importable under
    --import-mode=importlib)."""
    return SimpleNamespace(
        RATE=RATE, utterance=utterance, stream=stream, wait_until=wait_until, Wire=Wire,
        error_lines=error_lines, report=report, run_sessions=run_sessions,
        voice_turns=voice_turns, text_reply_to_speech=text_reply_to_speech,
        session_config_problems=session_config_problems,
    )
