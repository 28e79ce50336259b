"""What a resume continues from: the conversation as the listener heard it and the session's
settings (`snapshot`), and how much of a reply was heard (`heard`), both read at a clock
sample. `ResumeSession` asks the edge to claim a session from the registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from duplex.session.pacing import OutputPacer
from duplex.session.state import Session
from duplex.transport.realtime.conversation import Conversation, Item
from duplex.transport.realtime.session_config import SessionSettings


@dataclass(frozen=True)
class ResumeSession:
    """Look the session up in the registry and claim it; answer with `resumed` or
    `resume_failed`."""

    session_id: str
    resume_token: str


def snapshot(conversation: Conversation, settings: SessionSettings, core: Session,
             pacer: OutputPacer, now: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    played = pacer.played(now)
    items = []
    for item in conversation:
        record = item.record()
        transcript = _heard_transcript(core, item, played)
        if transcript is not None:
            record["transcript"] = transcript
        items.append(record)
    return items, settings.record()


def heard(core: Session, pacer: OutputPacer, core_id: int, now: int) -> int | None:
    if core_id >= len(core.responses):
        return None
    resp = core.responses[core_id]
    if resp.heard_samples is not None:
        return resp.heard_samples
    played = pacer.played(now) - resp.start_sample
    if not resp.generating and played >= resp.sent_samples:
        return None
    return max(0, played)


def _heard_transcript(core: Session, item: Item, played: int) -> str | None:
    if item.response_id is None or item.response_id >= len(core.responses):
        return item.transcript
    resp = core.responses[item.response_id]
    if resp.heard_samples is not None or played >= resp.start_sample + resp.sent_samples:
        return resp.transcript
    return resp.text_before(played - resp.start_sample)
