"""The end-of-turn model semantic_vad asks at a pause: Smart Turn v3.2 (BSD 2-Clause, Daily),
a Whisper-tiny encoder over the last 8 s of the turn, run with onnxruntime.

`weights` fetches and checks the graph, `model` computes its features and runs it, `service`
is the worker all sessions share. The decision (score at a pause, wait, fall back) is pure
logic in duplex.session.turn_detection.
"""

from duplex.smart_turn.model import SmartTurn
from duplex.smart_turn.service import TurnEndService
from duplex.smart_turn.weights import WeightsUnavailable, fetch, resolve, weights_path

__all__ = ["SmartTurn", "TurnEndService", "WeightsUnavailable", "fetch", "resolve", "weights_path"]
