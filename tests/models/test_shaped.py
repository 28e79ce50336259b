"""The shaped Qwen3-Omni-30B-A3B: the published widths exactly, the deep stacks cut by --layers,
and (slow) a 1-layer checkpoint built by the CLI that the adapter loads and replies with."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen3OmniMoeForConditionalGeneration

from duplex.cli import main
from models.qwen3_omni.shaped import DEPTHS, PUBLISHED, shaped_config
from models.registry import SHAPED, ModelNotFound, load_model, shaped_layers

FULL = {"thinker": 48, "audio encoder": 32, "vision encoder": 27, "talker": 20}
"""Qwen3-Omni-30B-A3B's depths, as published."""
KEPT = {
    ("talker_config", "code_predictor_config", "num_hidden_layers"): 5,
    ("code2wav_config", "num_hidden_layers"): 8,
}
SCALED = {
    ("talker_config", "accept_hidden_layer"),
    ("thinker_config", "vision_config", "deepstack_visual_indexes"),
}
SUBCONFIGS = {
    "thinker_config": lambda c: c.thinker_config,
    "talker_config": lambda c: c.talker_config,
    "code2wav_config": lambda c: c.code2wav_config,
    "audio_config": lambda c: c.audio_config,
    "vision_config": lambda c: c.vision_config,
    "text_config": lambda c: c.text_config,
    "code_predictor_config": lambda c: c.code_predictor_config,
}


def leaves(tree: dict, path: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, dict) and key in SUBCONFIGS:
            yield from leaves(value, (*path, key))
        else:
            yield (*path, key), value


def read(config, path: tuple[str, ...]):
    for key in path[:-1]:
        config = SUBCONFIGS[key](config)
    return getattr(config, path[-1])


@pytest.mark.parametrize("layers", [1, 2, 5, 30, None])
def test_every_width_is_the_published_one_and_only_the_deep_stacks_are_cut(layers):
    config = shaped_config(layers)
    depth_paths = {path: name for name, path in DEPTHS.items()}
    for path, published in leaves(PUBLISHED):
        got = read(config, path)
        if path in depth_paths:
            full = FULL[depth_paths[path]]
            assert published == full
            assert got == (full if layers is None else min(layers, full)), path
        elif path in SCALED and layers is not None:
            continue
        elif isinstance(published, dict):
            assert {k: got[k] for k in published} == published, path
        else:
            assert got == published, path
    for path, depth in KEPT.items():
        assert read(config, path) == depth


@pytest.mark.parametrize(
    ("layers", "accept", "deepstack"),
    [(None, 24, [8, 16, 24]), (48, 24, [8, 16, 24]), (2, 1, [0, 1]), (1, 1, [0]), (8, 4, [2, 4, 7])],
)
def test_layer_references_move_with_the_cut(layers, accept, deepstack):
    config = shaped_config(layers)
    assert config.talker_config.accept_hidden_layer == accept
    vision = config.thinker_config.vision_config
    assert vision.deepstack_visual_indexes == deepstack
    assert all(i < vision.depth for i in deepstack)


def test_full_depth_has_the_published_parameter_count():
    # The released checkpoint holds 35.3 B parameters (70.5 GB in bf16).
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(shaped_config())
    total = sum(p.numel() for p in model.parameters())
    assert 35.2e9 < total < 35.4e9


@pytest.mark.parametrize(("name", "layers"), [(SHAPED, None), (f"{SHAPED}:2", 2)])
def test_model_names(name, layers):
    assert shaped_layers(name) == layers


@pytest.mark.parametrize("name", [f"{SHAPED}:0", f"{SHAPED}:x", f"{SHAPED}:", "shaped:other"])
def test_bad_model_names_are_refused(name):
    with pytest.raises(ModelNotFound):
        load_model(name)


def test_layers_below_one_are_refused(tmp_path, capsys):
    assert main(["models", "build", SHAPED, "--layers", "0", "--output", str(tmp_path)]) == 2
    assert "--layers" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.cpu_bound
@pytest.mark.slow
def test_a_one_layer_checkpoint_loads_and_replies(tmp_path, capsys):
    path = tmp_path / "shaped"
    assert main(["models", "build", SHAPED, "--layers", "1", "--output", str(path)]) == 0
    out = capsys.readouterr().out
    assert "total" in out and "1,899,609,873 parameters" in out
    model = load_model(str(path), dtype="bfloat16")
    assert model.model.config.thinker_config.text_config.hidden_size == 2048

    state = model.new_state("s1")
    speech = (0.1 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32)
    model.thinker_prefill([state], model.encode_audio([state], [speech]))
    model.begin_response(state)
    frame = model.talker_step([state], model.thinker_decode([state]))[0]
    assert frame.codes.shape == (16,)
    assert int(frame.codes.max()) < 2048
    pcm = model.codec_decode([state], [frame.codes])[0]
    assert pcm.shape == (1920,)
    assert np.abs(pcm).max() > 0
    model.free(state)
    assert model.bytes_held(state) == 0


def test_shaped_options_are_refused_for_a_tiny_model(tmp_path, capsys):
    assert main(["models", "build", "tiny-omni", "--layers", "2", "--cache-dir", str(tmp_path)]) == 2
    assert SHAPED in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
