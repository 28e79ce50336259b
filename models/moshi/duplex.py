"""Moshi's native full duplex: every 80 ms, one user frame in and one Moshi frame out.

A lockstep step runs four batched calls over all sessions stepped in this tick: Mimi encode
of the user frame, one position of the main transformer (text token and the hidden state),
the depth transformer (Moshi's Q codes) and Mimi decode of Moshi's frame. Each session's
streaming state is its own (`ModelState` slots: the Mimi carries, the main decoder's
`SlidingKV`, the delayed-codebook tails in `_Turn`), so a session that joins starts from a fresh
state and one that leaves takes its state with it: neighbours never see either. That is what
moshi's `StreamingModule` does with its per-slot reset and exec masks, here per session object.

Codebooks 1..Q-1 run one position behind codebook 0 on both audio streams, so the step of
position t decodes Moshi's frame t - 1 (codebook 0 from the step before): the first step of a
session returns silence, and Moshi's output frame k leaves at the step of input frame k + 1,
a fixed delay of two frames on the timeline (`DUPLEX_DELAY_FRAMES`).

Text is greedy (argmax), so a session's output depends only on its own input: batched with
any neighbours it equals its output alone. The main decoder's window (`config.sliding_window`)
bounds what a session holds however long the call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from models.base import DuplexFrame, ModelState, StageTimer, is_voiced
from models.syncs import fetch, upload

if TYPE_CHECKING:
    from models.moshi.adapter import MoshiAdapter

DUPLEX_DELAY_FRAMES = 2


@torch.inference_mode()
def duplex_step(
    adapter: MoshiAdapter, states: list[ModelState], frames: list[np.ndarray], timer: StageTimer
) -> list[DuplexFrame]:
    n = len(states)
    turns = [s.slots["turn"] for s in states]
    with timer("encode", n):
        audio = upload(np.stack(frames), adapter._device, adapter._dtype)[:, None]
        user = adapter.encoder.encode([s.slots["encoder"] for s in states], audio)[:, :, 0]
    with timer("main", n):
        text_in = [t.text_in if t.frames else adapter.text_start for t in turns]
        text = upload(text_in, adapter._device)[:, None]
        moshi = torch.stack([t.moshi_in for t in turns])[:, :, None]
        delayed = torch.stack(
            [adapter._delay_user(t, u[:, None]) for t, u in zip(turns, user, strict=True)]
        )
        hidden = adapter._main_step(states, adapter._embed(text, moshi, delayed))
        hidden = adapter.model.decoder.model.norm(hidden)[:, -1]
        tokens = adapter.model.decoder.lm_head(hidden).argmax(-1)
    with timer("depth", n):
        codes = adapter._depth(hidden[:, None], tokens)
    token_ids = fetch(tokens).tolist()
    out_codes, rows = [], []
    for i, (turn, token, step_codes) in enumerate(zip(turns, token_ids, codes, strict=True)):
        turn.frames += 1
        turn.text_in = token
        if turn.pending_cb0 is not None:
            out_codes.append(torch.cat([turn.pending_cb0[None], step_codes[1:]]))
            rows.append(i)
        turn.pending_cb0 = step_codes[0].clone()
        turn.moshi_in = step_codes.clone()
    pcm = [np.zeros(adapter.frame_samples, np.float32) for _ in states]
    if rows:
        with timer("decode", len(rows)):
            audio = adapter.decoder.decode(
                [states[i].slots["decoder"] for i in rows], torch.stack(out_codes)[:, :, None]
            )
            decoded = fetch(audio[:, 0].float())
            for row, i in enumerate(rows):
                pcm[i] = decoded[row]
    result = []
    for i, token in enumerate(token_ids):
        text_piece = adapter.detokenize(token)
        result.append(DuplexFrame(pcm[i], text_piece, is_voiced(pcm[i]) or bool(text_piece)))
    return result
