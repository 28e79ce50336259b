"""The echo reference model: its reply is the user's committed audio, unchanged.

Deterministic and free of weights, it gives tests an exact oracle for the timeline: what goes
in comes back sample for sample, one codec frame per Talker step, after the turn ends.
Text: the reply's transcript is one word per frame ("frame0 frame1 ..."), so truncation at the
playback watermark is visible in the transcript too.
"""

from __future__ import annotations

import numpy as np

from models.base import DuplexModel, ModelState, TalkerFrame, ThinkerToken

RATE = 24000
FRAME = 1920


class EchoModel(DuplexModel):
    name = "echo"
    input_rate = RATE
    output_rate = RATE
    input_chunk_samples = FRAME
    frame_samples = FRAME
    accepts_partial_chunks = True

    def new_state(self, session_id: str) -> ModelState:
        return ModelState(session_id, {"heard": [], "reply": None, "cursor": 0})

    def reset_response(self, state: ModelState) -> None:
        state.slots["reply"] = None
        state.slots["cursor"] = 0

    def free(self, state: ModelState) -> None:
        state.slots.clear()

    def bytes_held(self, state: ModelState) -> int:
        heard = sum(chunk.nbytes for chunk in state.slots.get("heard", []))
        reply = state.slots.get("reply")
        return heard + (reply.nbytes if reply is not None else 0)

    def encode_audio(self, states: list[ModelState], chunks: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(chunk, dtype=np.float32).copy() for chunk in chunks]

    def clear_input(self, state: ModelState) -> None:
        state.slots["heard"] = []

    def thinker_prefill(self, states: list[ModelState], features: list[np.ndarray]) -> None:
        for state, feature in zip(states, features, strict=True):
            state.slots["heard"].append(feature)

    def begin_response(self, state: ModelState) -> None:
        heard = state.slots["heard"]
        reply = np.concatenate(heard) if heard else np.zeros(0, np.float32)
        state.slots["heard"] = []
        state.slots["reply"] = reply
        state.slots["cursor"] = 0

    def thinker_decode(self, states: list[ModelState]) -> list[ThinkerToken]:
        out = []
        for state in states:
            reply, cursor = state.slots["reply"], state.slots["cursor"]
            n_frames = -(-len(reply) // FRAME)
            index = cursor // FRAME
            state.slots["cursor"] = cursor + FRAME
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
