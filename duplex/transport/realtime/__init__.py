"""The OpenAI Realtime event protocol: a pure core (protocol.py) and its WebSocket edge (ws.py)."""
