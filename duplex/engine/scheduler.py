"""The engine's scheduler: plain data in, a plain-data step plan out, results applied after.

Modelled on vLLM v1: `schedule(now)` returns which sessions each stage runs this step (slots,
epochs, payloads); the executor runs one batched model call per stage; `update(plan, results)`
routes each result to the next stage. No model and no threads here, so it is tested directly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from duplex.engine.payload import INPUT_KINDS, Kind, Payload
from duplex.engine.thinker_text import Piece, Speech, ThinkerText
from duplex.media.rates import REALTIME_RATE
from models.base import Mark, ReplyTurn, Rewind, TalkerFrame, TextTurn, ThinkerToken
from models.reply import ReplySpec


class Stage(StrEnum):
    ENCODE = "encode"
    VISION = "vision"
    PREFILL = "prefill"
    THINKER = "thinker"
    TALKER = "talker"
    CODEC = "codec"


# Downstream first: a frame already on its way out never waits behind new input.
STAGE_ORDER = (
    Stage.CODEC, Stage.TALKER, Stage.THINKER, Stage.PREFILL, Stage.ENCODE, Stage.VISION,
)


class EngineFull(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Entry:
    session_id: str
    slot: int
    epoch: int
    payload: Payload | None = None


@dataclass(frozen=True, slots=True)
class StageBatch:
    stage: Stage
    entries: tuple[Entry, ...]


@dataclass(frozen=True, slots=True)
class Drop:
    session_id: str
    kind: str
    n: int
    nbytes: int
    reason: str


@dataclass(frozen=True, slots=True)
class StepPlan:
    begin: tuple[Entry, ...]
    """Sessions whose reply starts this step: all their committed input is prefilled."""
    batches: tuple[StageBatch, ...]

    @property
    def empty(self) -> bool:
        return not self.begin and not self.batches


@dataclass
class StageResults:
    """What each stage's batched call returned, in the order of that stage's plan entries."""

    encoded: list[Any] = field(default_factory=list)
    """Features of audio chunks (ENCODE)."""
    seen: list[Any] = field(default_factory=list)
    """Features of camera frames (VISION)."""
    prefilled: list[None] = field(default_factory=list)
    tokens: list[ThinkerToken] = field(default_factory=list)
    frames: list[TalkerFrame] = field(default_factory=list)
    pcm: list[Any] = field(default_factory=list)
    """Float32 audio per codec call (CODEC)."""

    def put(self, stage: Stage, out: list[Any]) -> None:
        setattr(self, _RESULT_FIELD[stage], out)

    def of(self, stage: Stage) -> list[Any]:
        return getattr(self, _RESULT_FIELD[stage])


_RESULT_FIELD = {
    Stage.ENCODE: "encoded", Stage.VISION: "seen", Stage.PREFILL: "prefilled",
    Stage.THINKER: "tokens", Stage.TALKER: "frames", Stage.CODEC: "pcm",
}


@dataclass(frozen=True, slots=True)
class AudioOut:
    session_id: str
    epoch: int
    seq: int
    pcm: Any
    text: str
    media_start: int


@dataclass(frozen=True, slots=True)
class ResponseFinished:
    session_id: str
    epoch: int
    n_samples: int
    reason: str = "completed"
    """completed, max_output_tokens when the reply was cut at its token limit,
    context_length_exceeded when its context was full and truncation disabled, or server_full
    when the KV memory had no room for it."""
    usage: dict[str, Any] | None = None
    """What the model reported of the reply's context, and `output_tokens`."""


@dataclass(frozen=True, slots=True)
class TextOut:
    """Text of a text-only reply, as the Thinker writes it (no audio to pace it by)."""

    session_id: str
    epoch: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallOut:
    """A piece of a tool call the Thinker is writing: started, arguments, or done."""

    session_id: str
    epoch: int
    piece: Piece


@dataclass(frozen=True, slots=True)
class ReplyTokens:
    """Consecutive token ids of the reply, the first its `start`-th token (unvoiced ones go out
    at once, voiced ones with their audio, so they may arrive out of order); `media_start` is
    where the audio voicing them starts in the reply (output samples), None for tokens never
    voiced (text replies, tool calls)."""

    session_id: str
    epoch: int
    ids: tuple[int, ...]
    media_start: int | None
    start: int


@dataclass(frozen=True, slots=True)
class SessionFailed:
    """The session can no longer be served: the model raised on a batch holding it (the engine
    has closed it), the engine process died, or the engine process could not open it."""

    session_id: str
    message: str


@dataclass(frozen=True, slots=True)
class ResponseTimings:
    """Milliseconds from the reply request to each stage's first output (first audio time)."""

    session_id: str
    epoch: int
    input_ms: float
    """Encoding and prefill of the input still queued when the reply was asked for."""
    thinker_first_token_ms: float
    talker_first_codes_ms: float
    codec_first_audio_ms: float


EngineEvent = (AudioOut | TextOut | ToolCallOut | ResponseFinished | ResponseTimings
               | ReplyTokens)


@dataclass
class Response:
    epoch: int
    spec: ReplySpec = field(default_factory=ReplySpec)
    requested_at: float = 0.0
    begun_at: float = 0.0
    first_token_at: float | None = None
    first_codes_at: float | None = None
    thinker_done: bool = False
    talker_done: bool = False
    emitted_samples: int = 0
    first_audio_at: float | None = None
    out_seq: int = 0
    tokens: int = 0
    finish_reason: str = "completed"
    text: ThinkerText = field(default_factory=ThinkerText)
    usage: dict[str, Any] | None = None
    pending_ids: list[int] = field(default_factory=list)
    """Token ids not yet on their way to the Talker (inside a tool call, or no frame yet)."""
    ids_start: int = 0
    """The place in the reply of `pending_ids[0]`."""


@dataclass(frozen=True, slots=True)
class PendingReply:
    """A requested reply: it begins once input before `input_seq` is in the Thinker context."""

    epoch: int
    input_seq: int
    requested_at: float
    spec: ReplySpec


@dataclass
class SessionQueues:
    session_id: str
    slot: int
    epoch: int = 0
    queues: dict[Kind, deque[Payload]] = field(
        default_factory=lambda: {kind: deque() for kind in Kind if kind is not Kind.PCM_OUT}
    )
    input_seq: int = 0
    input_samples: int = 0
    prefilled_seq: int = 0
    commit: PendingReply | None = None
    response: Response | None = None

    def queued_bytes(self) -> int:
        return sum(p.nbytes for q in self.queues.values() for p in q)


@dataclass
class SchedulerConfig:
    max_batch: int = 64
    token_lead: int = 4
    """Thinker tokens a session may have waiting for its Talker before the Thinker pauses."""
    codes_lead: int = 2
    audio_lead_s: float = 1.0
    """Reply audio generated ahead of real time (after the first frame) before the Talker waits."""
    batch_window_s: float = 0.4
    """When one session's Talker is due, sessions due within this much later join its batch."""
    encode_wait_s: float = 0.03
    """Input chunks and frames wait up to this long so several sessions share one encode."""
    output_rate: int = REALTIME_RATE
    """The model's output rate; the engine sets it from the model."""


class Scheduler:
    def __init__(self, capacity: int, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.slots: list[str | None] = [None] * capacity
        self.sessions: dict[str, SessionQueues] = {}
        self.drops: list[Drop] = []

    # -- lifecycle ------------------------------------------------------------------------

    def add_session(self, session_id: str) -> int:
        if session_id in self.sessions:
            raise KeyError(f"session {session_id} is already scheduled")
        try:
            slot = self.slots.index(None)
        except ValueError:
            raise EngineFull(f"all {len(self.slots)} engine slots are in use") from None
        self.slots[slot] = session_id
        self.sessions[session_id] = SessionQueues(session_id, slot)
        return slot

    def remove_session(self, session_id: str) -> SessionQueues:
        sq = self.sessions.pop(session_id)
        self._drop_where(sq, lambda p: True, "closed")
        self.slots[sq.slot] = None
        return sq

    def push_input(self, session_id: str, pcm: Any, now: float, version: str) -> None:
        self._push(session_id, Kind.PCM_IN, pcm, len(pcm), now, version)

    def push_frame(self, session_id: str, frame: Any, now: float, version: str) -> None:
        """A sampled camera frame, placed in the input sequence at the audio received so far."""
        self._push(session_id, Kind.FRAME_IN, frame, 0, now, version)

    def push_text(self, session_id: str, turn: TextTurn | ReplyTurn | Mark | Rewind, now: float,
                  version: str) -> None:
        """Text (and a context's marks and rewinds) needs no encoder: it joins the encoded
        input directly, in arrival order."""
        self._push(session_id, Kind.FEATURES, turn, 0, now, version)

    def _push(self, session_id: str, kind: Kind, data: Any, n_samples: int, now: float,
              version: str) -> None:
        """Input of any kind takes the next place in the session's one input sequence."""
        sq = self.sessions[session_id]
        start = sq.input_samples
        sq.queues[kind].append(
            Payload(
                session_id, sq.epoch, kind, data, sq.input_seq, start, start + n_samples,
                version, enqueued_at=now,
            )
        )
        sq.input_seq += 1
        sq.input_samples += n_samples

    def commit(self, session_id: str, epoch: int, now: float = 0.0,
               spec: ReplySpec | None = None) -> None:
        """Request a reply in `epoch` to everything pushed so far."""
        sq = self.sessions[session_id]
        if epoch != sq.epoch:
            self.drops.append(Drop(session_id, "commit", 1, 0, "stale_epoch"))
            return
        sq.commit = PendingReply(epoch, sq.input_seq, now, spec or ReplySpec())

    def clear_input(self, session_id: str) -> None:
        """Drop input not yet in the Thinker context (the user cleared the input buffer)."""
        sq = self.sessions[session_id]
        self._drop_where(sq, lambda p: p.kind in INPUT_KINDS, "cleared")
        # Dropped input counts as handled, so a reply waiting on it is not held up forever.
        sq.prefilled_seq = sq.input_seq

    def cancel(self, session_id: str, new_epoch: int) -> None:
        """Fence off every reply payload older than `new_epoch` and forget the reply."""
        sq = self.sessions[session_id]
        if new_epoch <= sq.epoch:
            return
        sq.epoch = new_epoch
        sq.response = None
        sq.commit = None
        self._drop_where(sq, lambda p: p.kind not in INPUT_KINDS, "stale_epoch")

    def _drop_where(self, sq: SessionQueues, pred, reason: str) -> None:
        for kind, queue in sq.queues.items():
            gone = [p for p in queue if pred(p)]
            if gone:
                sq.queues[kind] = deque(p for p in queue if not pred(p))
                self.drops.append(
                    Drop(sq.session_id, kind, len(gone), sum(p.nbytes for p in gone), reason)
                )

    # -- planning -------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        cfg = self.config
        picks: dict[Stage, list[Entry]] = {stage: [] for stage in Stage}
        begin: list[Entry] = []
        talker_ready: list[tuple[float, SessionQueues]] = []
        due = {Kind.PCM_IN: False, Kind.FRAME_IN: False}
        for sq in self.sessions.values():
            q = sq.queues
            r = sq.response
            if q[Kind.CODES]:
                picks[Stage.CODEC].append(self._entry(sq, q[Kind.CODES].popleft()))
            if (r is not None and r.spec.audio and not r.talker_done
                    and len(q[Kind.CODES]) < cfg.codes_lead):
                if q[Kind.TOKENS] or r.thinker_done:
                    talker_ready.append((self._ahead_s(r, now), sq))
            if r is not None and not r.thinker_done and len(q[Kind.TOKENS]) < cfg.token_lead:
                picks[Stage.THINKER].append(self._entry(sq))
            marker = sq.commit.input_seq if sq.commit is not None else None
            if sq.commit is not None and sq.prefilled_seq >= marker and r is None:
                sq.response = Response(epoch=sq.epoch, spec=sq.commit.spec,
                                       requested_at=sq.commit.requested_at, begun_at=now)
                sq.commit = None
                begin.append(self._entry(sq))
            elif q[Kind.FEATURES] and (r is None or r.thinker_done):
                # Input enters the Thinker strictly in arrival order, audio and video alike.
                head = q[Kind.FEATURES][0]
                if head.seq == sq.prefilled_seq and (marker is None or head.seq < marker):
                    picks[Stage.PREFILL].append(self._entry(sq, q[Kind.FEATURES].popleft()))
            for kind in (Kind.PCM_IN, Kind.FRAME_IN):
                if q[kind]:
                    waited = now - q[kind][0].enqueued_at
                    due[kind] |= waited >= cfg.encode_wait_s or marker is not None
        # Talkers run by playback deadline: once one is due, those due soon after join it.
        if any(ahead < cfg.audio_lead_s for ahead, _ in talker_ready):
            for ahead, sq in talker_ready:
                if ahead < cfg.audio_lead_s + cfg.batch_window_s:
                    q = sq.queues[Kind.TOKENS]
                    picks[Stage.TALKER].append(self._entry(sq, q.popleft() if q else None))
        # Encoders wait briefly for other sessions' input, then take one item of each.
        for kind, stage in ((Kind.PCM_IN, Stage.ENCODE), (Kind.FRAME_IN, Stage.VISION)):
            waiting = [sq for sq in self.sessions.values() if sq.queues[kind]]
            if due[kind] or len(waiting) >= cfg.max_batch:
                picks[stage] += [self._entry(sq, sq.queues[kind].popleft()) for sq in waiting]
        batches = []
        for stage in STAGE_ORDER:
            chosen = picks[stage]
            # Past max_batch, the rest waits for the next step (and goes back in front).
            for extra in reversed(chosen[cfg.max_batch :]):
                self._requeue(stage, extra)
            if chosen[: cfg.max_batch]:
                batches.append(StageBatch(stage, tuple(chosen[: cfg.max_batch])))
        return StepPlan(tuple(begin), tuple(batches))

    @staticmethod
    def _entry(sq: SessionQueues, payload: Payload | None = None) -> Entry:
        return Entry(sq.session_id, sq.slot, sq.epoch, payload)

    def _ahead_s(self, r: Response, now: float) -> float:
        """Seconds of reply audio generated beyond what real-time playback has consumed."""
        if r.first_audio_at is None:
            return 0.0
        return r.emitted_samples / self.config.output_rate - (now - r.first_audio_at)

    def _requeue(self, stage: Stage, e: Entry) -> None:
        sq = self.sessions[e.session_id]
        if e.payload is not None:
            sq.queues[e.payload.kind].appendleft(e.payload)

    # -- results --------------------------------------------------------------------------

    @staticmethod
    def _timings(sq: SessionQueues, r: Response, now: float) -> ResponseTimings:
        def ms(t: float | None) -> float:
            return round(((t if t is not None else now) - r.requested_at) * 1000, 2)

        return ResponseTimings(
            sq.session_id, r.epoch, ms(r.begun_at), ms(r.first_token_at),
            ms(r.first_codes_at), ms(now),
        )

    def owner(self, e: Entry, *, output_path: bool) -> SessionQueues | None:
        """The session an entry's result belongs to, or None if it must be dropped.

        A slot reassigned since planning, a closed session, or (on the reply path) an epoch
        bumped since planning: the result goes nowhere.
        """
        sq = self.sessions.get(e.session_id)
        if sq is None or self.slots[e.slot] != e.session_id:
            self.drops.append(Drop(e.session_id, "result", 1, 0, "slot_reassigned"))
            return None
        if output_path and (e.epoch != sq.epoch or sq.response is None):
            self.drops.append(Drop(e.session_id, "result", 1, 0, "stale_epoch"))
            return None
        return sq

    def update(
        self, plan: StepPlan, results: StageResults, now: float, version: str
    ) -> list[EngineEvent]:
        out: list[EngineEvent] = []
        for batch in plan.batches:
            output_path = batch.stage in (Stage.THINKER, Stage.TALKER, Stage.CODEC)
            ends_reply = batch.stage in (Stage.TALKER, Stage.CODEC)
            apply = _APPLY_RESULT[batch.stage]
            for e, result in zip(batch.entries, results.of(batch.stage), strict=True):
                sq = self.owner(e, output_path=output_path)
                if sq is None:
                    continue
                apply(self, sq, e, result, now, version, out)
                if ends_reply:
                    self._maybe_finished(sq, out)
        return out

    def _features_ready(self, sq, e, result, now, version, out) -> None:
        """Encoded input takes its place among the features by its input sequence number."""
        p = e.payload
        features = sq.queues[Kind.FEATURES]
        at = next((i for i, f in enumerate(features) if f.seq > p.seq), len(features))
        features.insert(at, Payload(sq.session_id, p.epoch, Kind.FEATURES, result, p.seq,
                                    p.media_start, p.media_end, version, enqueued_at=now))

    def _prefilled(self, sq, e, result, now, version, out) -> None:
        sq.prefilled_seq = e.payload.seq + 1

    def _token(self, sq, e, result: ThinkerToken, now, version, out) -> None:
        """Speech goes on to the Talker (or out as text); tool calls go out apart, unvoiced."""
        r = sq.response
        r.tokens += 0 if result.reason is not None else 1
        finished = result.finished
        if result.reason is not None:
            r.finish_reason = result.reason
        if result.usage is not None:
            r.usage = result.usage
        if not finished and r.spec.max_output_tokens is not None \
                and r.tokens >= r.spec.max_output_tokens:
            finished, r.finish_reason = True, "max_output_tokens"
        pieces = r.text.feed(result.text) + (r.text.finish() if finished else [])
        speech = "".join(p.text for p in pieces if isinstance(p, Speech))
        out += [ToolCallOut(sq.session_id, sq.epoch, p) for p in pieces
                if not isinstance(p, Speech)]
        r.thinker_done = finished
        if r.first_token_at is None:
            r.first_token_at = now
        if result.token_id is not None:
            r.pending_ids.append(result.token_id)
        if not r.spec.audio or (r.text.in_call and not speech):
            self._unvoiced_ids(sq, r, out)
        if not r.spec.audio:
            if speech:
                out.append(TextOut(sq.session_id, sq.epoch, speech))
            if finished:
                out.append(ResponseFinished(sq.session_id, sq.epoch, 0, r.finish_reason,
                                            _usage(r)))
                sq.response = None
            return
        if speech or not r.text.in_call:
            token = ThinkerToken(speech, result.conditioning, finished)
            sq.queues[Kind.TOKENS].append(Payload(
                sq.session_id, sq.epoch, Kind.TOKENS, token, r.out_seq, 0, 0, version,
                final=finished, text=speech, enqueued_at=now, ids=tuple(r.pending_ids),
                ids_start=r.ids_start))
            r.ids_start += len(r.pending_ids)
            r.pending_ids = []
        if finished:
            self._unvoiced_ids(sq, r, out)

    @staticmethod
    def _unvoiced_ids(sq: SessionQueues, r: Response, out: list) -> None:
        if r.pending_ids:
            out.append(ReplyTokens(sq.session_id, sq.epoch, tuple(r.pending_ids), None,
                                   r.ids_start))
            r.ids_start += len(r.pending_ids)
            r.pending_ids = []

    def _codes(self, sq, e, result: TalkerFrame, now, version, out) -> None:
        r = sq.response
        ids = e.payload.ids if e.payload is not None else ()
        ids_start = e.payload.ids_start if e.payload is not None else 0
        if result.codes is not None:
            if r.first_codes_at is None:
                r.first_codes_at = now
            sq.queues[Kind.CODES].append(Payload(
                sq.session_id, sq.epoch, Kind.CODES, result.codes, r.out_seq, 0, 0, version,
                final=result.finished, text=e.payload.text if e.payload is not None else "",
                enqueued_at=now, ids=ids, ids_start=ids_start))
            r.out_seq += 1
        elif ids:
            # No frame voices them: they count as heard with the reply's end.
            out.append(ReplyTokens(sq.session_id, sq.epoch, ids, r.emitted_samples, ids_start))
        r.talker_done = result.finished

    def _audio(self, sq, e, result, now, version, out) -> None:
        r = sq.response
        if e.payload.ids:
            out.append(ReplyTokens(sq.session_id, sq.epoch, e.payload.ids, r.emitted_samples,
                                   e.payload.ids_start))
        if len(result):
            if r.first_audio_at is None:
                r.first_audio_at = now
                out.append(self._timings(sq, r, now))
            out.append(AudioOut(sq.session_id, sq.epoch, e.payload.seq, result, e.payload.text,
                                r.emitted_samples))
            r.emitted_samples += len(result)

    @staticmethod
    def _maybe_finished(sq: SessionQueues, out: list) -> None:
        r = sq.response
        if r is not None and r.talker_done and not sq.queues[Kind.CODES]:
            out.append(ResponseFinished(sq.session_id, sq.epoch, r.emitted_samples,
                                        r.finish_reason, _usage(r)))
            sq.response = None


def _usage(r: Response) -> dict[str, Any] | None:
    return None if r.usage is None else {**r.usage, "output_tokens": r.tokens}


_APPLY_RESULT = {
    Stage.ENCODE: Scheduler._features_ready,
    Stage.VISION: Scheduler._features_ready,
    Stage.PREFILL: Scheduler._prefilled,
    Stage.THINKER: Scheduler._token,
    Stage.TALKER: Scheduler._codes,
    Stage.CODEC: Scheduler._audio,
}
