"""Twilio Media Streams: a pure protocol core (protocol.py) and its WebSocket edge (ws.py)."""
