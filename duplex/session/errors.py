"""Typed errors of the session core. Each is raised before any state changes."""


class SessionError(Exception):
    """Base of every error the session core raises; `code` is stable for the wire."""

    code = "session_error"


class InvalidCommand(SessionError):
    code = "invalid_command"


class UnknownCommand(SessionError):
    code = "unknown_command"


class SessionClosed(SessionError):
    code = "session_closed"


class AckBeyondSent(SessionError):
    code = "ack_beyond_sent"


class NoActiveResponse(SessionError):
    code = "no_active_response"
