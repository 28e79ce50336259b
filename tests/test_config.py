import tomllib
from pathlib import Path

import pytest

from duplex.config import ConfigError, Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent


def test_configs_default_toml_is_the_embedded_default():
    on_disk = tomllib.loads((ROOT / "configs" / "default.toml").read_text())
    assert Settings.model_validate(on_disk) == Settings()
    assert Settings().model_dump() == on_disk


def test_layers_file_then_env_then_cli(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[server]\nport = 9001\nhost = "0.0.0.0"\n[model]\nname = "echo"\n')
    s = load_settings(cfg, environ={"DUPLEX_SERVER__PORT": "9002"}, cli={"model": {"name": "x"}})
    assert (s.server.host, s.server.port, s.model.name) == ("0.0.0.0", 9002, "x")


def test_unknown_key_names_key_and_file(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[server]\nprot = 9000\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: unknown key 'server\.prot'"):
        load_settings(cfg, environ={})


def test_bad_value_names_key_and_file(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[server]\nport = 70000\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: 'server\.port'.*70000"):
        load_settings(cfg, environ={})


def test_bad_environment_value_names_the_environment():
    with pytest.raises(ConfigError, match=r"environment.*'server\.port'"):
        load_settings(environ={"DUPLEX_SERVER__PORT": "eighty"})


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_settings(tmp_path / "nope.toml", environ={})
    broken = tmp_path / "broken.toml"
    broken.write_text("[server\n")
    with pytest.raises(ConfigError, match="broken.toml: not valid TOML"):
        load_settings(broken, environ={})


@pytest.mark.parametrize("value", ['["sk-1", "sk-2"]', "sk-1,sk-2", " sk-1 , sk-2 ,"])
def test_api_keys_from_the_environment_as_json_or_bare_commas(value):
    s = load_settings(environ={"DUPLEX_AUTH__API_KEYS": value})
    assert s.auth.api_keys == ["sk-1", "sk-2"]


def test_one_bare_key_is_a_list_of_one():
    assert load_settings(environ={"DUPLEX_AUTH__API_KEYS": "sk-1"}).auth.api_keys == ["sk-1"]


def test_structured_settings_from_the_environment():
    s = load_settings(environ={
        "DUPLEX_WEBRTC__ICE_SERVERS": '[{"urls": ["stun:stun.example.org:3478"]}, '
                                      '{"urls": "turn:turn.example.org", "username": "u", '
                                      '"credential": "c"}]',
        "DUPLEX_WEBRTC__HOST_ADDRESSES": "10.0.0.5,192.168.1.7",
        "DUPLEX_LIMITS__SESSIONS": "40",
    })
    first, second = s.webrtc.ice_servers
    assert first.urls == ["stun:stun.example.org:3478"]
    assert (second.urls, second.username, second.credential) == ("turn:turn.example.org", "u", "c")
    assert s.webrtc.host_addresses == ["10.0.0.5", "192.168.1.7"]
    assert s.limits.sessions == 40


def test_plain_strings_are_never_read_as_json():
    s = load_settings(environ={"DUPLEX_TELEPHONY__AUTH_TOKEN": '["not", "a", "list"]'})
    assert s.telephony.auth_token == '["not", "a", "list"]'


def test_bad_structured_values_name_the_variable():
    with pytest.raises(ConfigError, match=r"^DUPLEX_AUTH__API_KEYS: not valid JSON.*column 8"):
        load_settings(environ={"DUPLEX_AUTH__API_KEYS": '["sk-1"'})
    with pytest.raises(ConfigError, match=r"^DUPLEX_WEBRTC__ICE_SERVERS: expected JSON"):
        load_settings(environ={"DUPLEX_WEBRTC__ICE_SERVERS": "stun:stun.example.org"})
    with pytest.raises(ConfigError, match=r"DUPLEX_WEBRTC__ICE_SERVERS: 'webrtc\.ice_servers\.0"
                                          r"\.urls': Field required"):
        load_settings(environ={"DUPLEX_WEBRTC__ICE_SERVERS": '[{"url": "stun:x"}]'})
    with pytest.raises(ConfigError, match=r"DUPLEX_SERVER__PORT: 'server\.port'.*'eighty'"):
        load_settings(environ={"DUPLEX_SERVER__PORT": "eighty"})
    with pytest.raises(ConfigError, match=r"DUPLEX_SERVER__PROT: unknown key 'server\.prot'"):
        load_settings(environ={"DUPLEX_SERVER__PROT": "1"})


def test_two_variables_for_one_setting_are_refused():
    with pytest.raises(ConfigError, match="DUPLEX_REDIS_URL and DUPLEX_STORE__REDIS_URL both set"):
        load_settings(environ={"DUPLEX_REDIS_URL": "redis://a:6379/0",
                               "DUPLEX_STORE__REDIS_URL": "redis://b:6379/0"})


def test_secrets_from_files(tmp_path):
    keys, token, url = tmp_path / "keys", tmp_path / "token", tmp_path / "url"
    keys.write_text("sk-1\nsk-2,sk-3\n")
    token.write_text("tw-secret\n")
    url.write_text("redis://:pw@redis:6379/0\n")
    s = load_settings(environ={"DUPLEX_AUTH__API_KEYS_FILE": str(keys),
                               "DUPLEX_TELEPHONY__AUTH_TOKEN_FILE": str(token),
                               "DUPLEX_REDIS_URL_FILE": str(url)})
    assert s.auth.api_keys == ["sk-1", "sk-2", "sk-3"]
    assert s.telephony.auth_token == "tw-secret"
    assert (s.store.redis_url, s.store.backend) == ("redis://:pw@redis:6379/0", "redis")
    keys.write_text('["sk-4"]')
    ice = tmp_path / "ice"
    ice.write_text('[{"urls": "turn:turn.example.org", "username": "u", "credential": "c"}]')
    s = load_settings(environ={"DUPLEX_AUTH__API_KEYS_FILE": str(keys),
                               "DUPLEX_STORE__REDIS_URL_FILE": str(url),
                               "DUPLEX_WEBRTC__ICE_SERVERS_FILE": str(ice)})
    assert s.auth.api_keys == ["sk-4"] and s.store.redis_url == "redis://:pw@redis:6379/0"
    assert s.webrtc.ice_servers[0].credential == "c"


def test_secret_file_problems_name_the_variable(tmp_path):
    with pytest.raises(ConfigError, match=r"^DUPLEX_AUTH__API_KEYS_FILE: cannot read .*nope"):
        load_settings(environ={"DUPLEX_AUTH__API_KEYS_FILE": str(tmp_path / "nope")})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=r"^DUPLEX_AUTH__API_KEYS_FILE: .*empty is empty"):
        load_settings(environ={"DUPLEX_AUTH__API_KEYS_FILE": str(empty)})
    token = tmp_path / "token"
    token.write_text("tw")
    with pytest.raises(ConfigError, match="DUPLEX_TELEPHONY__AUTH_TOKEN and "
                                          "DUPLEX_TELEPHONY__AUTH_TOKEN_FILE both set"):
        load_settings(environ={"DUPLEX_TELEPHONY__AUTH_TOKEN": "tw",
                               "DUPLEX_TELEPHONY__AUTH_TOKEN_FILE": str(token)})
    with pytest.raises(ConfigError, match=r"^DUPLEX_SERVER__PORT_FILE: only secrets"):
        load_settings(environ={"DUPLEX_SERVER__PORT_FILE": str(token)})


@pytest.mark.parametrize("environ", [
    {"DUPLEX_AUTH__API_KEYS": '{"sk-hunter2": 1}'},
    {"DUPLEX_AUTH__API_KEYS": '[["sk-hunter2"]]'},
    {"DUPLEX_REDIS_URL": "http://:hunter2@redis:6379/0"},
    {"DUPLEX_TELEPHONY__AUTH_TOKEN": "hunter2", "DUPLEX_TELEPHONY__PUBLIC_URL": "not a url"},
    {"DUPLEX_TELEPHONY__AUTH_TOKEN": "hunter2", "DUPLEX_TELEPHONY__NOPE": "x"},
    {"DUPLEX_WEBRTC__ICE_SERVERS": '[{"urls": "turn:x", "credential": ["hunter2"]}]'},
])
def test_errors_never_show_a_secret(environ):
    with pytest.raises(ConfigError) as info:
        load_settings(environ=environ)
    assert "DUPLEX_" in str(info.value)
    assert "hunter2" not in str(info.value)


def test_a_secret_in_a_bad_config_file_is_not_shown(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[store]\nredis_url = "tcp://:hunter2@redis:6379"\nbackend = "redis"\n')
    with pytest.raises(ConfigError, match=r"c\.toml: 'store'.*redis_url must be") as info:
        load_settings(cfg, environ={})
    assert "hunter2" not in str(info.value)


def test_cli_reports_a_bad_variable_in_one_line(monkeypatch, capsys):
    from duplex.cli import main

    monkeypatch.setenv("DUPLEX_AUTH__API_KEYS", '["sk-hunter2"')
    assert main(["serve", "--model", "echo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("duplex: config error: DUPLEX_AUTH__API_KEYS: not valid JSON")
    assert "hunter2" not in err and err.count("\n") == 1


def test_a_lease_must_outlive_its_renewal_and_fit_the_retention():
    base = {"DUPLEX_REDIS_URL": "redis://redis:6379/0", "DUPLEX_LIMITS__SESSIONS": "10"}
    with pytest.raises(ConfigError, match=r"limits\.lease_s \(1\) must be longer than "
                                          r"store\.heartbeat_s \(2\)"):
        load_settings(environ={**base, "DUPLEX_LIMITS__LEASE_S": "1"})
    with pytest.raises(ConfigError, match=r"at most store\.retention_s \(5\)"):
        load_settings(environ={**base, "DUPLEX_STORE__RETENTION_S": "5"})
    # Without a session limit, or with the memory store, nothing is leased.
    del base["DUPLEX_LIMITS__SESSIONS"]
    assert load_settings(environ={**base, "DUPLEX_STORE__RETENTION_S": "5"}).limits.lease_s == 10
    assert load_settings(environ={"DUPLEX_LIMITS__LEASE_S": "1",
                                  "DUPLEX_LIMITS__SESSIONS": "10"}).limits.lease_s == 1

def test_cuda_graphs_and_dtype_reach_the_engine(monkeypatch):
    from duplex.server import engine_spec

    default = engine_spec(load_settings())
    assert (default.cuda_graphs, default.dtype) == (False, "auto")
    monkeypatch.setenv("DUPLEX_ENGINE__CUDA_GRAPHS", "true")
    spec = engine_spec(load_settings(cli={"model": {"dtype": "bfloat16"}}))
    assert (spec.cuda_graphs, spec.dtype) == (True, "bfloat16")


def test_the_duplex_config_runs_moshi_sessions_duplex_and_refuses_unknown_modes(tmp_path):
    settings = load_settings(ROOT / "configs" / "moshi-duplex.toml", environ={})
    assert settings.duplex.default_mode[settings.model.name] == "duplex"
    bad = tmp_path / "bad.toml"
    bad.write_text('[duplex]\ndefault_mode = { echo = "always" }\n')
    with pytest.raises(ConfigError, match="duplex.default_mode"):
        load_settings(bad, environ={})
