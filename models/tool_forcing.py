"""Tool calls whose arguments follow the tool's JSON schema, as constrained decoding of the
Thinker's reply, batched per step with the reply rows that are free.

The reply keeps the checkpoint's own calling convention (the chat template teaches
`<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`), and llguidance (the
structured-generation library vLLM and SGLang use) holds it to a grammar of that convention
whose JSON is `{"name": one of the allowed names, "arguments": that tool's `parameters`}`:

- `tool_choice` "required" or a named tool (`forced_names`): the reply opens with the call and
  its turn ends right after it.
- a call the model starts on its own (it wrote `<tool_call>`): always, from there to its
  closing tag; then the reply is free again. Nothing is asked of a client for it, and nothing
  changes until a model writes a call, which then parses and validates as a forced one does.

The JSON is written as `json.dumps` writes it (", " and ": ", no other whitespace), so a model
cannot pad it without end, and an object schema that names its `properties` allows no others
unless it says so (`additionalProperties`), as xgrammar's strict mode has it: a constrained
model writes the keys the tool names.

A call must end within the reply's token limit. Where the tokens left come near what the call
still needs, the rest of it is its shortest ending: the grammar run ahead of the model with a
closing-first choice where it allows several tokens (`_closing`). How near is near: the most
one free token can add to that need (`growth`: the longest shortest instance of any part of
the schema, per token), times the tokens written since it was last measured.

Per row and step, on the host: llguidance writes the row's allowed tokens as a bitmask;
`CallMasks` takes every constrained row's mask to the device in one copy and applies them.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

log = logging.getLogger("duplex.models")

OPEN, CLOSE = "<tool_call>", "</tool_call>"
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False,
              "lenient": True}
"""`lenient`: a keyword llguidance does not implement is ignored, not an error."""
MARGIN = 2
"""Tokens kept spare on top of the measured need."""
CLOSING_STEPS = 4096
"""A closing longer than this is not looked for (a pattern the closing-first choice loops
in): the call is then constrained but may be cut by the reply's limit."""
_CLOSERS = '}]"'
_FILL = ',:0{[ntf-123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ. '
_IN_STRING = "q"
"""Allowed only inside a string (outside, JSON's letters start true, false and null)."""
CACHED = 256
"""Schemas and call grammars a vocabulary remembers what it measured of (sessions send the
same tools reply after reply)."""


def forced_names(tool_choice: str | dict[str, Any],
                 tools: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """The names a reply must call one of; () when the reply may answer without a call.
    A choice dict names one tool (`name`) or several (`names`: one of a server's tools)."""
    if isinstance(tool_choice, dict):
        return tuple(tool_choice["names"]) if "names" in tool_choice else (tool_choice["name"],)
    if tool_choice == "required":
        return tuple(tool["name"] for tool in tools)
    return ()


def strict(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that lists its
    properties and says nothing of others."""
    schema = copy.deepcopy(schema)
    for node in _nodes(schema):
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
    return schema


def _nodes(schema: Any) -> Iterator[dict[str, Any]]:
    """Every subschema of `schema`, itself included."""
    if not isinstance(schema, dict):
        return
    yield schema
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        for sub in (schema.get(key) or {}).values():
            yield from _nodes(sub)
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains"):
        yield from _nodes(schema.get(key))
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            yield from _nodes(sub)


def arguments_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """What a tool's arguments must be: its `parameters`, strict; an object when it has none."""
    parameters = tool.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        parameters = {"type": "object", "properties": {}}
    return strict(parameters)


class Vocabulary:
    """llguidance's view of a model's tokenizer (built once: for a real tokenizer ~1 s), and
    what the closing-first choice prefers among the tokens a grammar allows."""

    def __init__(self, tokenizer, n_vocab: int, eos: int) -> None:
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab, eos)
        self.n_vocab, self.eos = n_vocab, eos
        self.words = (n_vocab + 31) // 32

        def ids(chars: str) -> np.ndarray:
            single = [self.tokenizer.tokenize_str(c) for c in chars]
            return np.array([t[0] for t in single if len(t) == 1], dtype=np.int64)

        self.closers, self.others = ids(_CLOSERS), ids(_FILL)
        self.in_string = ids(_IN_STRING)
        self.quote = ids('"')
        self.per_token = max(1, max(
            sum(self.tokenizer.decode_bytes([t]).count(c) for c in b'{[,"')
            for t in range(n_vocab)))
        """The most JSON structures one token can open (1 for a byte-level vocabulary)."""
        self._schemas: dict[str, tuple[str, int]] = {}
        self._needs: dict[tuple[str, tuple[str, ...], bool], tuple[int, ...]] = {}

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer.tokenize_str(text)

    def needs(self, grammar: str, names: tuple[str, ...], opened: bool) -> tuple[int, ...]:
        """Per name, the tokens of the shortest call of it that `grammar` allows."""

        def measure() -> tuple[int, ...]:
            import llguidance

            start = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            out = []
            for name in names:
                head = self.tokens(f'{"" if opened else OPEN}\n{{"name": {json.dumps(name)}, '
                                   '"arguments": ')
                m = start.deep_copy()
                m.consume_tokens(head)
                path = closing(self, m, ends_turn=not opened)
                out.append(len(head) + (len(path) if path is not None else 0))
            return tuple(out)

        return _remember(self._needs, (grammar, names, opened), measure)

    def checked(self, tool: dict[str, Any]) -> tuple[str, dict[str, Any], int]:
        """The tool's arguments schema, and the most tokens one token can add to what a call
        of it needs to end; a schema llguidance cannot compile is replaced by any object."""
        name = tool["name"]
        schema = arguments_schema(tool)

        def check() -> tuple[str, int]:
            import llguidance

            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
            problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
            held = schema
            if problem:
                log.warning("tool %r: its parameters cannot constrain a call (%s); its "
                            "arguments are held to a JSON object", name, problem)
                held = {"type": "object"}
            return json.dumps(held), self._growth(held)

        text, growth = _remember(self._schemas, json.dumps(schema, sort_keys=True), check)
        return name, json.loads(text), growth

    def _growth(self, schema: dict[str, Any]) -> int:
        """The most tokens one free token can add to what a call needs to end: opening a
        value (its shortest instance), or a comma opening the next property or item (its key
        and shortest value), times the structural characters one token can hold."""
        import llguidance

        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}

        def shortest(node: Any) -> int:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                {**node, **defs} if isinstance(node, dict) else {}, overrides=JSON_STYLE)
            path = closing(self, llguidance.LLMatcher(self.tokenizer, grammar, log_level=0),
                           ends_turn=False)
            return 1 if path is None else len(path)

        comma = len(self.tokens(", "))
        longest = 1
        for node in _nodes(schema):
            if node is not schema:
                longest = max(longest, shortest(node))
            for key, sub in (node.get("properties") or {}).items():
                longest = max(longest, len(self.tokens(f", {json.dumps(key)}: ")) + shortest(sub))
            if node.get("type") == "object" and node.get("additionalProperties") is not False:
                longest = max(longest, len(self.tokens(', "": 0')))
            if isinstance(node.get("items"), dict):
                longest = max(longest, comma + shortest(node["items"]))
        return self.per_token * longest


def _remember(cache: dict, key, make):
    if key not in cache:
        if len(cache) >= CACHED:
            del cache[next(iter(cache))]
        cache[key] = make()
    return cache[key]


def closing(vocab: Vocabulary, matcher, ends_turn: bool) -> list[int] | None:
    """The tokens that end what `matcher` holds soonest by a closing-first choice (its end of
    turn included when `ends_turn`); None when none is found within CLOSING_STEPS."""
    m = matcher.deep_copy()
    path: list[int] = []
    while len(path) < CLOSING_STEPS and not m.is_error():
        if m.is_accepting():
            return [*path, vocab.eos] if ends_turn else path
        forced = m.compute_ff_tokens()
        if forced:
            m.consume_tokens(forced)
            path += forced
            continue
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
        if bits[vocab.in_string].any():
            # Inside a string a closing brace is text: the quote ends it.
            order = (vocab.quote, vocab.others, vocab.closers)
        else:
            order = (vocab.closers, vocab.others)
        token = next((int(c[bits[c] == 1][0]) for c in order if bits[c].any()), None)
        if token is None:
            token = int(np.flatnonzero(bits)[0])
        m.consume_token(token)
        path.append(token)
    return None


class CallForcing:
    """One reply's tool call, held to its grammar token by token. Pure host state: `fill`
    writes the next token's bitmask row, `advance` takes the token the reply wrote."""

    def __init__(self, vocab: Vocabulary, tools: Sequence[dict[str, Any]],
                 names: Sequence[str], *, opened: bool = False) -> None:
        """`names`: the tools the call may name (each in `tools`). `opened`: the model has
        written the call's opening tag itself, and goes on freely once the call is closed;
        otherwise the reply is the call and ends with it."""
        import llguidance

        if not names:
            raise ValueError("a call needs at least one tool name")
        by_name = {tool["name"]: tool for tool in tools}
        checked = [vocab.checked(by_name.get(name, {"name": name})) for name in names]
        choices = [{"type": "object", "properties": {"name": {"const": name},
                                                     "arguments": schema},
                    "required": ["name", "arguments"], "additionalProperties": False}
                   for name, schema, _ in checked]
        call = {"anyOf": choices, "x-guidance": JSON_STYLE}
        head = "" if opened else f"{json.dumps(OPEN)} "
        lark = f'start: {head}"\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(call)}\n'
        self._vocab, self.ends_turn = vocab, not opened
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        self._m = llguidance.LLMatcher(vocab.tokenizer, grammar, log_level=0)
        if self._m.is_error():
            raise ValueError(f"tool call grammar: {self._m.get_error()}")
        needs = vocab.needs(grammar, tuple(names), opened)
        self.overhead = max(needs)
        """Tokens of the longest shortest call (its end of turn included when it ends one)."""
        self.growth = max([g for _, _, g in checked] + [max(needs) - min(needs) + 1])
        self._need, self._since = min(needs), 0
        self._path: list[int] = []

    @property
    def broken(self) -> bool:
        """The reply went where the grammar does not (text the model wrote before the call
        was constrained): the call is left as written."""
        return self._m.is_error()

    @property
    def finished(self) -> bool:
        """The call is closed (a reply that goes on is free again)."""
        return self._m.is_accepting()

    def fill(self, row: np.ndarray, budget: int) -> None:
        """Write the next token's allowed set into `row` (int32 bitmask words). `budget`:
        tokens the reply may still write, this one included."""
        if not self._path:
            bound = self._need + (self._since + 1) * self.growth + MARGIN
            if budget <= bound:
                path = closing(self._vocab, self._m, self.ends_turn)
                if path is not None:
                    self._need, self._since = len(path), 0
                    if budget <= len(path) + self.growth + MARGIN:
                        self._path = path
        if self._path:
            row[:] = 0
            token = self._path[0]
            row.view(np.uint32)[token >> 5] = np.uint32(1 << (token & 31))
        else:
            self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def advance(self, token: int) -> None:
        if self._path:
            self._path.pop(0)
        else:
            self._since += 1
        if not self._m.consume_token(token):
            log.warning("a tool call took a token its grammar refused: %s", self._m.get_error())


class CallMasks:
    """Applies the constrained rows' bitmasks to a step's logits: filled on the host, taken to
    the device in one copy (from pinned memory, without waiting, on CUDA), unpacked there.

    The host buffer is written again at the next step; the step's token readback has waited
    for the copy by then."""

    def __init__(self, vocab_size: int, device) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.words = (vocab_size + 31) // 32
        self._host = self._buffer(8)
        self._shifts = torch.arange(32, dtype=torch.int32, device=self.device)

    def _buffer(self, rows: int) -> torch.Tensor:
        """Per row: its index in the batch, then its bitmask words."""
        return torch.empty((rows, 1 + self.words), dtype=torch.int32,
                           pin_memory=self.device.type == "cuda")

    def apply(self, logits: torch.Tensor, raw: torch.Tensor,
              rows: Sequence[tuple[int, CallForcing, int]]) -> None:
        """Each (batch row, its forcing, its budget): the row keeps only the tokens its call
        allows, with the model's own scores from `raw` (so sampling still chooses among
        them), the suppressed ones included: a token the grammar allows is the template's,
        even where free text may not write it."""
        if len(rows) > len(self._host):
            self._host = self._buffer(2 * len(rows))
        host = self._host[: len(rows)]
        table = host.numpy()
        for i, (b, forcing, budget) in enumerate(rows):
            table[i, 0] = b
            forcing.fill(table[i, 1:], budget)
        table = host.to(self.device, non_blocking=True)
        index = table[:, 0].long()
        bits = (table[:, 1:, None] >> self._shifts) & 1
        allowed = bits.flatten(1)[:, : self.vocab_size].bool()
        logits[index] = torch.where(allowed, raw[index], -torch.inf)
