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


def test_the_duplex_config_runs_moshi_sessions_duplex_and_refuses_unknown_modes(tmp_path):
    settings = load_settings(ROOT / "configs" / "moshi-duplex.toml", environ={})
    assert settings.duplex.default_mode[settings.model.name] == "duplex"
    bad = tmp_path / "bad.toml"
    bad.write_text('[duplex]\ndefault_mode = { echo = "always" }\n')
    with pytest.raises(ConfigError, match="duplex.default_mode"):
        load_settings(bad, environ={})
