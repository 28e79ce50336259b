"""Splitting the Thinker's text stream into what is said and the tool calls it writes.

Qwen3-family chat templates have the model write a call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Nothing inside the tags is voiced or
sent as transcript. The call streams out as it is written: its name once the JSON has named it,
then the arguments' text piece by piece, then the whole call when the closing tag arrives. A
call that is not that JSON is still reported whole, with its raw text as the arguments.

Pure and incremental: `feed(text)` takes any split of the stream (a tag may arrive a byte at a
time) and returns the pieces it can already tell apart; `finish()` flushes the rest.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(frozen=True, slots=True)
class Speech:
    text: str


@dataclass(frozen=True, slots=True)
class CallStarted:
    index: int
    """Which call of the reply, from 0."""
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    delta: str


@dataclass(frozen=True, slots=True)
class CallDone:
    index: int
    name: str
    arguments: str
    valid: bool
    """False when the model's text was not a JSON call: `arguments` is then the raw text."""


Piece = Speech | CallStarted | CallArguments | CallDone


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkerText:
    def __init__(self) -> None:
        self._pending = ""
        """Text not yet told apart: a possible tag start, or the inside of a call."""
        self._in_call = False
        self._calls = 0
        self._name: str | None = None
        self._streamed = 0
        """Characters of the current call's arguments already sent as deltas."""

    @property
    def in_call(self) -> bool:
        return self._in_call

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        out: list[Piece] = []
        while True:
            if not self._in_call:
                at = self._pending.find(OPEN)
                if at < 0:
                    keep = _held_prefix(self._pending, OPEN)
                    said = self._pending[: len(self._pending) - keep]
                    if said:
                        out.append(Speech(said))
                    self._pending = self._pending[len(said):]
                    return out
                if at:
                    out.append(Speech(self._pending[:at]))
                self._pending = self._pending[at + len(OPEN):]
                self._in_call, self._name, self._streamed = True, None, 0
                continue
            end = self._pending.find(CLOSE)
            if end < 0:
                out += self._stream(self._pending[: len(self._pending) - _held_prefix(
                    self._pending, CLOSE)])
                return out
            body = self._pending[:end]
            self._pending = self._pending[end + len(CLOSE):]
            out += self._stream(body)
            out.append(self._done(body))

    def finish(self) -> list[Piece]:
        """The stream ended: what is left is speech, or an unclosed call reported whole."""
        rest, self._pending = self._pending, ""
        if self._in_call:
            return [*self._stream(rest), self._done(rest)]
        return [Speech(rest)] if rest else []

    def _stream(self, body: str) -> list[Piece]:
        """Name the call once its JSON has named it; then send the arguments object's new
        text, holding back what may still turn out to be the call's own closing brace."""
        out: list[Piece] = []
        head = _HEAD.match(body)
        if head is None:
            return out
        if self._name is None:
            self._name = json.loads(f'"{head.group(1)}"')
            out.append(CallStarted(self._calls, self._name))
        args = _arguments_text(body, head)
        if args is not None and len(args) > self._streamed:
            out.append(CallArguments(self._calls, args[self._streamed:]))
            self._streamed = len(args)
        return out

    def _done(self, body: str) -> CallDone:
        index = self._calls
        self._calls += 1
        self._in_call = False
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return CallDone(index, self._name or "", body.strip(), False)
        arguments = call.get("arguments", {})
        head = _HEAD.match(body)
        streamed = _arguments_text(body, head) if head is not None else None
        if isinstance(arguments, dict) and streamed is not None:
            # As written, so the deltas already sent add up to exactly this.
            text = streamed
        elif isinstance(arguments, str):
            text = arguments
        else:
            text = json.dumps(arguments)
        return CallDone(index, call["name"], text, True)


def _arguments_text(body: str, head: re.Match) -> str | None:
    """The arguments object's text written so far, without the call's closing brace; None if
    the arguments are not an object (they are then sent whole, when the call is done)."""
    args = body[head.end():].rstrip()
    if not args.startswith("{"):
        return None
    return args[:-1] if args.endswith("}") else args
