"""Input transcription that streams, so a page can show live captions.

While the user speaks (or, without turn detection, while audio comes in), the recogniser hears
the uncommitted audio again after every `PARTIAL_SAMPLES` of it; the words two hypotheses in a
row agree on (of the first, all but its last word) are stable, and go out as
`conversation.item.input_audio_transcription.delta` for the item the audio will become. The final recognition after the commit is told the words
already sent (`Hints.prefix`) and goes on from them, so the deltas add up to the transcript
that `completed` carries; a commit while a partial is still out waits for it, so its words
go first. One partial is in flight per session at most: on a busy recogniser they come less
often, never pile up. The first comes once the speech has lasted `PARTIAL_SAMPLES`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from duplex.media.rates import ASR_RATE

PARTIAL_SAMPLES = ASR_RATE
"""New audio (at the recogniser's rate) after which the uncommitted audio is heard again."""


@dataclass
class _Partial:
    item_id: str
    heard: int
    """Samples the latest partial heard (at first: when speech started)."""
    sent: str = ""
    """The transcript's start already sent as deltas."""
    last: str = ""
    """The latest hypothesis."""
    waiting: bool = False
    final: Callable[[str], Any] | None = None
    """Committed while a partial was out: what asks for the final transcript once it is in."""


def _stable(last: str, new: str) -> str:
    """The start of `new` whose words `last` begins with too; of a first hypothesis, all but
    its last word (which the audio may have cut)."""
    words = list(re.finditer(r"\S+", new))
    if not last:
        return new[: words[-2].end()] if len(words) > 1 else ""
    agreed = 0
    for a, b in zip(last.split(), (w.group() for w in words), strict=False):
        if a != b:
            break
        agreed += 1
    return new[: words[agreed - 1].end()] if agreed else ""


class LiveTranscript:
    def __init__(self) -> None:
        self.partial: _Partial | None = None
        """The uncommitted audio's."""
        self.held: dict[str, _Partial] = {}
        """Committed items whose final recognition waits for their partial still out."""
        self.sent: dict[str, str] = {}
        """What was sent of each committed item's transcript before its final recognition."""

    def due(self, item_id: str, heard: int) -> bool:
        """Whether to hear the uncommitted audio again now (`heard` samples of it so far); if
        so, the partial is counted as asked for."""
        p = self.partial
        if p is None or p.item_id != item_id:
            p = self.partial = _Partial(item_id, heard)
        if p.waiting or heard - p.heard < PARTIAL_SAMPLES:
            return False
        p.heard, p.waiting = heard, True
        return True

    def prefix(self, item_id: str) -> str:
        p = self.partial
        return p.sent if p is not None and p.item_id == item_id else ""

    def committed(self, item_id: str, final: Callable[[str], Any]) -> Any:
        """The audio became item `item_id`; `final(sent)` asks for its transcript, going on
        from the start already sent. Returns that request, or None while a partial is still out
        (its words go first: `on_partial` returns the request then)."""
        p = self.partial if self.partial is not None and self.partial.item_id == item_id else None
        self.partial = None
        if p is not None and p.waiting:
            p.final = final
            self.held[item_id] = p
            return None
        sent = p.sent if p is not None else ""
        self.sent[item_id] = sent
        return final(sent)

    def cleared(self) -> None:
        self.partial = None

    def on_partial(self, item_id: str, text: str) -> tuple[str, Any]:
        """A partial hypothesis: the delta to send (maybe none), and the final request it held
        back (if the audio was committed meanwhile)."""
        p = self.partial
        if p is None or p.item_id != item_id:
            p = self.held.pop(item_id, None)
        if p is None:
            return "", None
        p.waiting = False
        stable = _stable(p.last, text)
        p.last = text
        delta = ""
        if len(stable) > len(p.sent) and stable.startswith(p.sent):
            delta, p.sent = stable[len(p.sent):], stable
        if p.final is None:
            return delta, None
        self.sent[item_id] = p.sent
        return delta, p.final(p.sent)

    def on_final(self, item_id: str, text: str) -> str:
        """The final transcript: the delta that completes what was sent."""
        sent = self.sent.pop(item_id, "")
        return text[len(sent):] if text.startswith(sent) else ""
