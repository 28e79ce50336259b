"""`tool_choice` "required" and a named function as constrained decoding of the Thinker's reply.

Serving stacks enforce these with guided decoding: vLLM turns a named function into a JSON
schema for its arguments and "required" into a schema whose `name` is an enum of the tools.
Here the reply keeps the checkpoint's own calling convention (`<tool_call>` tags, as the chat
template teaches it), so the constraint is that convention with the name as the enum:

- head: the reply's first tokens are `<tool_call>\\n{"name": "NAME", "arguments": {` for one
  of the allowed names. Each name's head is tokenized by the checkpoint's own tokenizer (one
  token per byte in the tiny model, `<tool_call>` as one added token in a real one) and the
  heads form a trie of token ids: each step allows the children of the node reached.
- arguments: free, while the object's braces are tracked on each token's decoded text (strings
  and escapes respected).
- close: once the object closes, the tokens of what is left of `}\n</tool_call>`, then the
  end of the turn (a model that writes the closing tag inside its arguments has ended the
  call itself: the end of the turn follows). When the reply's token budget could just hold
  the closing (and a margin), the arguments are closed where they stand (open string, open
  brackets), so a forced call ends as a call within the reply's limit.

Pure: a per-reply state machine over token ids and their text, no tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

CLOSE_TAG = "</tool_call>"
CLOSE = "}\n" + CLOSE_TAG
MARGIN = 4
"""Tokens kept free for what the next free token may open: a token that opens more brackets
or strings than that, just before the limit, leaves the call unclosed when the reply is cut
(then reported as it stands, not JSON)."""
_END = -1
"""Trie key marking the end of a head."""


def head_text(name: str) -> str:
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {{'


def forced_names(tool_choice: str | dict[str, Any],
                 tools: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """The names a reply must call one of; () when the reply may answer without a call."""
    if isinstance(tool_choice, dict):
        return (tool_choice["name"],)
    if tool_choice == "required":
        return tuple(tool["name"] for tool in tools)
    return ()


class CallForcing:
    def __init__(self, names: Sequence[str], encode: Callable[[str], list[int]],
                 eos: int) -> None:
        if not names:
            raise ValueError("a forced call needs at least one function name")
        self._encode, self._eos = encode, eos
        self._node: dict[int, Any] = {}
        heads = [encode(head_text(name)) for name in names]
        self.overhead = max(map(len, heads)) + len(encode("}" + CLOSE)) + 1
        """Tokens of the longest call with empty arguments, its end of turn included."""
        for head in heads:
            node = self._node
            for token in head:
                node = node.setdefault(token, {})
            node[_END] = {}
        self.phase = "head"
        self._open, self._in_string, self._escape = "{", False, False
        """The arguments' unclosed brackets, innermost last; a string being written."""
        self._tail: list[int] = []
        self._arguments = ""

    def allowed(self, budget: int) -> list[int] | None:
        """The token ids the next token must be one of; None when any may come. `budget`:
        tokens the reply may still write, this one included."""
        if self.phase == "head":
            return [t for t in self._node if t != _END]
        if self.phase == "arguments":
            closing = self._encode(self._closing())
            if budget > len(closing) + 1 + MARGIN:
                return None
            self.phase, self._tail = "close", closing
        if self.phase == "close" and self._tail:
            return [self._tail[0]]
        return [self._eos]

    def advance(self, token: int, text: str) -> None:
        """The reply's next token, and its decoded text."""
        if self.phase == "head":
            self._node = self._node[token]
            if _END in self._node and len(self._node) == 1:
                self.phase = "arguments"
        elif self.phase == "arguments":
            self._arguments += text
            if CLOSE_TAG in self._arguments:
                # The model closed the call inside its arguments: it is over, as a parser
                # reads it (a call that is not JSON), and so is the reply.
                self.phase = "end"
            else:
                self._scan(text)
        elif self.phase == "close":
            self._tail.pop(0)
            if not self._tail:
                self.phase = "end"
        else:
            self.phase = "done"

    def _scan(self, text: str) -> None:
        for i, char in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._open += char
            elif char in "}]":
                self._open = self._open[:-1]
                if not self._open:
                    rest = text[i + 1:]
                    # A token may carry the call's own closing brace too (`}}` in a BPE).
                    left = CLOSE[len(rest):] if CLOSE.startswith(rest) else CLOSE
                    self._tail = self._encode(left)
                    self.phase = "close" if self._tail else "end"
                    return

    def _closing(self) -> str:
        """What ends the arguments where they stand, and then the call."""
        string = ("\\" if self._escape else "") + '"' if self._in_string else ""
        brackets = "".join("}" if char == "{" else "]" for char in reversed(self._open))
        return string + brackets + CLOSE
