"""Pipecat's OpenAI Realtime service (OpenAIRealtimeLLMService) as a client of a real
`duplex serve`, run in a Pipecat pipeline and driven with Pipecat frames.

Audio goes in as InputAudioRawFrames, replies come out as TTSAudioRawFrames at the
pipeline's end; the service itself truncates the reply it is playing when the server's VAD
hears the user start speaking. Text and tool results go in through an LLMContext, the way
Pipecat's context aggregators deliver them. Pipecat treats any `error` event other than the
two benign races it knows as fatal: it pushes an ErrorFrame and stops reading the socket.
"""

from __future__ import annotations

import asyncio

import pytest
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.frames.frames import (
    InputAudioRawFrame,
    LLMContextFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.openai.realtime import events
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

pytestmark = pytest.mark.slow

# The two races Pipecat itself logs at debug level and carries on from; any other error
# event ends its receive loop (pipecat/services/openai/realtime/llm.py, _receive_task_handler).
BENIGN = frozenset({"response_cancel_not_active", "conversation_already_has_active_response"})

WEATHER = FunctionSchema(name="get_weather", description="The weather in a city.",
                         properties={"city": {"type": "string"}}, required=["city"])


_PARSE = events.parse_server_event


class Client:
    """A pipeline holding the realtime service, its runner, and what came out of it."""

    def __init__(self, kit, server, monkeypatch, text_only: bool = False) -> None:
        self.kit = kit
        self.model_kind = server.model_kind
        self.wire = kit.Wire()
        self.audio: list[bytes] = []
        self.texts: list[str] = []
        self.marks: list[tuple[str, int, int]] = []
        """(response id, reply audio bytes and text characters out of the pipeline when it
        was created): TTSAudioRawFrames and LLMTextFrames carry no response id, and they
        come out in order."""
        self.pipeline_errors: list[str] = []

        # Observe what the service parses (it reads the socket itself): every raw event is
        # recorded, and one it cannot parse is a client-side validation failure.
        def recording_parse(message):
            self.wire.add(message)
            event = self.wire.events[-1]
            if event.get("type") == "response.created":
                self.marks.append((event["response"]["id"], self.total(), self.total_text()))
            try:
                return _PARSE(message)
            except Exception as exc:
                self.wire.client_problems.append(
                    f"pipecat could not parse {event.get('type')!r}: {str(exc).splitlines()[0]}")
                raise

        monkeypatch.setattr(events, "parse_server_event", recording_parse)
        self.llm = OpenAIRealtimeLLMService(
            api_key="sk-test",
            base_url=server.url.replace("http", "ws", 1) + "/v1/realtime",
            settings=OpenAIRealtimeLLMService.Settings(
                model=server.model_kind,
                system_instruction="Answer briefly.",
                session_properties=events.SessionProperties(
                    output_modalities=["text"] if text_only else None,
                    audio=events.AudioConfiguration(
                        # Input transcription at Pipecat's defaults (gpt-realtime-whisper).
                        input=events.AudioInput(turn_detection=events.TurnDetection(),
                                                transcription=events.InputAudioTranscription()),
                        output=events.AudioOutput(voice="alloy"),
                    ),
                    tools=ToolsSchema(standard_tools=[WEATHER]),
                ),
            ),
        )
        self.worker = PipelineWorker(
            Pipeline([self.llm]),
            params=PipelineParams(audio_in_sample_rate=kit.RATE, audio_out_sample_rate=kit.RATE),
            enable_rtvi=False,
            enable_turn_tracking=False,
            idle_timeout_secs=None,
        )
        self.worker.set_reached_downstream_filter((TTSAudioRawFrame, LLMTextFrame))

        @self.worker.event_handler("on_frame_reached_downstream")
        async def on_downstream(worker, frame):
            if isinstance(frame, TTSAudioRawFrame):
                self.audio.append(frame.audio)
            else:
                self.texts.append(frame.text)

        @self.worker.event_handler("on_pipeline_error")
        async def on_error(worker, frame):
            self.pipeline_errors.append(frame.error.splitlines()[0][:200])

        self.runner = WorkerRunner(handle_sigint=False)
        self._run: asyncio.Task | None = None
        self.wire.gone = self._gone

    def _gone(self) -> str | None:
        fatal = self.kit.error_lines(self.wire, BENIGN)
        if fatal:
            return f"Pipecat stopped reading the socket after the server's error ({fatal[0]})"
        return None

    async def __aenter__(self) -> Client:
        await self.runner.add_workers(self.worker)
        self._run = asyncio.create_task(self.runner.run())
        await self.kit.wait_until(lambda: self.wire.count("session.updated") >= 1, 15,
                                  "session.updated", self.wire)
        return self

    async def __aexit__(self, *exc) -> None:
        # EndFrame: the service's stop() closes its websocket.
        await self.worker.stop_when_done()
        await asyncio.wait_for(self._run, 15)

    async def say(self, pcm: bytes) -> None:
        async def send(chunk: bytes) -> None:
            await self.worker.queue_frame(
                InputAudioRawFrame(audio=chunk, sample_rate=self.kit.RATE, num_channels=1))

        await self.kit.stream(send, pcm)

    def total(self) -> int:
        return sum(len(a) for a in self.audio)

    def total_text(self) -> int:
        return sum(len(t) for t in self.texts)

    def _since(self, response_id: str, which: int, now: int) -> int:
        """What came out between `response_id` being created and the next response."""
        ids = [m[0] for m in self.marks]
        if response_id not in ids:
            return 0
        i = ids.index(response_id)
        end = self.marks[i + 1][which] if i + 1 < len(self.marks) else now
        return end - self.marks[i][which]

    def heard(self, response_id: str) -> int:
        return self._since(response_id, 1, self.total())

    def text(self, response_id: str) -> int:
        return self._since(response_id, 2, self.total_text())

    def truncate_sent(self, item_id: str) -> None:
        return None  # sent from inside the service's receive loop; the server's answer tells

    def done(self, n: int, timeout: float = 30):
        return self.kit.wait_until(lambda: len(self.wire.responses_done()) >= n, timeout,
                                   f"response.done #{n}", self.wire)

    def problems(self) -> list[str]:
        out = self.kit.error_lines(self.wire, BENIGN)
        out += self.wire.client_problems
        out += [f"pipeline ErrorFrame: {e}" for e in self.pipeline_errors]
        return out


async def transcribed_turns(c: Client, problems: list[str]) -> None:
    """The spoken turns, each user turn transcribed with the model Pipecat asks for."""
    await c.kit.voice_turns(c, problems)
    problems += c.kit.session_config_problems(c.wire, tools=["get_weather"], voice="alloy",
                                              transcription=True)
    committed = [e["item_id"] for e in c.wire.of("input_audio_buffer.committed")]
    await c.kit.wait_until(lambda: len(c.wire.of(
        "conversation.item.input_audio_transcription.completed")) >= len(committed), 30,
        "a transcript of every committed turn", c.wire)
    if c.wire.of("conversation.item.input_audio_transcription.failed"):
        problems.append("a user turn's transcription failed")


async def text_and_tool(c: Client, problems: list[str]) -> None:
    problems += c.kit.session_config_problems(c.wire, tools=["get_weather"], voice="alloy")

    # A text turn: the first context the service gets goes in as a user text item, and the
    # service asks for a response to it (what LLMRunFrame through the user aggregator does).
    context = LLMContext(messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    await c.worker.queue_frame(LLMContextFrame(context))
    await c.done(1)
    text_reply = c.wire.responses_done()[0]
    if text_reply["status"] != "completed":
        problems.append(f"text turn: the reply ended {text_reply['status']}")
    elif c.model_kind != "echo":  # echo has heard nothing to say back
        await c.kit.wait_until(lambda: c.heard(text_reply["id"]) > 0, 5,
                               "the text reply's audio at the pipeline's end", c.wire)

    # A tool result. The call it answers goes in first (Pipecat only ever answers calls the
    # model made, so a client-made call needs its public send_client_event), then the result
    # is written into the context and the context sent upstream, as the assistant aggregator
    # does after a function call: the service sends the function_call_output item and asks
    # for a response.
    call_id = "call_weather_1"
    await c.llm.send_client_event(events.ConversationItemCreateEvent(item=events.ConversationItem(
        type="function_call", call_id=call_id, name="get_weather", arguments='{"city": "Paris"}')))
    context.add_message({"role": "assistant", "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]})
    context.add_message({"role": "tool", "tool_call_id": call_id,
                         "content": "21 C and sunny in Paris"})
    await c.worker.queue_frame(LLMContextFrame(context), FrameDirection.UPSTREAM)
    await c.done(2)
    added = [e["item"] for e in c.wire.of("conversation.item.added")]
    for kind in ("function_call", "function_call_output"):
        if not any(i.get("type") == kind and i.get("call_id") == call_id for i in added):
            problems.append(f"tool output: no conversation.item.added for the {kind} item")
    tool_reply = c.wire.responses_done()[1]
    if tool_reply["status"] != "completed":
        problems.append(f"tool output: the reply ended {tool_reply['status']}")


@pytest.mark.timeout(210)
async def test_pipecat_openai_realtime_service(duplex_server, kit, monkeypatch):
    def client(**kw) -> Client:
        return Client(kit, duplex_server, monkeypatch, **kw)

    problems = await kit.run_sessions(duplex_server, client, [
        ("voice", transcribed_turns),
        ("text+tool", text_and_tool),
        ("text-only", kit.text_reply_to_speech),
    ])
    assert not problems, kit.report(problems)
