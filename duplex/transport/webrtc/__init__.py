"""WebRTC (aiortc) with OpenAI Realtime signalling: SDP over HTTP, events on `oai-events`."""
