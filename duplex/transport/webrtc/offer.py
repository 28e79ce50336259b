"""What an SDP offer must hold before aiortc is given it.

aiortc checks less than it relies on. Some offers it accepts fail later inside its own tasks,
where no caller hears of it and the call hangs half made (no DTLS fingerprint: an assertion in
the DTLS start); others leave a peer connection that cannot even be closed (a BUNDLE group led by
no media section: its transceivers end up with no transport). Refusing those here answers the
caller with the reason instead.
"""

from __future__ import annotations

from aiortc.sdp import MediaDescription, SessionDescription

# The sections aiortc makes transports for; others it ignores.
_CARRIED = ("audio", "video", "application")


def offer_problem(sdp: str) -> str | None:
    """Why `sdp` cannot be taken as an offer, in words for the caller; None when it can."""
    try:
        description = SessionDescription.parse(sdp)
    except Exception as exc:  # the parser fails with whatever the bad line makes it raise
        return f"it cannot be parsed ({type(exc).__name__}: {exc})"
    media = [m for m in description.media if m.kind in _CARRIED]
    if not any(m.kind == "audio" for m in media):
        return "it has no audio media section"
    for m in media:
        if problem := _section_problem(m):
            return f"media section {m.rtp.muxId or m.kind!r}: {problem}"
    mids = [m.rtp.muxId for m in media]
    for group in description.group:
        if group.semantic == "BUNDLE" and group.items and group.items[0] not in mids:
            return f"its BUNDLE group starts with {group.items[0]!r}, which names no media section"
    return None


def _section_problem(m: MediaDescription) -> str | None:
    if not m.ice.usernameFragment or not m.ice.password:
        return "no ICE username fragment or password"
    if m.dtls is None:
        return "no DTLS setup attribute"
    if not m.dtls.fingerprints:
        return "no DTLS fingerprint"
    if m.kind == "application" and m.sctp_port is None and m.profile != "DTLS/SCTP":
        return "no sctp-port"
    return None
