"""The messages Twilio sends on a bidirectional Media Stream, by their exact JSON shapes.

Required fields are required and typed strictly (sequence numbers, chunks and timestamps are
digit strings, sample rates are numbers); fields Twilio may add later are allowed and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, StringConstraints, ValidationError

# Counters of one call never get near 18 digits; int() refuses strings past 4300 of them.
Digits = Annotated[str, StringConstraints(pattern=r"^[0-9]+$", max_length=18)]
DtmfDigit = Annotated[str, StringConstraints(pattern=r"^[0-9*#A-D]$")]


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class Connected(_Loose):
    event: Literal["connected"]
    protocol: str
    version: str


class MediaFormat(_Loose):
    encoding: str
    sampleRate: int
    channels: int


class StartBody(_Loose):
    streamSid: str
    accountSid: str
    callSid: str
    tracks: list[str]
    customParameters: dict[str, Any]
    mediaFormat: MediaFormat


class Start(_Loose):
    event: Literal["start"]
    sequenceNumber: Digits
    streamSid: str
    start: StartBody


class MediaBody(_Loose):
    track: str
    chunk: Digits
    timestamp: Digits
    payload: str


class Media(_Loose):
    event: Literal["media"]
    sequenceNumber: Digits
    streamSid: str
    media: MediaBody


class DtmfBody(_Loose):
    track: str
    digit: DtmfDigit


class Dtmf(_Loose):
    event: Literal["dtmf"]
    sequenceNumber: Digits
    streamSid: str
    dtmf: DtmfBody


class MarkBody(_Loose):
    name: str


class Mark(_Loose):
    event: Literal["mark"]
    sequenceNumber: Digits
    streamSid: str
    mark: MarkBody


class StopBody(_Loose):
    accountSid: str
    callSid: str


class Stop(_Loose):
    event: Literal["stop"]
    sequenceNumber: Digits
    streamSid: str
    stop: StopBody


MESSAGES: dict[str, type[_Loose]] = {
    "connected": Connected,
    "start": Start,
    "media": Media,
    "dtmf": Dtmf,
    "mark": Mark,
    "stop": Stop,
}


def first_problem(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(part) for part in err["loc"]) or "message"
    return f"{where}: {err['msg']}"
