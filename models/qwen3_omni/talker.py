"""The Talker and its code predictor, fed as `Qwen3OmniMoeForConditionalGeneration.generate` feeds
them, made incremental and batched across sessions.

The Thinker hands over its user-turn and assistant-prefix positions as it computes them
(`take_context`) and a Talker-space embedding of every reply token (`conditioning`). At a reply's
first step the Talker is prefilled with the user turns and the assistant prefix; after that each
step consumes one codec frame plus one Thinker token (or tts_eos, then tts_pad) and yields the
next frame: codebook 0 from the Talker, codebooks 1..Q-1 from the code predictor.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers import DynamicCache

from models.base import TalkerFrame, ThinkerToken
from models.cuda_graphs import BucketGraphs, GraphSettings, step_counts
from models.paged_kv import PagedKV
from models.paged_static import StaticStep
from models.qwen3_omni import compat
from models.qwen3_omni.graphs import gumbel_draws, residual_graphs
from models.qwen3_omni.options import (
    Qwen3OmniOptions,
    Sampling,
    advance,
    counters,
    sample_rows,
    uniform64,
)
from models.qwen3_omni.session import PREFIX, USER, Session
from models.syncs import fetch, upload


class Talker:
    def __init__(self, model, kv: PagedKV, options: Qwen3OmniOptions, device, dtype,
                 graphs: GraphSettings | None = None) -> None:
        """`graphs`: whether the decode steps and the code predictor's frames run from fixed
        buffers, captured as CUDA graphs."""
        config = model.config.talker_config
        self.module = model.talker
        self.predictor = model.talker.code_predictor
        self.kv, self.options, self.device, self.dtype = kv, options, device, dtype
        # Audio and image positions reach the Talker as this Thinker layer's hidden states.
        self.accept_layer = config.accept_hidden_layer
        self.num_codes = config.num_code_groups
        self.codec_eos = config.codec_eos_token_id
        self.codec_suppress = _codec_suppress(config, self.predictor.config.vocab_size).to(device)
        self.tts_bos, self.tts_eos, self.tts_pad = _tts_embeddings(model, device)
        self.voices = tuple(sorted(config.speaker_id))
        # Each speaker's fixed part of the assistant prefix, built once.
        self._prefixes = {
            voice: _assistant_prefix(model, voice, self.tts_pad, self.tts_bos, device)
            for voice in self.voices
        }
        if options.speaker.lower() not in self._prefixes:
            raise ValueError(f"unknown speaker {options.speaker!r}; have {list(self.voices)}")
        graphs = graphs or GraphSettings()
        self.graphs = residual_graphs(
            self.predictor, self.module.get_input_embeddings(), self.num_codes,
            options.residual_sampling, device, dtype, graphs,
        )
        hidden = config.text_config.hidden_size
        self.step_graphs = BucketGraphs(
            "Talker decode",
            lambda batch: StaticStep(self.module.model, compat.TALKER_CACHE, kv, batch, hidden,
                                     dtype),
            graphs.capture, graphs.pool) if graphs.static else None
        self.steps = step_counts()
        """Decode steps (the one-position rows of a step call) by how they ran."""
        self.frames = step_counts()
        """The code predictor's frames by how they ran."""

    def conditioning(self, embeds: torch.Tensor) -> torch.Tensor:
        """Thinker input embeddings of reply tokens -> the Talker's text input for them."""
        return self.module.text_projection(embeds)

    def take_context(self, sessions: list[Session], embeds: torch.Tensor,
                     accepted: torch.Tensor | None, role: np.ndarray,
                     multimodal: np.ndarray) -> None:
        """Project the user-turn and assistant-prefix positions as generate does for the Talker.

        Text positions go through `text_projection` of their input embedding, audio and image
        positions through `hidden_projection` of the Thinker layer `accept_hidden_layer`.
        `role` and `multimodal` (B, q) are the host's: which positions those are is known
        there, so one gather takes them, with no mask read back from the device.
        """
        user, prefix = role == USER, role == PREFIX
        if not (user.any() or prefix.any()):
            return
        # User positions of every row, then prefix positions of every row, row-major: each
        # session's share is a run of known length.
        chosen = np.concatenate([np.flatnonzero(user), np.flatnonzero(prefix)])
        audio = multimodal.reshape(-1)[chosen]
        text_at, audio_at = np.flatnonzero(~audio), np.flatnonzero(audio)
        index = upload(np.concatenate([chosen[text_at], text_at, chosen[audio_at], audio_at]),
                       self.device)
        n_text, n_audio = len(text_at), len(audio_at)
        text_from, text_to = index[:n_text], index[n_text : 2 * n_text]
        audio_from, audio_to = index[2 * n_text : 2 * n_text + n_audio], index[2 * n_text + n_audio :]
        ctx = embeds.new_empty(len(chosen), self.module.config.text_config.hidden_size)
        if n_text:
            flat = embeds.flatten(0, 1).index_select(0, text_from)
            ctx.index_copy_(0, text_to, self.module.text_projection(flat))
        if n_audio:
            flat = accepted.flatten(0, 1).index_select(0, audio_from)
            ctx.index_copy_(0, audio_to, self.module.hidden_projection(flat))
        counts = [*user.sum(1).tolist(), *prefix.sum(1).tolist()]
        parts = ctx.split(counts)
        limit = self.options.talker_context
        for b, sess in enumerate(sessions):
            if counts[b]:
                sess.talker_ctx.append(parts[b])
                sess.talker_taken += counts[b]
                total = sum(t.shape[0] for t in sess.talker_ctx)
                if total > limit:
                    sess.talker_ctx = [torch.cat(sess.talker_ctx)[total - limit :]]
            if counts[len(sessions) + b]:
                sess.talker_prefix = parts[len(sessions) + b]

    def step(self, sessions: list[Session], tokens: list[ThinkerToken | None]) -> list[TalkerFrame]:
        rows: list[tuple[Session, torch.Tensor | None]] = []
        frames: dict[int, TalkerFrame] = {}
        for sess, tok in zip(sessions, tokens, strict=True):
            if tok is not None and sess.responding and not sess.talker_done:
                if tok.conditioning is not None:
                    sess.text_queue.append(tok.conditioning)
            if not sess.responding or sess.talker_done:
                frames[id(sess)] = TalkerFrame(None, True)
            elif sess.talker_slot is None:
                if not sess.text_queue:
                    # A reply whose text ended before it had any token has nothing to voice.
                    sess.talker_done = sess.thinker_done
                    frames[id(sess)] = TalkerFrame(None, sess.talker_done)
                else:
                    rows.append((sess, self._prefill_input(sess)))
            else:
                rows.append((sess, None))
        stepping = [sess for sess, x in rows if x is None]
        if stepping:
            # One frame in: the sum of its codebooks' embeddings plus one text position.
            codes = torch.stack([sess.last_codes for sess in stepping])
            step_inputs = iter(
                self._codec_sum(codes) + torch.stack([self._next_text(s) for s in stepping])
            )
            rows = [(sess, next(step_inputs)[None] if x is None else x) for sess, x in rows]
        if rows:
            # A reply's first step forwards its whole context, the others one position each:
            # in one forward every row would be padded to the longest (one such row among 32
            # doubled the call), so they go apart, and meet again to sample.
            rows.sort(key=lambda row: row[1].shape[0] > 1)
            groups = [([r for r in rows if r[1].shape[0] == 1], True),
                      ([r for r in rows if r[1].shape[0] > 1], False)]
            last = torch.cat([self._last_hidden(group, step) for group, step in groups if group])
            for sess, frame in zip((s for s, _ in rows), self._frames(rows, last), strict=True):
                frames[id(sess)] = frame
        return [frames[id(s)] for s in sessions]

    def _prefill_input(self, sess: Session) -> torch.Tensor:
        first = sess.text_queue.popleft()
        # generate()'s assistant prefix: <|im_start|>assistant\n with no codec part, the fixed
        # middle, then the first text token together with codec_bos.
        middle, codec_bos = self._prefixes[sess.voice or self.options.speaker.lower()]
        assistant = torch.cat([sess.talker_prefix, middle, (first + codec_bos)[None]])
        sess.talker_slot = self.kv.acquire(sess.sid)
        return torch.cat([*sess.talker_ctx, assistant])

    def _next_text(self, sess: Session) -> torch.Tensor:
        if sess.text_queue:
            return sess.text_queue.popleft()
        if sess.thinker_done and not sess.eos_sent:
            sess.eos_sent = True
            return self.tts_eos
        return self.tts_pad

    def _codec_sum(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, Q) codes -> the Talker input embedding of that frame, the sum of all codebooks."""
        total = self.module.get_input_embeddings()(codes[:, 0])
        for k, emb in enumerate(self.predictor.get_input_embeddings()):
            total = total + emb(codes[:, k + 1])
        return total

    def _last_hidden(self, rows: list[tuple[Session, torch.Tensor]],
                     step: bool = False) -> torch.Tensor:
        """One forward of the rows' new positions -> each row's last hidden state (B, H).
        `step`: one position each, a decode step."""
        sessions = [s for s, _ in rows]
        new = [x.shape[0] for _, x in rows]
        q, ends = max(new), np.array(new) - 1
        embeds = torch.nn.utils.rnn.pad_sequence([x for _, x in rows], batch_first=True)
        # Padding repeats a row's last position so rotary phases stay in range.
        positions = np.array([s.talker_pos for s in sessions])[:, None] + np.minimum(
            np.arange(q)[None], ends[:, None])
        slots, owners = [s.talker_slot for s in sessions], [s.sid for s in sessions]
        graphs = self.step_graphs
        if step and q == 1 and graphs is not None and graphs.holds(len(rows)):
            meta = self.kv.plan(slots, owners, new)
            static = graphs.static(len(rows))
            static.load(embeds, upload(positions, self.device)[None].expand(3, -1, -1), meta)
            self.steps[graphs.run(len(rows))] += 1
            self.kv.commit(slots, new)
            last = static.hidden[: len(rows)].clone()
        else:
            kv = self.kv.bind(slots, owners, new)
            out = self.module.model(
                inputs_embeds=embeds,
                attention_mask=kv.mask,
                position_ids=upload(positions, self.device)[None].expand(3, -1, -1),
                **{compat.TALKER_CACHE: kv},
                use_cache=True,
            )
            kv.commit()
            if step:
                self.steps["eager"] += 1
            at = upload(ends, self.device)
            last = out.last_hidden_state[torch.arange(len(rows), device=self.device), at]
        for sess, n in zip(sessions, new, strict=True):
            sess.talker_pos += n
        return last

    def _frames(self, rows: list[tuple[Session, torch.Tensor]],
                last: torch.Tensor) -> list[TalkerFrame]:
        """The rows' last hidden states -> their next frames (codebook 0, then the rest)."""
        opts = self.options
        sessions = [s for s, _ in rows]
        logits = self.module.codec_head(last).float()
        logits.masked_fill_(self.codec_suppress, -math.inf)
        early = [sess.frames < opts.min_frames for sess in sessions]
        if any(early):
            logits[:, self.codec_eos].masked_fill_(upload(early, self.device, torch.bool),
                                                   -math.inf)
        first = sample_rows(logits, [_sampling(s, opts.talker_sampling) for s in sessions],
                            [s.talker_gen for s in sessions])
        # Every row's residual codes before the one read back: a row that drew codec EOS
        # wastes a little work, where reading first would drain the device queue mid-step.
        codes = self._residual_codes(last, first, sessions)
        result = []
        for b, (sess, code) in enumerate(zip(sessions, fetch(first).tolist(), strict=True)):
            if code == self.codec_eos:
                sess.talker_done = True
                result.append(TalkerFrame(None, True))
                continue
            frame = codes[b]
            sess.last_codes = frame
            sess.frames += 1
            sess.talker_done = sess.frames >= opts.max_frames
            result.append(TalkerFrame(frame, sess.talker_done))
        for sess in sessions:
            if sess.talker_done:
                # The reply's last frames still go through the codec; its Talker KV is done.
                self.kv.release(sess.talker_slot, sess.sid)
                sess.talker_slot = None
        return result

    def _residual_codes(self, hidden: torch.Tensor, first: torch.Tensor,
                        sessions: list[Session]) -> torch.Tensor:
        """Codebooks 1..Q-1 from the code predictor, for all rows at once -> (B, Q)."""
        samplings = [_sampling(s, self.options.residual_sampling) for s in sessions]
        streams = [s.talker_gen for s in sessions]
        drawing = [sampling.temperature > 0 for sampling in samplings]
        if self.graphs is not None and self.graphs.holds(len(sessions)):
            greedy = upload([not d for d in drawing], self.device, torch.bool)
            codes, how = self.graphs(hidden, first, counters(streams, self.device), greedy)
            self.frames[how] += 1
            advance(streams, gumbel_draws(self.num_codes, self.predictor.config.vocab_size),
                    drawing)
            return codes
        self.frames["eager"] += 1
        predictor = self.predictor
        cache = DynamicCache(config=predictor.config)
        x = torch.stack([hidden, self.module.get_input_embeddings()(first)], dim=1)
        steps = self.num_codes - 1
        noise = uniform64(counters(streams, self.device), steps) if any(drawing) else None
        advance(streams, steps, drawing)
        codes = [first]
        for k in range(steps):
            if k:
                x = predictor.get_input_embeddings()[k - 1](codes[-1])[:, None]
            h = predictor.model(inputs_embeds=x, **{compat.CODE_PREDICTOR_CACHE: cache},
                                use_cache=True).last_hidden_state
            logits = predictor.lm_head[k](h[:, -1]).float()
            codes.append(sample_rows(logits, samplings, streams,
                                     None if noise is None else noise[:, k]))
        return torch.stack(codes, dim=1)


def _sampling(sess: Session, own: Sampling) -> Sampling:
    """A reply asked to be greedy (temperature 0) is greedy in its audio codes too, so the same
    context gives the same audio; any other temperature is the Thinker's, and the codes keep
    the checkpoint's own sampling, as generate() keeps talker_temperature apart."""
    return Sampling() if sess.temperature == 0 else own


def _codec_suppress(config, codebook: int) -> torch.Tensor:
    """Talker ids that are neither a code nor codec EOS: never sampled."""
    allowed = torch.zeros(config.text_config.vocab_size, dtype=torch.bool)
    allowed[:codebook] = True
    allowed[config.codec_eos_token_id] = True
    return ~allowed


@torch.inference_mode()
def _tts_embeddings(model, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tts_bos, tts_eos and tts_pad as Talker text inputs."""
    config = model.config
    special = torch.tensor(
        [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id],
        device=device,
    )
    return model.talker.text_projection(model.thinker.get_input_embeddings()(special)).unbind(0)


@torch.inference_mode()
def _assistant_prefix(
    model, speaker: str, tts_pad: torch.Tensor, tts_bos: torch.Tensor, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions 3..7 of generate's assistant prefix (0..2 and 8 depend on the reply), and the
    codec_bos embedding that position 8 adds to the first text token."""
    config = model.config.talker_config
    speaker = speaker.lower()
    if speaker not in config.speaker_id:
        raise ValueError(f"unknown speaker {speaker!r}; have {sorted(config.speaker_id)}")
    codec_prefix = torch.tensor(
        [
            config.codec_nothink_id,
            config.codec_think_bos_id,
            config.codec_think_eos_id,
            config.speaker_id[speaker],
            config.codec_pad_id,
            config.codec_bos_id,
        ],
        device=device,
    )
    codec_part = model.talker.get_input_embeddings()(codec_prefix)
    text_part = torch.stack([tts_pad] * 4 + [tts_bos])
    return text_part + codec_part[:5], codec_part[5]
