"""The conversation as the model's context, for models that can rewind theirs.

Each conversation item lays a part of the model's context, a unit: a client's item, the input
audio not yet committed (the tail, which its commit makes an item's), a reply (with the function
and MCP calls it made), the output of an MCP call the server ran (a unit of its own, after the
reply that made the call: its `mcp_call` item holds both). The model holds units in the order they were laid (`rendered`); the
conversation wants its items' units in its own order, the tail last (`desired`). When the two
differ anywhere but at the end (an insert before the end, a deletion), the context goes back to
the first unit that differs (`EngineRewind`) and is laid again from there: units the model held
come back from the session's record of them (`EngineReplay`), new ones are laid for the first
time. The positions before the rewind keep their KV. An edit that would cut into the reply being
generated waits until that reply ends; edits at the end never wait.

Models that cannot rewind get every item's input at once, in arrival order, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from duplex.transport.effects import EngineMark, EngineReplay, EngineRewind
from duplex.transport.realtime.conversation import Conversation


class ModelContext:
    def __init__(self, conversation: Conversation, enabled: bool,
                 instructions: Callable[[], tuple[str, tuple[dict[str, Any], ...]]]) -> None:
        self.conversation = conversation
        self.enabled = enabled
        self.instructions = instructions
        """The session's instructions and tools as the engine was last told them."""
        self.rendered: list[int] = []
        self.new: dict[int, list] = {}
        """What lays each unit the model has not held yet."""
        self.tail: int | None = None
        self._next = 0

    def _key(self) -> int:
        self._next += 1
        return self._next - 1

    def lay(self, out: list, effects: list) -> int | None:
        """A new item's input: held to be laid in the item's place at the next `sync`, or (a
        model that cannot rewind) pushed at once. Returns the item's unit."""
        if not self.enabled:
            out += effects
            return None
        key = self._key()
        self.new[key] = effects
        return key

    def open_tail(self, out: list) -> None:
        """Input audio is about to reach the model: until committed it lays a unit of its own."""
        if self.enabled and self.tail is None:
            self.tail = self._key()
            self.rendered.append(self.tail)
            out.append(EngineMark(self.tail))

    def commit_tail(self) -> int | None:
        """The uncommitted audio became an item: its unit."""
        if not self.enabled:
            return None
        key, self.tail = self.tail, None
        if key is None:
            key = self._key()
            self.new[key] = []
        return key

    def drop_tail(self) -> None:
        """The uncommitted audio was cleared: it leaves the context at the next `sync`."""
        self.tail = None

    def begin_reply(self, out: list) -> int | None:
        """A reply is about to begin: the context is brought to the conversation first, and the
        reply's unit starts here (whether or not its items join the conversation)."""
        if not self.enabled:
            return None
        self.sync(out)
        key = self._key()
        self.rendered.append(key)
        out.append(EngineMark(key))
        return key

    def desired(self) -> list[int]:
        units: list[int] = []
        for item in self.conversation:
            units += [unit for unit in item.units if unit not in units]
        if self.tail is not None:
            units.append(self.tail)
        return units

    def sync(self, out: list, active: int | None = None) -> None:
        """Lay what the conversation holds and the model does not; `active` is the unit of the
        reply being generated, which no rewind may cut."""
        if not self.enabled:
            return
        desired = self.desired()
        if desired == self.rendered:
            return
        same = 0
        for have, want in zip(self.rendered, desired, strict=False):
            if have != want:
                break
            same += 1
        rest = self.rendered[same:]
        if rest:
            if active is not None and active in rest:
                return
            # Back at the head, the system turn opening the context is the session's latest.
            out.append(EngineRewind(rest[0], self.instructions() if same == 0 else None))
        for key in desired[same:]:
            if key in rest:
                out.append(EngineReplay(key))
            else:
                out.append(EngineMark(key))
                out += self.new.pop(key, [])
        self.rendered = desired
        # What is still new belongs to no item any more (created, then deleted unlaid).
        self.new.clear()

    def restore(self, units: list[int]) -> None:
        """A resumed session's context holds `units` in this order (as the record rebuilt it);
        a last one no item names is the input that was not yet committed."""
        self.rendered = list(units)
        named = {unit for item in self.conversation for unit in item.units}
        if units and units[-1] not in named:
            self.tail = units[-1]
        known = [*units, *named]
        self._next = max(known, default=-1) + 1
