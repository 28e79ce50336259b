"""`--model NAME|PATH` before anything starts: a built-in tiny model is built on first use, in
the model directory the settings name; a PATH must exist."""

import pytest

from duplex.cli import main, resolve_model
from duplex.config import load_settings


@pytest.mark.parametrize("name", ["tiny-omni", "tiny-moshi"])
def test_a_named_tiny_model_is_built_on_first_use(name, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("DUPLEX_MODEL__CACHE_DIR", str(tmp_path / "models"))
    settings = load_settings(cli={"model": {"name": name}})
    path = tmp_path / "models" / name

    resolve_model(settings.model.name, settings.model.cache_dir)
    assert (path / "config.json").is_file()
    assert capfd.readouterr().err == (
        f"duplex: building {name} into {path} (first use)\n"
        f"duplex: built {name} at {path}\n"
    )

    resolve_model(settings.model.name, settings.model.cache_dir)
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_a_missing_path_still_stops_with_one_line(command, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main([command, "--model", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"duplex: cannot load the model: no model checkpoint at {missing} (config.json missing)\n"
    )
    assert not missing.exists()


def test_help_says_where_models_are_built(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "DUPLEX_MODEL__CACHE_DIR" in " ".join(capsys.readouterr().out.split())
