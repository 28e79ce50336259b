"""API keys, ephemeral keys, Twilio signatures and limits at the session entry points."""

import json
import time

import httpx
import pytest
import websockets
from starlette.testclient import TestClient, WebSocketDenialResponse

from duplex.access.auth import choose_subprotocol, twilio_signature
from duplex.access.limits import Admission, OverLimit
from duplex.config import LimitsSettings, load_settings
from duplex.server import create_app

KEY = "sk-good"
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def test_twilio_signature_matches_the_official_sdk_vector():
    # The vector of Twilio's own SDK tests (RequestValidatorTest).
    params = [("CallSid", "CA1234567890ABCDE"), ("Caller", "+14158675309"), ("Digits", "1234"),
              ("From", "+14158675309"), ("To", "+18005551212")]
    url = "https://mycompany.com/myapp.php?foo=1&bar=2"
    assert twilio_signature("12345", url, params) == "RSOYDt4T1cUTdK1PDd93/VVr8B8="
    assert twilio_signature("12345", url, params[::-1]) == "RSOYDt4T1cUTdK1PDd93/VVr8B8="


def test_the_key_subprotocol_is_never_echoed():
    assert choose_subprotocol(["realtime", f"openai-insecure-api-key.{KEY}"]) == "realtime"
    assert choose_subprotocol([f"openai-insecure-api-key.{KEY}"]) is None
    assert choose_subprotocol([]) is None


async def test_admission_counts_sessions_and_messages():
    now = [0.0]
    adm = Admission(LimitsSettings(sessions=3, sessions_per_key=2, messages_per_s_per_key=2,
                                   message_burst=2), clock=lambda: now[0])

    async def refused(key_id):
        with pytest.raises(OverLimit) as info:
            await adm.enter(key_id)
        return info.value.limit

    first = await adm.enter("a")
    await adm.enter("a")
    assert await refused("a") == "limits.sessions_per_key"
    await adm.enter("b")
    assert await refused("c") == "limits.sessions"
    adm.leave(first)
    adm.leave(first)  # a seat given back twice frees one place, not two
    await adm.enter("c")
    assert await refused("d") == "limits.sessions"
    quota = adm.quota("a")
    assert quota.take() == 0 and quota.take() == 0
    assert quota.take() == pytest.approx(0.5)
    now[0] += 0.5
    assert quota.take() == 0
    # Sessions of one key share its bucket.
    assert adm.quota("a").take() > 0 and adm.quota("b").take() == 0


@pytest.fixture(scope="module")
def app_client(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("auth") / "auth.toml"
    cfg.write_text(f'''
[model]
name = "echo"
[auth]
api_keys = ["{KEY}", "sk-other"]
[limits]
sessions_per_key = 2
messages_per_s_per_key = 5.0
message_burst = 3
[telephony]
auth_token = "tw-token"
''')
    app = create_app(load_settings(cfg, environ={}))
    with TestClient(app) as client:
        yield client, app


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


def denied(client, path="/v1/realtime", **kwargs):
    with pytest.raises(WebSocketDenialResponse) as info:
        with client.websocket_connect(path, **kwargs):
            pass
    return info.value


def test_websocket_entries_need_a_key(app_client):
    client, _ = app_client
    for path in ("/v1/realtime", "/realtime", "/telephony/twilio"):
        response = denied(client, path)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert denied(client, headers=bearer("sk-bad")).status_code == 401
    with client.websocket_connect("/v1/realtime", headers=bearer(KEY)) as ws:
        assert ws.receive_json()["type"] == "session.created"
    with client.websocket_connect(f"/v1/realtime?api_key={KEY}") as ws:
        assert ws.receive_json()["type"] == "session.created"
    with client.websocket_connect(
        "/v1/realtime", subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]
    ) as ws:
        assert ws.accepted_subprotocol == "realtime"
        assert ws.receive_json()["type"] == "session.created"
    assert client.post("/v1/realtime/calls", content=b"v=0").status_code == 401
    assert client.get("/healthz").status_code == 200


def test_twilio_requests_are_checked_by_signature(app_client):
    client, _ = app_client
    form = {"CallSid": "CA1", "From": "+15550001"}
    url = "https://testserver/telephony/twilio/twiml"
    good = twilio_signature("tw-token", url, sorted(form.items()))
    ok = client.post("/telephony/twilio/twiml", data=form, headers={"X-Twilio-Signature": good})
    assert ok.status_code == 200 and "<Stream" in ok.text
    bad = client.post("/telephony/twilio/twiml", data={**form, "From": "+1666"},
                      headers={"X-Twilio-Signature": good})
    assert bad.status_code == 401
    signed_ws = twilio_signature("tw-token", "wss://testserver/telephony/twilio", [])
    with client.websocket_connect("/telephony/twilio",
                                  headers={"X-Twilio-Signature": signed_ws}):
        pass


def test_ephemeral_keys_open_one_session_and_expire(app_client):
    client, app = app_client
    assert client.post("/v1/realtime/client_secrets", json={}).status_code == 401
    body = {"expires_after": {"anchor": "created_at", "seconds": 60},
            "session": {"type": "realtime", "instructions": "from the key"}}
    minted = client.post("/v1/realtime/client_secrets", json=body, headers=bearer(KEY))
    assert minted.status_code == 200, minted.text
    secret = minted.json()
    assert secret["value"].startswith("ek_")
    assert 55 <= secret["expires_at"] - time.time() <= 61
    session = secret["session"]
    assert (session["object"], session["type"]) == ("realtime.session", "realtime")
    # An ephemeral key cannot mint more keys.
    assert client.post("/v1/realtime/client_secrets", json=body,
                       headers=bearer(secret["value"])).status_code == 401
    bad = client.post("/v1/realtime/client_secrets", headers=bearer(KEY),
                      json={"expires_after": {"anchor": "created_at", "seconds": 5}})
    assert bad.status_code == 400
    with client.websocket_connect("/v1/realtime", headers=bearer(secret["value"])) as ws:
        created = ws.receive_json()
        assert created["session"]["id"] == session["id"]
        assert created["session"]["instructions"] == "from the key"
    assert denied(client, headers=bearer(secret["value"])).status_code == 401

    expiring = client.post("/v1/realtime/client_secrets", headers=bearer(KEY),
                           json={"expires_after": {"anchor": "created_at", "seconds": 10}})
    registry = app.state.registry
    registry.clock = lambda: time.time() + 11
    try:
        assert denied(client, headers=bearer(expiring.json()["value"])).status_code == 401
    finally:
        registry.clock = time.time


def test_an_ephemeral_key_never_keeps_an_mcp_servers_secrets(app_client):
    client, app = app_client
    crm = {"type": "mcp", "server_label": "crm", "server_url": "http://127.0.0.1:9/mcp"}
    store = len(app.state.registry.store)
    for name, secret in (("headers", {"X-Api-Key": "mcp-secret-1"}),
                         ("authorization", "mcp-secret-2")):
        minted = client.post("/v1/realtime/client_secrets", headers=bearer(KEY), json={
            "session": {"type": "realtime", "tools": [WEATHER, {**crm, name: secret}]}})
        assert minted.status_code == 400
        error = minted.json()["error"]
        assert error["param"] == f"session.tools.1.{name}" and "'crm'" in error["message"]
        assert "mcp-secret" not in minted.text
        # Refused whole: nothing went into the registry.
        assert len(app.state.registry.store) == store
    # Without secrets the MCP tool is kept, and the key opens a session that offers it.
    minted = client.post("/v1/realtime/client_secrets", headers=bearer(KEY),
                         json={"session": {"type": "realtime", "tools": [crm]}})
    assert minted.status_code == 200, minted.text
    with client.websocket_connect("/v1/realtime",
                                  headers=bearer(minted.json()["value"])) as ws:
        assert ws.receive_json()["session"]["tools"][0]["server_label"] == "crm"


def test_limits_answer_429_and_rate_errors(app_client):
    client, _ = app_client
    with client.websocket_connect("/v1/realtime", headers=bearer(KEY)) as one, \
            client.websocket_connect("/v1/realtime", headers=bearer(KEY)) as two:
        one.receive_json()
        two.receive_json()
        response = denied(client, headers=bearer(KEY))
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        # Another key has its own allowance.
        with client.websocket_connect("/v1/realtime", headers=bearer("sk-other")) as other:
            assert other.receive_json()["type"] == "session.created"
        for _ in range(6):
            one.send_text(json.dumps({"type": "input_audio_buffer.clear"}))
        answers = [one.receive_json() for _ in range(6)]
        codes = [a["error"]["code"] if a["type"] == "error" else a["type"] for a in answers]
        # The key's burst of 3 is shared by both of its sessions.
        assert codes[:3] == ["input_audio_buffer.cleared"] * 3
        assert "rate_limit_exceeded" in codes[3:]
    with client.websocket_connect("/v1/realtime", headers=bearer(KEY)) as again:
        assert again.receive_json()["type"] == "session.created"


@pytest.mark.slow
async def test_uvicorn_rejects_the_handshake_with_401_and_ends_long_sessions(server_process,
                                                                           tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[auth]\napi_keys = ["{KEY}"]\n[limits]\nmax_session_s = 1.0\n')
    server = server_process("--model", "echo", "--config", str(cfg))
    url = server.url.replace("http", "ws") + "/v1/realtime"
    with pytest.raises(websockets.InvalidStatus) as info:
        await websockets.connect(url)
    assert info.value.response.status_code == 401
    assert json.loads(info.value.response.body)["error"]["code"] == "invalid_api_key"
    async with websockets.connect(url, additional_headers=bearer(KEY)) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        error = json.loads(await ws.recv())
        assert error["error"]["code"] == "session_duration_exceeded"
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
        assert ws.close_code == 1008
    secret = httpx.post(f"{server.url}/v1/realtime/client_secrets", headers=bearer(KEY), json={})
    assert secret.status_code == 200


def test_twilio_signature_is_required_even_without_api_keys(tmp_path):
    cfg = tmp_path / "tw.toml"
    cfg.write_text('[model]\nname = "echo"\n[telephony]\nauth_token = "tw-token"\n')
    with TestClient(create_app(load_settings(cfg, environ={}))) as client:
        assert client.post("/telephony/twilio/twiml", data={"CallSid": "CA1"}).status_code == 401
        sig = twilio_signature("tw-token", "https://testserver/telephony/twilio/twiml",
                               [("CallSid", "CA1")])
        assert client.post("/telephony/twilio/twiml", data={"CallSid": "CA1"},
                           headers={"X-Twilio-Signature": sig}).status_code == 200
        with client.websocket_connect("/v1/realtime") as ws:
            assert ws.receive_json()["type"] == "session.created"
