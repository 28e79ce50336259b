"""MCP tools run by the server (OpenAI Realtime's `{type: "mcp"}` tools), the pure part: the
session's MCP servers, what they list, the calls the model makes to them and the approvals the
client gives. The edge (mcp_client.py) talks to the servers and reports back.

- `session.update` with an MCP tool lists its server: an `mcp_list_tools` item, then
  `mcp_list_tools.in_progress` and `.completed` or `.failed` (with an `error` of ours saying
  why). The tools it lists, filtered by `allowed_tools`, are offered to the model beside the
  function tools, under their own names (`label__name` where a name is taken already). A server
  whose settings (URL, headers, filters) did not change is not listed again.
- The model calls one: an `mcp_call` output item, `response.mcp_call_arguments.delta` /
  `.done`, `response.mcp_call.in_progress`, and the server calls the tool; then
  `response.mcp_call.completed` or `.failed` and the item with its `output` or `error`. The
  result goes into the model's context as the tool's response, a part of the context of its own
  (`ModelContext`: in the call's place in the conversation, laid again after an edit before it,
  gone with its item); the model takes it once the reply that made the call has ended. The reply
  ends once its calls have, and the server asks for the next reply itself (tool choice "auto"),
  so the model speaks with the results, as a client does after a function call's output (at
  most MAX_FOLLOW_UPS in a row).
- A tool `require_approval` covers (by default every tool, as OpenAI's default is "always"):
  the call is an `mcp_approval_request` item instead, and nothing runs until the client creates
  an `mcp_approval_response`. Approved: the call runs (an `mcp_call` item outside any reply,
  with its `approval_request_id`) and the next reply follows its result; declined: the model is
  told so in its context (the response item's part of it) and the next reply follows.
- A server that cannot be reached, a timeout, a tool's own error: the `failed` event and the
  item's `error` say which; the session goes on, and the model is told the call failed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from duplex.engine.thinker_text import CallArguments, CallDone, Piece
from duplex.transport.effects import EnginePushText
from duplex.transport.realtime.conversation import Conversation, Item
from duplex.transport.realtime.errors import ProtocolError
from duplex.transport.realtime.events import ActiveResponse, EventWriter
from duplex.transport.realtime.model_context import ModelContext
from duplex.transport.realtime.session_config import (
    ConfigError,
    ResponseSettings,
    SessionSettings,
)

MAX_FOLLOW_UPS = 8
"""Replies the server asks for in a row after MCP calls (the model may call again in each)."""


@dataclass(frozen=True)
class McpServer:
    label: str
    url: str
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    """Sent to this server alone; never in a repr, a log line or an event."""


@dataclass(frozen=True)
class ListTools:
    """List `server`'s tools; the edge answers with `RealtimeProtocol.on_mcp_listed`."""

    item_id: str
    server: McpServer


@dataclass(frozen=True)
class CallTool:
    """Call `tool` on `server`; the edge answers with `RealtimeProtocol.on_mcp_called`."""

    item_id: str
    server: McpServer
    tool: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class McpTool:
    """A listed tool as the model is offered it."""

    server: str
    name: str
    model_name: str
    approval: bool


@dataclass
class _Running:
    item: Item
    output_index: int
    response_id: str | None
    """The reply whose output the call is in; None for a call an approval started."""
    in_conversation: bool
    depth: int
    """How many replies the server asked for in a row before the one that made the call."""


@dataclass
class _Server:
    config: dict[str, Any]
    server: McpServer
    item_id: str
    tools: list[dict[str, Any]] = field(default_factory=list)


class McpTools:
    def __init__(self, events: EventWriter, conversation: Conversation, context: ModelContext,
                 follow_up: Callable[[list, int], None]) -> None:
        """`follow_up(out, depth)`: ask for the next reply, the `depth`-th in a row."""
        self.events = events
        self.conversation = conversation
        self.context = context
        self.follow_up = follow_up
        self._servers: dict[str, _Server] = {}
        self._running: dict[str, _Running] = {}
        self._approvals: dict[str, tuple[McpTool, str, int]] = {}
        """Open approval requests by item id: the tool, its arguments, the reply depth."""

    # -- servers and their tools ----------------------------------------------------------

    def sync(self, out: list, settings: SessionSettings) -> None:
        """The session's MCP tools as `settings` has them: list the servers that are new or
        changed, forget the ones gone."""
        configs = {t["server_label"]: t for t in settings.tools if t.get("type") == "mcp"}
        for label in set(self._servers) - set(configs):
            del self._servers[label]
        for label, config in configs.items():
            server = McpServer(label, config["server_url"], settings.mcp_headers.get(label, {}))
            known = self._servers.get(label)
            if known is not None and known.config == config and known.server == server:
                continue
            item = Item(self.events.new_id("mcpl"), type="mcp_list_tools", server_label=label,
                        tools=[], status="in_progress")
            previous = self.conversation.append(item)
            self.events.emit(out, "conversation.item.added", item=item.as_wire(),
                             previous_item_id=previous)
            self.events.emit(out, "mcp_list_tools.in_progress", item_id=item.id)
            self._servers[label] = _Server(config, server, item.id)
            out.append(ListTools(item.id, server))

    def on_listed(self, out: list, item_id: str, tools: list[dict[str, Any]] | None,
                  error: dict[str, Any] | None) -> None:
        """What the edge heard from a server; only its latest listing offers tools."""
        current = next((s for s in self._servers.values() if s.item_id == item_id), None)
        item = self.conversation.find(item_id)
        if error is not None:
            if item is not None:
                item.status = "incomplete"
            self.events.emit(out, "mcp_list_tools.failed", item_id=item_id, error=error)
        else:
            allowed = [t for t in tools or () if current is None
                       or _matches(current.config.get("allowed_tools"), t, default=True)]
            if current is not None:
                current.tools = allowed
            if item is not None:
                item.tools, item.status = allowed, "completed"
            self.events.emit(out, "mcp_list_tools.completed", item_id=item_id)
        if item is not None:
            self.events.emit(out, "conversation.item.done", item=item.as_wire())

    def offered(self, tools: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
        """What the model is offered for `tools`: its function tools, and each MCP tool's
        listed tools as functions."""
        return self._offer(tools)[0]

    def _offer(self, tools: tuple[dict[str, Any], ...]
               ) -> tuple[tuple[dict[str, Any], ...], dict[str, McpTool]]:
        functions = [t for t in tools if t.get("type") != "mcp"]
        taken = {t["name"] for t in functions}
        offered, targets = list(functions), {}
        for config in tools:
            server = self._servers.get(config.get("server_label", "")) \
                if config.get("type") == "mcp" else None
            for tool in server.tools if server is not None else ():
                name = tool["name"]
                model_name = f"{server.server.label}__{name}" if name in taken else name
                taken.add(model_name)
                offered.append({"type": "function", "name": model_name,
                                "description": tool.get("description") or "",
                                "parameters": tool.get("input_schema") or {"type": "object"}})
                needs = _matches(server.config.get("require_approval"), tool, default=True)
                targets[model_name] = McpTool(server.server.label, name, model_name, needs)
        return tuple(offered), targets

    def resolve(self, settings: ResponseSettings, strict: bool = False) -> ResponseSettings:
        """`settings` as the model takes them: MCP tools as functions, an MCP tool choice as
        a choice among them. A choice no listed tool meets is an error when `strict` (a
        client's response.create), else the reply chooses freely ("auto"). Settings resolved
        once are left as they are."""
        if not any(t.get("type") == "mcp" for t in settings.tools):
            return settings
        offered, targets = self._offer(settings.tools)
        choice = settings.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "mcp":
            label = choice["server_label"]
            names = [n for n, t in targets.items()
                     if t.server == label and choice.get("name", t.name) == t.name]
            if len(names) == 1:
                choice = {"type": "function", "name": names[0]}
            elif names:
                choice = {"type": "function", "names": names}
            elif strict:
                what = f"a tool '{choice['name']}'" if "name" in choice else "any tool"
                raise ConfigError("invalid_value",
                                  f"Invalid value for 'tool_choice': the MCP server '{label}' "
                                  f"has not listed {what} (mcp_list_tools.completed lists what "
                                  "it has).", "tool_choice")
            else:
                choice = "auto"
        return replace(settings, tools=offered, tool_choice=choice, mcp_tools=targets)

    # -- calls the model makes --------------------------------------------------------------

    def new_call(self, r: ActiveResponse, name: str) -> Item | None:
        """The item of a call of `name`, when it names one of the reply's MCP tools; the call
        is part of the reply's context."""
        target = r.settings.mcp_tools.get(name)
        if target is None:
            return None
        kind = "mcp_approval_request" if target.approval else "mcp_call"
        return Item(self.events.new_id("mcp"), type=kind, server_label=target.server,
                    name=target.name, arguments="", status="in_progress", unit=r.item.unit)

    def on_piece(self, out: list, r: ActiveResponse, item: Item, output_index: int,
                 piece: Piece) -> None:
        """The model's call of an MCP tool, as it writes it."""
        where = {"response_id": r.id, "item_id": item.id, "output_index": output_index}
        emit = self.events.emit
        if isinstance(piece, CallArguments):
            item.arguments += piece.delta
            if item.type == "mcp_call":
                emit(out, "response.mcp_call_arguments.delta", **where, delta=piece.delta)
            return
        if not isinstance(piece, CallDone):
            return
        target = next(t for t in r.settings.mcp_tools.values()
                      if (t.server, t.name) == (item.server_label, item.name))
        item.arguments = piece.arguments
        in_conversation = r.settings.conversation != "none"
        if item.type == "mcp_approval_request":
            item.status = "completed"
            self._approvals[item.id] = (target, piece.arguments, r.settings.follow_up)
            self._item_done(out, item, r.id, output_index, in_conversation)
            return
        emit(out, "response.mcp_call_arguments.done", **where, arguments=item.arguments)
        r.pending.add(item.id)
        self._call(out, _Running(item, output_index, r.id, in_conversation, r.settings.follow_up),
                   target, r)

    def _call(self, out: list, running: _Running, target: McpTool,
              active: ActiveResponse | None) -> None:
        item = running.item
        self.events.emit(out, "response.mcp_call.in_progress", item_id=item.id,
                         output_index=running.output_index)
        self._running[item.id] = running
        server = self._servers.get(target.server)
        try:
            arguments = json.loads(item.arguments or "{}")
        except ValueError:
            arguments = None
        if server is None:
            self.on_called(out, item.id, None, _error(
                "protocol_error", f"the MCP tool '{target.server}' is no longer in the session",
                code=-32601), active)
        elif not isinstance(arguments, dict):
            self.on_called(out, item.id, None, _error(
                "tool_execution_error", "the model's arguments are not a JSON object"), active)
        else:
            out.append(CallTool(item.id, server.server, target.name, arguments))

    def on_called(self, out: list, item_id: str, output: str | None,
                  error: dict[str, Any] | None, active: ActiveResponse | None) -> None:
        """A call's result: its item is done, and its output or error is laid into the model's
        context in the item's place (where the item is in the conversation)."""
        running = self._running.pop(item_id, None)
        if running is None:
            return
        item = running.item
        if error is None:
            item.output, item.status = output, "completed"
            told = output or ""
        else:
            item.error, item.status = error, "incomplete"
            told = f"The call failed: {error['message']}"
        kind = "completed" if error is None else "failed"
        self.events.emit(out, f"response.mcp_call.{kind}", item_id=item.id,
                         output_index=running.output_index)
        here = active is not None and active.id == running.response_id
        if here:
            active.pending.discard(item.id)
        self._item_done(out, item, running.response_id if here else None,
                        running.output_index, running.in_conversation)
        if not running.in_conversation:
            return
        item.output_unit = self.context.lay(out, [EnginePushText(told, role="tool")])
        if running.response_id is None and active is None:
            self.follow_up(out, running.depth + 1)

    def _item_done(self, out: list, item: Item, response_id: str | None, output_index: int,
                   in_conversation: bool) -> None:
        if response_id is not None:
            self.events.emit(out, "response.output_item.done", response_id=response_id,
                             output_index=output_index, item=item.as_wire())
        if in_conversation and self.conversation.find(item.id) is not None:
            self.events.emit(out, "conversation.item.done", item=item.as_wire())

    def reply_done(self, out: list, r: ActiveResponse) -> None:
        """A reply ended (all its calls with it): the model speaks with their results."""
        if any(i.type == "mcp_call" for i in r.calls.values()) \
                and r.settings.conversation != "none":
            self.follow_up(out, r.settings.follow_up + 1)

    # -- approvals --------------------------------------------------------------------------

    def answered(self, response: Item) -> list:
        """What the client's `mcp_approval_response` lays into the model's context: a declined
        call, the user's refusal as the tool's response; an approved one, nothing (its call's
        output will). Raises ProtocolError unless it answers an approval request still open."""
        request_id = response.approval_request_id
        if request_id not in self._approvals:
            raise ProtocolError("invalid_value",
                                f"Invalid value for 'item.approval_request_id': no open "
                                f"mcp_approval_request '{request_id}' in the conversation.",
                                "item.approval_request_id")
        if response.approve:
            return []
        target = self._approvals[request_id][0]
        reason = f" ({response.reason})" if response.reason else ""
        return [EnginePushText(f"The user did not approve calling {target.name}{reason}.",
                               role="tool")]

    def on_approval(self, out: list, response: Item, active: ActiveResponse | None) -> None:
        """The client's `mcp_approval_response`, in the conversation with what it laid
        (`answered`): run the approved call, or let the model answer the refusal."""
        target, arguments, depth = self._approvals.pop(response.approval_request_id)
        if not response.approve:
            if active is None:
                self.follow_up(out, depth + 1)
            return
        item = Item(self.events.new_id("mcp"), type="mcp_call", server_label=target.server,
                    name=target.name, arguments=arguments,
                    approval_request_id=response.approval_request_id, status="in_progress")
        previous = self.conversation.append(item)
        self.events.emit(out, "conversation.item.added", item=item.as_wire(),
                         previous_item_id=previous)
        self._call(out, _Running(item, 0, None, True, depth), target, active)


def _matches(rule: Any, tool: dict[str, Any], default: bool) -> bool:
    """Whether an `allowed_tools` or `require_approval` setting covers `tool`: None is
    `default`; a list of names; "always" / "never"; a filter ({tool_names, read_only}); an
    approval filter ({always: filter, never: filter}, `never` first, else `default`)."""
    if rule is None:
        return default
    if isinstance(rule, str):
        return rule == "always"
    if isinstance(rule, list):
        return tool["name"] in rule
    if "always" in rule or "never" in rule:
        if _filter_matches(rule.get("never"), tool):
            return False
        return _filter_matches(rule.get("always"), tool) or default
    return _filter_matches(rule, tool)


def _filter_matches(rule: dict[str, Any] | None, tool: dict[str, Any]) -> bool:
    if not rule or (rule.get("tool_names") is None and rule.get("read_only") is None):
        return False
    names, read_only = rule.get("tool_names"), rule.get("read_only")
    hint = bool((tool.get("annotations") or {}).get("readOnlyHint"))
    return (names is None or tool["name"] in names) and (read_only is None or read_only == hint)


def _error(kind: str, message: str, code: int | None = None) -> dict[str, Any]:
    """An MCP item's error as OpenAI's Realtime items spell it."""
    error: dict[str, Any] = {"type": kind, "message": message}
    if code is not None:
        error["code"] = code
    return error
