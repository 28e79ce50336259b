"""Recorded human speech for end-of-turn decisions: 32 of Asterisk's English voice prompts,
spoken by Allison Smith, each one whole sentence.

Smart Turn judges prosody and wording, and on espeak-ng's speech it is near chance, so the
turn tests and `duplex bench --turns` speak these instead. Source: the Debian package
asterisk-core-sounds-en-g722 1.6.1-1 (Asterisk core sounds 1.6.1, G.722 at 16 kHz), licensed
CC BY-SA 3.0: the files in duplex/bench/prompts/ are the package's own, unchanged (its
README.md names the source and carries the licence). Each is decoded and cut to its speech
here, when it loads.

Which prompts: every one whose transcript is a single sentence of five words or more, 1.3 to
4.5 s long, with a pause inside its middle half (below), less three that are a sentence's tail
("letters of your party's first name", "press 1 to send...", "Un-identified or withheld and
therefore cannot be called back"). Chosen by that rule, not by what the model makes of them.

A sentence "paused in the middle" is its head up to the middle pause between two words, a
stretch of silence, then its tail: how a caller sounds who stops to think mid-sentence.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soxr

RECORDED_RATE = 16000
DIRECTORY = Path(__file__).with_name("prompts")
SOUND_LEVEL = 0.01
"""Above this (of full scale) a sample is speech; the recordings' noise floor is below it."""
_FRAME = RECORDED_RATE // 100
_MIN_PAUSE_FRAMES = 6
"""A pause between words is at least 60 ms below SOUND_LEVEL (RMS over 10 ms frames)."""

TEXTS = {
    "agent-newlocation": "Please enter a new extension, followed by pound.",
    "agent-pass": "Please enter your password followed by the pound key.",
    "cannot-complete-as-dialed": "Your call cannot be completed as dialed.",
    "check-number-dial-again": "Please check the number and dial again.",
    "conf-getchannel": "Please enter the channel number followed by the pound key.",
    "conf-getconfno": "Please enter your conference number followed by the pound key.",
    "conf-getpin": "Please enter the conference pin number.",
    "conf-leaderhasleft": "The leader has left the conference.",
    "conf-roll-callcomplete": "Playback of the list of people attending is complete.",
    "confbridge-lock-no-join": "The conference is currently locked and cannot be joined.",
    "confbridge-only-one": "There is currently one other participant in the conference.",
    "dir-nomatch": "No directory entries match your search.",
    "entr-num-rmv-blklist": "Please enter the number to be removed from the blacklist.",
    "feature-not-avail-line": "That feature is not available on this line.",
    "priv-recordintro": "At the tone, please say your name.",
    "privacy-incorrect": "I'm sorry, that number is not valid.",
    "privacy-prompt": "Please enter your phone number, starting with the area code.",
    "privacy-unident": "The party you are trying to reach does not accept unidentified calls.",
    "speed-dial-empty": "The speed dial entry you've accessed is empty.",
    "vm-delete": "Press 7 to delete this message.",
    "vm-helpexit": "Press star for help or pound to exit.",
    "vm-msgforwarded": "Your message has been successfully forwarded.",
    "vm-newpassword": "Please enter your new password followed by the pound key.",
    "vm-next": "Press 6 to play the next message.",
    "vm-rec-busy": "After the tone say your busy message and then press the pound key.",
    "vm-rec-name": "After the tone say your name and then press the pound key.",
    "vm-reenterpassword": "Please re-enter your password followed by the pound key.",
    "vm-repeat": "Press 5 to repeat the current message.",
    "vm-review-nonurgent": "Press 4 to remove the urgent status of this message.",
    "vm-review-urgent": "Press 4 to mark this message as urgent.",
    "vm-tmpexists": "There is a temporary greeting, which overrides your standard greetings.",
    "vm-whichbox": "To leave a message, please enter a mailbox number.",
}


@dataclass(frozen=True)
class Prompt:
    name: str
    text: str
    pcm: np.ndarray
    """Float32 from the first sounding sample to the last."""
    pause: tuple[int, int]
    """The middle pause between two words: where the head ends and the tail begins."""

    def paused(self, silence: int) -> np.ndarray:
        """The sentence with its middle pause stretched to `silence` samples."""
        a, b = self.pause
        return np.concatenate([self.pcm[:a], np.zeros(silence, np.float32), self.pcm[b:]])

    @property
    def head(self) -> np.ndarray:
        """The sentence up to its middle pause: cut off mid-sentence."""
        return self.pcm[: self.pause[0]]


def middle_pause(pcm: np.ndarray, rate: int) -> tuple[int, int]:
    """The pause between words nearest the middle of the pauses in the middle half of `pcm`."""
    frame = rate // 100
    n = len(pcm) // frame
    rms = np.sqrt(np.mean(pcm[: n * frame].reshape(n, frame) ** 2, axis=1))
    quiet = np.append(rms < SOUND_LEVEL, False)
    pauses, start = [], None
    for i, q in enumerate(quiet):
        if q and start is None:
            start = i
        elif not q and start is not None:
            if i - start >= _MIN_PAUSE_FRAMES and n // 4 <= start <= 3 * n // 4:
                pauses.append((start * frame, i * frame))
            start = None
    if not pauses:
        raise ValueError("no pause between words in the middle of the recording")
    return pauses[len(pauses) // 2]


@functools.cache
def prompts(rate: int = RECORDED_RATE) -> tuple[Prompt, ...]:
    """The bundled recordings as float32 at `rate`, in the order of TEXTS."""
    out = []
    for name, text in TEXTS.items():
        pcm = speech_only(_decode(DIRECTORY / f"{name}.g722"))
        a, b = middle_pause(pcm, RECORDED_RATE)
        if rate != RECORDED_RATE:
            pcm = soxr.resample(pcm, RECORDED_RATE, rate).astype(np.float32)
            a, b = a * rate // RECORDED_RATE, b * rate // RECORDED_RATE
        out.append(Prompt(name, text, pcm, (a, b)))
    return tuple(out)


def _decode(path: Path) -> np.ndarray:
    import av

    with av.open(str(path), format="g722") as container:
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
    pcm = np.concatenate(frames)
    return pcm if pcm.dtype == np.float32 else pcm.astype(np.float32) / 32768


def speech_only(pcm: np.ndarray) -> np.ndarray:
    """`pcm` from its first sounding sample to its last."""
    loud = np.flatnonzero(np.abs(pcm) > SOUND_LEVEL)
    return pcm[loud[0] : loud[-1] + 1] if loud.size else pcm[:0]
