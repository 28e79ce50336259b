"""The echo reference model: its reply is the user's committed audio, unchanged.

Deterministic and free of weights, it gives tests an exact oracle for the timeline: what goes
in comes back sample for sample, one codec frame per Talker step, after the turn ends.
Text: the reply's transcript is one word per frame ("frame0 frame1 ..."), so truncation at the
playback watermark is visible in the transcript too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from models.base import DuplexModel, ModelState, TalkerFrame, ThinkerToken

RATE = 24000
FRAME = 1920
STATE_KEY = "echo"


@dataclass
class _Echo:
    heard: list[np.ndarray] = field(default_factory=list)
    """Input since the last reply began."""
    reply: np.ndarray | None = None
    cursor: int = 0
    """Samples of the reply handed out so far."""

    @property
    def nbytes(self) -> int:
        reply = 0 if self.reply is None else self.reply.nbytes
        return sum(chunk.nbytes for chunk in self.heard) + reply

    def release(self) -> None:
        self.heard, self.reply, self.cursor = [], None, 0


class EchoModel(DuplexModel):
    name = "echo"
    input_rate = RATE
    output_rate = RATE
    input_chunk_samples = FRAME
    frame_samples = FRAME
    accepts_partial_chunks = True

    def new_state(self, session_id: str) -> ModelState:
        return ModelState(session_id, {STATE_KEY: _Echo()})

    def reset_response(self, state: ModelState) -> None:
        echo = state.slots[STATE_KEY]
        echo.reply, echo.cursor = None, 0

    def encode_audio(self, states: list[ModelState], chunks: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(chunk, dtype=np.float32).copy() for chunk in chunks]

    def clear_input(self, state: ModelState) -> None:
        state.slots[STATE_KEY].heard = []

    def thinker_prefill(self, states: list[ModelState], features: list[np.ndarray]) -> None:
        for state, feature in zip(states, features, strict=True):
            state.slots[STATE_KEY].heard.append(feature)

    def begin_response(self, state: ModelState) -> None:
        echo = state.slots[STATE_KEY]
        echo.reply = np.concatenate(echo.heard) if echo.heard else np.zeros(0, np.float32)
        echo.heard, echo.cursor = [], 0

    def thinker_decode(self, states: list[ModelState]) -> list[ThinkerToken]:
        out = []
        for state in states:
            echo = state.slots[STATE_KEY]
            reply, cursor = echo.reply, echo.cursor
            n_frames = -(-len(reply) // FRAME)
            index = cursor // FRAME
            echo.cursor = cursor + FRAME
            text = f"frame{index} " if index < n_frames else ""
            out.append(ThinkerToken(text, reply[cursor : cursor + FRAME], index + 1 >= n_frames))
        return out

    def talker_step(
        self, states: list[ModelState], tokens: list[ThinkerToken | None]
    ) -> list[TalkerFrame]:
        return [
            TalkerFrame(None if token is None else token.conditioning, token is None or token.finished)
            for token in tokens
        ]

    def codec_decode(self, states: list[ModelState], codes: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(pcm, dtype=np.float32) for pcm in codes]
