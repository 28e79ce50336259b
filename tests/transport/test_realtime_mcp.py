"""MCP tools the server runs, through the pure Realtime core: what a session.update with an MCP
tool lists, what the model is offered, a call's events and its result in the model's context,
approvals, failures that leave the session going, and headers that reach no event or record.
The edge's answers (`on_mcp_listed`, `on_mcp_called`) are fed as the MCP client gives them."""

import json

import pytest

from duplex.engine.thinker_text import CallArguments, CallDone, CallStarted
from duplex.transport.effects import (
    EngineCommit,
    EngineInstruct,
    EngineMark,
    EnginePushText,
    EngineReplay,
    EngineRewind,
    Send,
)
from duplex.transport.realtime.mcp import MAX_FOLLOW_UPS, CallTool, ListTools
from duplex.transport.realtime.protocol import Limits, RealtimeProtocol
from duplex.transport.realtime.session_config import SessionSettings

SECRET = "Bearer s3cret-token"
TOOLS = [
    {"name": "add", "description": "Add two integers.",
     "input_schema": {"type": "object", "required": ["a", "b"],
                      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}},
    {"name": "lookup", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
     "annotations": {"readOnlyHint": True}},
    {"name": "wipe", "input_schema": {"type": "object", "properties": {}}},
]


def mcp_tool(**over):
    return {"type": "mcp", "server_label": "calc", "server_url": "http://127.0.0.1:9/mcp",
            "headers": {"Authorization": SECRET}, "require_approval": "never", **over}


def make():
    p = RealtimeProtocol("sess_t", model="echo", model_input_rate=24000, model_output_rate=24000,
                         limits=Limits(max_errors=1000))
    p.start()
    send(p, type="session.update", session={"audio": {"input": {"turn_detection": None}}})
    return p


def send(p, **event):
    return p.receive_text(json.dumps(event))


def events(effects):
    return [e.event for e in effects if isinstance(e, Send)]


def types(effects):
    return [e["type"] for e in events(effects)]


def of(effects, kind):
    return [e for e in effects if isinstance(e, kind)]


def listed(p, tools=TOOLS, **over):
    """A session whose MCP server `calc` has listed `tools`; the effects of both steps."""
    first = send(p, type="session.update", session={"tools": [mcp_tool(**over)]})
    [listing] = of(first, ListTools)
    return first, listing, p.on_mcp_listed(listing.item_id, tools, None)


def call(p, epoch, name, arguments):
    out = []
    for piece in (CallStarted(0, name), CallArguments(0, arguments[:5]),
                  CallArguments(0, arguments[5:]), CallDone(0, name, arguments, True)):
        out += p.on_engine_tool_call(epoch, piece)
    return out


def create(p, **response):
    effects = send(p, type="response.create", response=response)
    [commit] = of(effects, EngineCommit)
    return commit


def test_an_mcp_tool_lists_its_server_and_the_model_is_offered_the_allowed_tools():
    p = make()
    first, listing, second = listed(p, allowed_tools=["add", "lookup"])
    updated = next(e for e in events(first) if e["type"] == "session.updated")
    assert updated["session"]["tools"] == [{k: v for k, v in mcp_tool(
        allowed_tools=["add", "lookup"]).items() if k != "headers"}]
    assert types(first)[1:3] == ["conversation.item.added", "mcp_list_tools.in_progress"]
    added = events(first)[1]["item"]
    assert (added["type"], added["server_label"], added["tools"]) == ("mcp_list_tools", "calc", [])
    assert listing.server.url == "http://127.0.0.1:9/mcp"
    assert listing.server.headers == {"Authorization": SECRET}
    assert types(second) == ["mcp_list_tools.completed", "conversation.item.done"]
    done = events(second)[1]["item"]
    assert [t["name"] for t in done["tools"]] == ["add", "lookup"]
    [told] = of(second, EngineInstruct)
    assert [t["name"] for t in told.tools] == ["add", "lookup"]
    assert told.tools[0]["parameters"] == TOOLS[0]["input_schema"]


def test_an_unchanged_mcp_tool_is_not_listed_again_and_a_changed_one_is():
    p = make()
    listed(p)
    again = send(p, type="session.update", session={"tools": [mcp_tool()]})
    assert not of(again, ListTools) and "mcp_list_tools.in_progress" not in types(again)
    rekeyed = send(p, type="session.update",
                   session={"tools": [mcp_tool(headers={"Authorization": "Bearer other"})]})
    assert len(of(rekeyed, ListTools)) == 1


def test_a_listed_tool_named_like_a_function_tool_is_offered_under_its_servers_label():
    p = make()
    effects = send(p, type="session.update", session={
        "tools": [{"type": "function", "name": "add"}, mcp_tool()]})
    [listing] = of(effects, ListTools)
    [told] = of(p.on_mcp_listed(listing.item_id, TOOLS[:1], None), EngineInstruct)
    assert [t["name"] for t in told.tools] == ["add", "calc__add"]


@pytest.mark.parametrize("tool, param, says", [
    ({"server_url": None}, "session.tools.1.server_url", "'calc'"),
    ({"server_url": None, "connector_id": "connector_gmail"}, "session.tools.1.server_url",
     "connectors"),
    ({"server_url": "ftp://example.com/mcp"}, "session.tools.1.server_url", "'calc'"),
    ({"server_label": "9lives"}, "session.tools.1.server_label", "'9lives'"),
    ({"allowed_tools": "add"}, "session.tools.1.allowed_tools", "'calc'"),
    ({"require_approval": "sometimes"}, "session.tools.1.require_approval", "'calc'"),
])
def test_a_session_update_with_one_bad_tool_is_refused_whole_naming_that_tool(tool, param, says):
    p = make()
    bad = {k: v for k, v in mcp_tool(**tool).items() if v is not None}
    effects = send(p, type="session.update", session={
        "instructions": "Be brief.", "tools": [{"type": "function", "name": "f"}, bad]})
    [error] = events(effects)
    assert error["type"] == "error" and error["error"]["param"] == param
    assert says in error["error"]["message"]
    assert p.settings.instructions == "" and p.settings.tools == (), "nothing was applied"
    assert not of(effects, ListTools)


def test_two_mcp_tools_with_one_label_and_an_mcp_tool_on_a_response_are_refused():
    p = make()
    [error] = events(send(p, type="session.update", session={"tools": [mcp_tool(), mcp_tool()]}))
    assert error["error"]["param"] == "session.tools.1.server_label"
    [error] = events(send(p, type="response.create", response={"tools": [mcp_tool()]}))
    assert error["error"]["param"] == "response.tools.0.type"
    [error] = events(send(p, type="session.update", session={
        "tool_choice": {"type": "mcp", "server_label": "nope"}}))
    assert error["error"]["param"] == "session.tool_choice.server_label"


def test_a_forced_mcp_call_runs_and_the_next_reply_speaks_with_its_result():
    p = make()
    listed(p)
    commit = create(p, output_modalities=["text"],
                    tool_choice={"type": "mcp", "server_label": "calc", "name": "add"})
    assert commit.spec.tool_choice == {"type": "function", "name": "add"}
    assert [t["name"] for t in commit.spec.tools] == ["add", "lookup", "wipe"]
    started = call(p, commit.epoch, "add", '{"a": 2, "b": 3}')
    assert types(started) == [
        "conversation.item.added", "response.output_item.added",
        "response.mcp_call_arguments.delta", "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.done", "response.mcp_call.in_progress"]
    item = events(started)[1]["item"]
    assert (item["type"], item["server_label"], item["name"]) == ("mcp_call", "calc", "add")
    assert events(started)[1]["output_index"] == 1
    [run] = of(started, CallTool)
    assert (run.tool, run.arguments, run.server.headers) == ("add", {"a": 2, "b": 3},
                                                             {"Authorization": SECRET})
    p.on_engine_finished(commit.epoch)
    assert "response.done" not in types(p.release_output(0)), "the reply waits for its call"
    result = p.on_mcp_called(run.item_id, "5", None)
    assert types(result) == ["response.mcp_call.completed", "response.output_item.done",
                             "conversation.item.done"]
    assert events(result)[1]["item"]["output"] == "5"
    # The result goes into the model's context as the tool's response (the engine takes it
    # once the reply's text has ended), then the next reply chooses freely.
    assert of(result, EnginePushText) == [EnginePushText("5", role="tool")]
    after = p.release_output(0)
    assert types(after)[types(after).index("response.done") + 1] == "response.created"
    done = next(e for e in events(after) if e["type"] == "response.done")["response"]
    assert [i["type"] for i in done["output"]] == ["message", "mcp_call"]
    assert done["output"][1]["output"] == "5" and done["output"][1]["status"] == "completed"
    [follow] = of(after, EngineCommit)
    assert follow.spec.tool_choice == "auto"


def test_a_call_that_fails_says_why_the_model_is_told_and_the_session_goes_on():
    p = make()
    listed(p)
    commit = create(p, tool_choice={"type": "mcp", "server_label": "calc"})
    assert commit.spec.tool_choice == {"type": "function", "names": ["add", "lookup", "wipe"]}
    [run] = of(call(p, commit.epoch, "wipe", "{}"), CallTool)
    error = {"type": "http_error", "code": 504, "message": "the MCP server did not answer"}
    failed = p.on_mcp_called(run.item_id, None, error)
    assert types(failed)[0] == "response.mcp_call.failed"
    assert events(failed)[1]["item"]["error"] == error
    assert of(failed, EnginePushText) == [
        EnginePushText("The call failed: the MCP server did not answer", role="tool")]
    p.on_engine_finished(commit.epoch)
    assert of(p.release_output(0), EngineCommit), "the model speaks of the failure"


def test_arguments_that_are_not_an_object_fail_the_call_without_running_it():
    p = make()
    listed(p)
    commit = create(p, tool_choice={"type": "mcp", "server_label": "calc", "name": "add"})
    effects = call(p, commit.epoch, "add", '["not", "an object"]')
    assert not of(effects, CallTool)
    assert "response.mcp_call.failed" in types(effects)


def test_a_listing_that_fails_says_why_and_a_choice_of_its_tools_is_refused():
    p = make()
    first = send(p, type="session.update", session={"tools": [mcp_tool()]})
    [listing] = of(first, ListTools)
    error = {"type": "http_error", "code": 502, "message": "cannot reach the MCP server"}
    failed = p.on_mcp_listed(listing.item_id, None, error)
    assert types(failed) == ["mcp_list_tools.failed", "conversation.item.done"]
    assert events(failed)[0]["error"] == error
    assert events(failed)[1]["item"]["status"] == "incomplete"
    [refused] = events(send(p, type="response.create", response={
        "tool_choice": {"type": "mcp", "server_label": "calc", "name": "add"}}))
    assert refused["error"]["param"] == "tool_choice" and "'calc'" in refused["error"]["message"]
    assert create(p).spec.tools == (), "the session goes on, without the server's tools"


@pytest.mark.parametrize("approval, asked", [
    (None, {"add", "lookup", "wipe"}),
    ("always", {"add", "lookup", "wipe"}),
    ({"never": {"tool_names": ["add"]}}, {"lookup", "wipe"}),
    ({"never": {"read_only": True}}, {"add", "wipe"}),
    ({"always": {"tool_names": ["wipe"]}, "never": {"tool_names": ["add", "lookup"]}}, {"wipe"}),
])
def test_require_approval_says_which_calls_wait_for_the_client(approval, asked):
    p = make()
    listed(p, require_approval=approval)
    waiting = set()
    for name in ("add", "lookup", "wipe"):
        commit = create(p, tool_choice={"type": "mcp", "server_label": "calc", "name": name},
                        conversation="none")
        effects = call(p, commit.epoch, name, "{}")
        item = events(effects)[0]["item"]
        if item["type"] == "mcp_approval_request":
            waiting.add(name)
            assert not of(effects, CallTool)
        else:
            p.on_mcp_called(of(effects, CallTool)[0].item_id, "ok", None)
        p.on_engine_finished(commit.epoch)
        assert "response.done" in types(p.release_output(0))
    assert waiting == asked


@pytest.mark.parametrize("approve", [True, False])
def test_an_approval_response_runs_the_call_or_tells_the_model_it_was_declined(approve):
    p = make()
    listed(p, require_approval="always")
    commit = create(p, tool_choice={"type": "mcp", "server_label": "calc", "name": "add"})
    asked = call(p, commit.epoch, "add", '{"a": 1, "b": 1}')
    assert types(asked) == ["conversation.item.added", "response.output_item.added",
                            "response.output_item.done", "conversation.item.done"]
    request = events(asked)[2]["item"]
    assert (request["type"], request["name"], request["arguments"]) == (
        "mcp_approval_request", "add", '{"a": 1, "b": 1}')
    p.on_engine_finished(commit.epoch)
    ended = p.release_output(0)
    assert "response.done" in types(ended) and not of(ended, EngineCommit), "it waits"

    answer = send(p, type="conversation.item.create", item={
        "type": "mcp_approval_response", "approval_request_id": request["id"],
        "approve": approve, "reason": "fine" if approve else "not now"})
    assert types(answer)[:2] == ["conversation.item.added", "conversation.item.done"]
    if approve:
        assert types(answer)[2:] == ["conversation.item.added", "response.mcp_call.in_progress"]
        item = events(answer)[2]["item"]
        assert (item["type"], item["approval_request_id"]) == ("mcp_call", request["id"])
        [run] = of(answer, CallTool)
        result = p.on_mcp_called(run.item_id, "2", None)
        assert types(result)[:2] == ["response.mcp_call.completed", "conversation.item.done"]
        assert of(result, EnginePushText) == [EnginePushText("2", role="tool")]
        assert of(result, EngineCommit), "the next reply speaks with the result"
    else:
        assert not of(answer, CallTool)
        assert of(answer, EnginePushText) == [EnginePushText(
            "The user did not approve calling add (not now).", role="tool")]
        assert of(answer, EngineCommit)
    [again] = events(send(p, type="conversation.item.create", item={
        "type": "mcp_approval_response", "approval_request_id": request["id"],
        "approve": True}))
    assert again["error"]["param"] == "item.approval_request_id", "answered once only"


def test_headers_reach_no_event_no_record_and_no_repr():
    p = make()
    first, listing, second = listed(p, authorization="oauth-s3cret-too")
    commit = create(p, tool_choice={"type": "mcp", "server_label": "calc", "name": "add"})
    started = call(p, commit.epoch, "add", '{"a": 2, "b": 3}')
    effects = first + second + started + p.on_mcp_called(of(started, CallTool)[0].item_id,
                                                           "5", None)
    assert listing.server.headers == {"Authorization": SECRET}, "headers win over authorization"
    items, config = p.snapshot(0)
    seen = json.dumps([events(effects), items, config, p.session_object()]) \
        + repr(effects) + repr(p.settings)
    assert "s3cret" not in seen
    assert "mcp_headers" not in config and SessionSettings.from_record(config).mcp_headers == {}
    assert "Authorization" not in json.dumps(
        [e.spec.tools for e in of(effects, EngineCommit)] + [commit.spec.tools])


def test_the_server_asks_for_at_most_max_follow_ups_replies_in_a_row():
    """A model that calls a tool in every reply the server asks for stops being asked."""
    p = make()
    listed(p)
    commit = create(p, tool_choice={"type": "mcp", "server_label": "calc", "name": "add"})
    follow_ups = 0
    while commit is not None:
        [run] = of(call(p, commit.epoch, "add", '{"a": 1, "b": 1}'), CallTool)
        p.on_mcp_called(run.item_id, "2", None)
        p.on_engine_finished(commit.epoch)
        after = p.release_output(0)
        assert "response.done" in types(after)
        commit = next(iter(of(after, EngineCommit)), None)
        follow_ups += commit is not None
    assert follow_ups == MAX_FOLLOW_UPS


def test_a_resumed_session_lists_its_mcp_servers_again_without_their_headers():
    p = make()
    listed(p)
    items, config = p.snapshot(0)
    resumed = make()
    [listing] = of(resumed.resumed("sess_t", items, config), ListTools)
    assert (listing.server.url, listing.server.headers) == ("http://127.0.0.1:9/mcp", {})


def test_an_mcp_result_is_a_part_of_the_model_context_of_its_own():
    """With a model that rewinds its context, a call's output is laid in the call's place as a
    part of its own: laid again after an insert before it, gone with its item, and named by
    the item's record so that a resume rebuilds the same context."""
    p = RealtimeProtocol("sess_t", model="tiny", model_input_rate=24000,
                         model_output_rate=24000, limits=Limits(max_errors=1000),
                         rewinds_context=True)
    p.start()
    send(p, type="session.update", session={"audio": {"input": {"turn_detection": None}}})
    listed(p)
    send(p, type="conversation.item.create", item={
        "type": "message", "role": "user", "id": "u",
        "content": [{"type": "input_text", "text": "two and three?"}]})
    commit = create(p, output_modalities=["text"],
                    tool_choice={"type": "mcp", "server_label": "calc", "name": "add"})
    [run] = of(call(p, commit.epoch, "add", '{"a": 2, "b": 3}'), CallTool)
    assert not of(p.on_mcp_called(run.item_id, "5", None), EnginePushText), \
        "laid in its place, with the context"
    p.on_engine_finished(commit.epoch)
    after = p.release_output(0)
    item = p.conversation.find(run.item_id)
    reply = next(i for i in p.conversation if i.role == "assistant")
    assert item.unit == reply.unit and item.output_unit not in (None, item.unit)
    [follow] = of(after, EngineCommit)
    laid = [e for e in after if isinstance(e, (EngineMark, EnginePushText, EngineCommit))]
    assert laid[:3] == [EngineMark(item.output_unit), EnginePushText("5", role="tool"),
                        EngineMark(laid[2].key)] and laid[3] is follow
    p.on_engine_finished(follow.epoch)
    p.release_output(0)
    user, answer = p.conversation.find("u").unit, laid[2].key
    assert p.context.rendered == [user, item.unit, item.output_unit, answer]

    # An item at the root: everything after it is laid again, the call's output included.
    send(p, type="conversation.item.create", previous_item_id="root", item={
        "type": "message", "role": "user", "id": "x",
        "content": [{"type": "input_text", "text": "first"}]})
    edited = p.release_output(0)
    x = p.conversation.find("x").unit
    assert [e for e in edited if isinstance(e, (EngineRewind, EngineMark, EngineReplay))] == [
        EngineRewind(user, p._told_instructions), EngineMark(x), EngineReplay(user),
        EngineReplay(item.unit), EngineReplay(item.output_unit), EngineReplay(answer)]

    # The record names both parts; a resume holds them as the conversation's, not as input.
    items, config = p.snapshot(0)
    resumed = RealtimeProtocol("sess_u", model="tiny", model_input_rate=24000,
                               model_output_rate=24000, rewinds_context=True)
    resumed.resumed("sess_t", items, config, None, [x, user, item.unit, item.output_unit])
    assert resumed.context.tail is None
    assert resumed.context.desired() == [x, user, item.unit, item.output_unit, answer]

    # The call deleted: its output leaves the context (the reply that made it stays with its
    # message), and what followed is laid again.
    send(p, type="conversation.item.delete", item_id=run.item_id)
    deleted = p.release_output(0)
    assert [e for e in deleted if isinstance(e, (EngineRewind, EngineReplay, EnginePushText))] \
        == [EngineRewind(item.output_unit), EngineReplay(answer)]
    assert p.context.rendered == [x, user, item.unit, answer]
