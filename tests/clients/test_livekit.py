"""LiveKit Agents' OpenAI realtime plugin (livekit-plugins-openai RealtimeModel) as a client
of a real `duplex serve`: `model.session()` with no LiveKit room, driven through the
RealtimeSession API that LiveKit's AgentSession itself uses.

What AgentSession would add on top is done here the way it does it
(livekit/agents/voice/agent_activity.py): every reply generation is played out in real
time; when the server's VAD reports speech it calls `interrupt()`, and a message whose
playout was cut short is truncated at its playback position with `truncate()`. Tool
results go in through `update_chat_ctx()` followed by `generate_reply()`, whose future
resolves when the server's response.created carries back the metadata it sent.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from livekit import rtc
from livekit.agents import function_tool, llm
from livekit.plugins import openai as lk_openai
from livekit.plugins.openai.realtime.realtime_model import DEFAULT_VOICE, SAMPLE_RATE
from openai.types.realtime.realtime_audio_input_turn_detection import ServerVad

pytestmark = pytest.mark.slow

# The one error event allowed here. interrupt() sends response.cancel when speech_started
# arrives, ahead of the response.done (cancelled) the server sends right after it, so the
# response is already gone; the hosted API answers that race with this error too, and the
# plugin drops it by its message (livekit/agents/llm/_realtime/openai.py, _handle_error:
# message.startswith("Cancellation failed")).
CANCEL_RACE = frozenset({"response_cancel_not_active"})


@function_tool
async def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"21 C and sunny in {city}"


class Playout:
    """One assistant message played out in real time, as AgentSession's audio output would."""

    def __init__(self, message: llm.MessageGeneration) -> None:
        self.message = message
        self.samples = 0
        self.started: float | None = None
        self.done = False

    def position_s(self) -> float:
        """Seconds played so far: wall time since the first frame, capped at what arrived."""
        if self.started is None:
            return 0.0
        return min(time.monotonic() - self.started, self.samples / SAMPLE_RATE)

    def cut_short(self) -> bool:
        return self.started is not None and not (
            self.done and self.position_s() >= self.samples / SAMPLE_RATE)


class Client:
    """A plugin RealtimeSession, what it received and sent, and its generations played out."""

    def __init__(self, kit, server, text_only: bool = False) -> None:
        self.kit = kit
        self.model_kind = server.model_kind
        self.wire = kit.Wire()
        self.sent: list[dict] = []
        self.errors: list[str] = []
        self.audio: dict[str, int] = {}  # reply audio bytes by response id
        self.texts: dict[str, int] = {}  # reply text characters by response id
        self.playouts: list[Playout] = []
        self.tasks: list[asyncio.Task] = []
        self.model = lk_openai.realtime.RealtimeModel(
            model=server.model_kind,
            base_url=f"{server.url}/v1",
            api_key="sk-test",
            modalities=["text"] if text_only else ["text", "audio"],
            turn_detection=ServerVad(type="server_vad", create_response=True,
                                     interrupt_response=True),
        )
        self.rt: lk_openai.realtime.RealtimeSession | None = None

    async def __aenter__(self) -> Client:
        self.rt = self.model.session()
        self.rt.on("openai_server_event_received", self.wire.add)
        self.rt.on("openai_client_event_queued", self.sent.append)
        self.rt.on("error", lambda e: self.errors.append(
            f"{getattr(e.error, 'body', None) or e.error} (recoverable={e.recoverable})"))
        self.rt.on("generation_created", self._on_generation)
        self.rt.on("input_speech_started", self._on_speech_started)
        await self.kit.wait_until(lambda: self.wire.count("session.updated") >= 1, 15,
                                  "session.updated", self.wire)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.rt.aclose()
        await self.model.aclose()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _on_generation(self, ev: llm.GenerationCreatedEvent) -> None:
        self.tasks.append(asyncio.create_task(self._play(ev)))

    async def _play(self, ev: llm.GenerationCreatedEvent) -> None:
        async for message in ev.message_stream:
            playout = Playout(message)
            self.playouts.append(playout)

            async def drain_text(stream=message.text_stream, rid=ev.response_id):
                async for delta in stream:
                    self.texts[rid] = self.texts.get(rid, 0) + len(delta)

            text = asyncio.create_task(drain_text())
            async for frame in message.audio_stream:
                if playout.started is None:
                    playout.started = time.monotonic()
                playout.samples += frame.samples_per_channel
                self.audio[ev.response_id] = (self.audio.get(ev.response_id, 0)
                                              + frame.samples_per_channel * 2)
            playout.done = True
            await text

    def _on_speech_started(self, _: llm.InputSpeechStartedEvent) -> None:
        # AgentActivity._on_input_speech_started -> interrupt() -> rt_session.interrupt(), then
        # the interrupted speech's message is truncated at its playback position.
        self.rt.interrupt()
        if self.playouts and self.playouts[-1].cut_short():
            playout = self.playouts[-1]  # playout stops here
            self.tasks.append(asyncio.create_task(self._truncate(playout, playout.position_s())))

    async def _truncate(self, playout: Playout, position_s: float) -> None:
        self.rt.truncate(message_id=playout.message.message_id,
                         modalities=await playout.message.modalities,
                         audio_end_ms=int(position_s * 1000))

    async def say(self, pcm: bytes) -> None:
        rate = self.kit.RATE

        def push(chunk: bytes) -> None:
            self.rt.push_audio(rtc.AudioFrame(data=chunk, sample_rate=rate, num_channels=1,
                                              samples_per_channel=len(chunk) // 2))

        await self.kit.stream(push, pcm)

    def heard(self, response_id: str) -> int:
        return self.audio.get(response_id, 0)

    def text(self, response_id: str) -> int:
        return self.texts.get(response_id, 0)

    def truncate_sent(self, item_id: str) -> bool:
        return any(e.get("type") == "conversation.item.truncate" and e.get("item_id") == item_id
                   for e in self.sent)

    def done(self, n: int, timeout: float = 30):
        return self.kit.wait_until(lambda: len(self.wire.responses_done()) >= n, timeout,
                                   f"response.done #{n}", self.wire)

    async def reply(self, problems: list[str], step: str) -> None:
        """generate_reply(), as AgentActivity calls it: its future must resolve (the plugin
        matches response.created to it by response.metadata.client_event_id)."""
        future = self.rt.generate_reply()
        # Its own timeout (10 s) or the close settles it later: retrieved, not left dangling.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await asyncio.wait_for(asyncio.shield(future), 3)
        except (TimeoutError, llm.RealtimeError) as exc:
            created = self.wire.of("response.created")
            metadata = created[-1]["response"].get("metadata") if created else None
            problems.append(f"{step}: generate_reply() did not resolve ({exc!r}); the last "
                            f"response.created carries metadata {metadata!r}")

    def problems(self) -> list[str]:
        out = self.kit.error_lines(self.wire, CANCEL_RACE)
        out += [f"plugin error event: {e}" for e in self.errors]
        return out


async def text_and_tool(c: Client, problems: list[str]) -> None:
    await c.rt.update_tools([get_weather])
    await c.kit.wait_until(lambda: c.wire.count("session.updated") >= 2, 10,
                           "the session.updated answering update_tools()", c.wire)
    problems += c.kit.session_config_problems(c.wire, tools=["get_weather"], voice=None)
    # The plugin's first session.update carries the voice and input transcription.
    first = c.wire.of("session.updated")[0]
    audio = first["session"].get("audio") or {}
    if (voice := (audio.get("output") or {}).get("voice")) != DEFAULT_VOICE:
        problems.append(f"session.updated has voice {voice!r}, not the {DEFAULT_VOICE!r} the "
                        "plugin set")
    if not (transcription := (audio.get("input") or {}).get("transcription")):
        problems.append(f"session.updated has input transcription {transcription!r}, not the "
                        "one the plugin set")

    # A text turn: a user message into the chat context, then generate_reply().
    chat_ctx = c.rt.chat_ctx.copy()
    chat_ctx.add_message(role="user", content="What is the weather in Paris?")
    await c.rt.update_chat_ctx(chat_ctx)
    await c.reply(problems, "text turn")
    await c.done(1)
    text_reply = c.wire.responses_done()[0]
    if text_reply["status"] != "completed":
        problems.append(f"text turn: the reply ended {text_reply['status']}")
    elif c.model_kind != "echo":  # echo has heard nothing to say back
        await c.kit.wait_until(lambda: c.heard(text_reply["id"]) > 0, 5,
                               "the text reply's audio in its generation", c.wire)

    # A tool result the way AgentActivity delivers one: the call and its output into the
    # chat context (update_chat_ctx waits for the server to add each item), then
    # generate_reply().
    call_id = "call_weather_1"
    chat_ctx = c.rt.chat_ctx.copy()
    chat_ctx.items.append(llm.FunctionCall(call_id=call_id, name="get_weather",
                                           arguments='{"city": "Paris"}'))
    chat_ctx.items.append(llm.FunctionCallOutput(call_id=call_id, name="get_weather",
                                                 output="21 C and sunny in Paris", is_error=False))
    await c.rt.update_chat_ctx(chat_ctx)
    remote = {item.type for item in c.rt.chat_ctx.items}
    for kind in ("function_call", "function_call_output"):
        if kind not in remote:
            problems.append(f"tool output: the server did not add the {kind} item "
                            "(update_chat_ctx)")
    await c.reply(problems, "tool output")
    await c.done(2)
    tool_reply = c.wire.responses_done()[1]
    if tool_reply["status"] != "completed":
        problems.append(f"tool output: the reply ended {tool_reply['status']}")


@pytest.mark.timeout(150)
async def test_livekit_openai_realtime_model(duplex_server, kit):
    problems = await kit.run_sessions(duplex_server, lambda **kw: Client(kit, duplex_server, **kw), [
        ("voice", kit.voice_turns),
        ("text+tool", text_and_tool),
        ("text-only", kit.text_reply_to_speech),
    ])
    assert not problems, kit.report(problems)
