"""A node deployed through the environment alone, its secrets read from files (the Docker and
Kubernetes convention), never writes a secret to its log, whatever clients and Redis do."""

import json
import os
import signal

import httpx
import pytest
import websockets

from duplex.access.auth import twilio_signature
from tests.waiting import eventually

pytestmark = pytest.mark.slow

KEY, SECOND_KEY = "sk-deploy-7f3a9c", "sk-deploy-2d61e0"
WRONG_KEY = "sk-mistyped-1e8d7b"
TOKEN = "tw-deploy-5b2e1d"
REDIS_PASSWORD = "pw-deploy-9c4f0a"


async def opened(url, **kwargs):
    ws = await websockets.connect(url, **kwargs)
    assert json.loads(await ws.recv())["type"] == "session.created"
    return ws


async def test_secrets_from_files_never_reach_the_log(server_process, redis_server, tmp_path):
    files = {"keys": f"{KEY}\n{SECOND_KEY}\n", "token": f"{TOKEN}\n",
             # redis-server without a password takes any for its `default` user.
             "url": redis_server.url.replace("redis://", f"redis://default:{REDIS_PASSWORD}@")}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "DUPLEX_SERVER__LOG_LEVEL": "debug", "DUPLEX_LIMITS__SESSIONS": "10",
           "DUPLEX_STORE__HEARTBEAT_S": "0.2",
           "DUPLEX_AUTH__API_KEYS_FILE": str(tmp_path / "keys"),
           "DUPLEX_TELEPHONY__AUTH_TOKEN_FILE": str(tmp_path / "token"),
           "DUPLEX_REDIS_URL_FILE": str(tmp_path / "url")}
    server = server_process("--model", "echo", env=env)
    ws_url = server.url.replace("http", "ws") + "/v1/realtime"
    live = [
        await opened(ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}),
        await opened(f"{ws_url}?api_key={SECOND_KEY}"),
        await opened(ws_url, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]),
    ]
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(f"{ws_url}?api_key={WRONG_KEY}")
    assert refused.value.response.status_code == 401
    assert WRONG_KEY not in refused.value.response.body.decode()
    async with httpx.AsyncClient(base_url=server.url) as http:
        minted = await http.post("/v1/realtime/client_secrets", json={},
                                 headers={"Authorization": f"Bearer {KEY}"})
        ephemeral = minted.json()["value"]
        live.append(await opened(f"{ws_url}?api_key={ephemeral}"))
        params = {"CallSid": "CA1", "From": "+14155550100"}
        twiml = f"{server.url}/telephony/twilio/twiml"
        signed = await http.post(twiml, data=params, headers={
            "X-Twilio-Signature": twilio_signature(TOKEN, twiml, sorted(params.items()))})
        assert signed.status_code == 200
        forged = await http.post(twiml, data=params, headers={"X-Twilio-Signature": "bad"})
        assert forged.status_code == 401

    # Redis goes away under live sessions and a new one, then comes back.
    redis_server.stop()
    await eventually(lambda: "session registry unreachable" in server.output(),
                     "the node notices Redis is gone")
    live.append(await opened(ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}))
    redis_server.start()
    await eventually(lambda: "session registry reachable again" in server.output(),
                     "the node notices Redis is back")

    for ws in live:
        await ws.close()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0
    server.stop()
    log = server.output()
    assert "Redis unreachable" in log and "/v1/realtime?api_key=***" in log
    for secret in (KEY, SECOND_KEY, WRONG_KEY, TOKEN, REDIS_PASSWORD, ephemeral):
        assert secret not in log
