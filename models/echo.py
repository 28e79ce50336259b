"""The echo reference model: its reply is what the user said, unchanged.

Deterministic and free of weights, it gives tests an exact oracle. After an audio turn the
reply is the user's committed audio, sample for sample, one codec frame per Talker step, and
its transcript is one word per frame ("frame0 frame1 ..."), so truncation at the playback
watermark is visible in the transcript too.

Native full duplex (`duplex_step`): output is input delayed by `duplex_lag_frames` frames, frame
for frame, silence included, so the duplex timeline is testable exactly; a voiced frame's
transcript is "frameK " where K is the index of the input frame it repeats. After text (a user text item, or a tool's output)
the reply's text is that text verbatim (system and assistant messages are nobody's words and
are not repeated), written a word at a time through the same Thinker-output
handling a real checkpoint's text goes through (so a `<tool_call>` block in it comes back as a
function call); each word is voiced as one frame of a quiet tone. `tool_choice` changes
nothing: an oracle that rewrote its input into a call would no longer be exact, and a test
that wants a call sends one.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.base import (
    DuplexFrame,
    DuplexModel,
    ModelState,
    StageTimer,
    TalkerFrame,
    TextTurn,
    ThinkerToken,
    is_voiced,
    untimed,
)
from models.reply import ReplySpec

RATE = 24000
FRAME = 1920
STATE_KEY = "echo"
_WORD_TONE = (0.1 * np.sin(2 * np.pi * 220 * np.arange(FRAME) / RATE)).astype(np.float32)


@dataclass
class _Echo:
    heard: list[np.ndarray] = field(default_factory=list)
    """Audio since the last reply began."""
    said: list[str] = field(default_factory=list)
    """Text since the last reply began."""
    reply: np.ndarray | None = None
    words: list[str] | None = None
    """A text reply's pieces still to write; None for an audio reply."""
    cursor: int = 0
    """Samples (audio) or pieces (text) of the reply handed out so far."""

    @property
    def nbytes(self) -> int:
        reply = 0 if self.reply is None else self.reply.nbytes
        return sum(chunk.nbytes for chunk in self.heard) + reply

    def release(self) -> None:
        self.heard, self.said, self.reply, self.words, self.cursor = [], [], None, None, 0


@dataclass
class _Lag:
    """Input frames heard in duplex and not yet repeated, and how many were heard."""

    waiting: deque[np.ndarray] = field(default_factory=deque)
    heard: int = 0

    @property
    def nbytes(self) -> int:
        return sum(frame.nbytes for frame in self.waiting)

    def release(self) -> None:
        self.waiting.clear()


class EchoModel(DuplexModel):
    name = "echo"
    input_rate = RATE
    output_rate = RATE
    input_chunk_samples = FRAME
    frame_samples = FRAME
    accepts_partial_chunks = True
    accepts_text = True

    def __init__(self, duplex_lag_frames: int = 1) -> None:
        if duplex_lag_frames < 1:
            raise ValueError("the duplex lag is at least one frame (output follows its input)")
        self.duplex_delay_frames = duplex_lag_frames

    def new_state(self, session_id: str) -> ModelState:
        return ModelState(session_id, {STATE_KEY: _Echo(), "lag": _Lag()})

    def duplex_step(
        self, states: list[ModelState], frames: list[np.ndarray], timer: StageTimer = untimed
    ) -> list[DuplexFrame]:
        out = []
        with timer("echo", len(states)):
            for state, frame in zip(states, frames, strict=True):
                lag = state.slots["lag"]
                lag.waiting.append(np.asarray(frame, dtype=np.float32).copy())
                lag.heard += 1
                if len(lag.waiting) < self.duplex_delay_frames:
                    out.append(DuplexFrame(np.zeros(FRAME, np.float32), "", False))
                    continue
                pcm = lag.waiting.popleft()
                voiced = is_voiced(pcm)
                index = lag.heard - self.duplex_delay_frames
                out.append(DuplexFrame(pcm, f"frame{index} " if voiced else "", voiced))
        return out

    def reset_response(self, state: ModelState) -> None:
        echo = state.slots[STATE_KEY]
        echo.reply, echo.words, echo.cursor = None, None, 0

    def encode_audio(self, states: list[ModelState], chunks: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(chunk, dtype=np.float32).copy() for chunk in chunks]

    def clear_input(self, state: ModelState) -> None:
        state.slots[STATE_KEY].heard = []

    def thinker_prefill(self, states: list[ModelState], features: list[Any]) -> None:
        for state, feature in zip(states, features, strict=True):
            echo = state.slots[STATE_KEY]
            if isinstance(feature, TextTurn):
                # What the user said or a tool answered; other turns are no one's words.
                if feature.role in ("user", "tool"):
                    echo.said.append(feature.text)
            elif isinstance(feature, np.ndarray):
                echo.heard.append(feature)

    def begin_response(self, state: ModelState, spec: ReplySpec | None = None) -> None:
        echo = state.slots[STATE_KEY]
        if echo.said:
            # Whitespace stays with the word before it, so the pieces add up to the text.
            echo.words = re.findall(r"\S+\s*|\s+", "".join(echo.said))
            echo.reply = None
        else:
            echo.words = None
            echo.reply = np.concatenate(echo.heard) if echo.heard else np.zeros(0, np.float32)
        echo.heard, echo.said, echo.cursor = [], [], 0

    def thinker_decode(self, states: list[ModelState]) -> list[ThinkerToken]:
        return [self._next_token(state.slots[STATE_KEY]) for state in states]

    @staticmethod
    def _next_token(echo: _Echo) -> ThinkerToken:
        if echo.words is not None:
            index = echo.cursor
            echo.cursor += 1
            word = echo.words[index] if index < len(echo.words) else ""
            return ThinkerToken(word, _WORD_TONE, index + 1 >= len(echo.words))
        reply, cursor = echo.reply, echo.cursor
        n_frames = -(-len(reply) // FRAME)
        index = cursor // FRAME
        echo.cursor = cursor + FRAME
        text = f"frame{index} " if index < n_frames else ""
        return ThinkerToken(text, reply[cursor : cursor + FRAME], index + 1 >= n_frames)

    def talker_step(
        self, states: list[ModelState], tokens: list[ThinkerToken | None]
    ) -> list[TalkerFrame]:
        return [
            TalkerFrame(None if token is None else token.conditioning, token is None or token.finished)
            for token in tokens
        ]

    def codec_decode(self, states: list[ModelState], codes: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(pcm, dtype=np.float32) for pcm in codes]
