"""The vision encoder's feature cache on the tiny Qwen3-Omni: a frame seen again is not encoded
again, and a change of preprocessing or model never finds the old embedding."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from models.feature_cache import FeatureCache
from models.qwen3_omni.adapter import Qwen3OmniAdapter, Qwen3OmniOptions
from models.qwen3_omni.tiny import load_preprocessor

OPTIONS = Qwen3OmniOptions()


@pytest.fixture(scope="module")
def loaded(tiny_omni_dir):
    return Qwen3OmniAdapter.from_pretrained(tiny_omni_dir, options=OPTIONS)


@pytest.fixture(scope="module")
def make(tiny_omni_dir, loaded):
    prep = load_preprocessor(tiny_omni_dir, loaded.model.config)

    def build(cache: FeatureCache, options=OPTIONS, model=None, preprocessor=None):
        return Qwen3OmniAdapter(model or loaded.model, loaded.tokenizer, preprocessor or prep,
                                options=options, feature_cache=cache)

    return build


def frame(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (60, 90, 3), dtype=np.uint8)


class Forwards:
    """Counts the vision tower's forwards (a real hook on the real module)."""

    def __init__(self, ad: Qwen3OmniAdapter) -> None:
        self.n = 0
        self.handle = ad.model.thinker.model.visual.register_forward_hook(self._seen)

    def _seen(self, *_args) -> None:
        self.n += 1


def encode(ad: Qwen3OmniAdapter, frames: list[np.ndarray]):
    states = [ad.new_state(f"s{i}") for i in range(len(frames))]
    try:
        return ad.encode_video(states, frames)
    finally:
        for st in states:
            ad.free(st)


def same(a, b) -> bool:
    return (torch.equal(a.embeds, b.embeds) and a.grid == b.grid
            and all(torch.equal(x, y) for x, y in zip(a.deepstack, b.deepstack, strict=True)))


def test_a_frame_seen_again_is_not_encoded_again(make):
    ad = make(FeatureCache(64 << 20))
    forwards = Forwards(ad)
    try:
        [first] = encode(ad, [frame(1)])
        # Again, by another session, beside a new frame and a copy of that new frame.
        again, new, new_copy = encode(ad, [frame(1), frame(2), frame(2).copy()])
        assert forwards.n == 2
    finally:
        forwards.handle.remove()
    assert same(again, first) and same(new, new_copy)
    [reference] = encode(make(FeatureCache(0)), [frame(2)])
    assert same(new, reference)
    stats = ad.feature_cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (1, 2, 2)
    assert stats.bytes == first.nbytes + new.nbytes


@pytest.mark.parametrize("change", ["max_pixels", "normalisation", "weights", "dtype"])
def test_a_change_of_preprocessing_or_model_misses(make, loaded, tiny_omni_dir, change):
    cache = FeatureCache(64 << 20)
    image = np.random.default_rng(3).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    [before] = encode(make(cache), [image])
    prep = load_preprocessor(tiny_omni_dir, loaded.model.config)
    if change == "max_pixels":
        other = make(cache, options=replace(OPTIONS, video_max_pixels=56 * 56))
    elif change == "normalisation":
        other = make(cache, preprocessor={**prep, "image_mean": [0.4, 0.4, 0.4]})
    else:
        model = copy.deepcopy(loaded.model)
        if change == "weights":
            with torch.no_grad():
                model.thinker.model.visual.merger.ln_q.weight.mul_(2.0)
        else:
            model = model.to(torch.float64)
        other = Qwen3OmniAdapter(model, loaded.tokenizer, prep, options=OPTIONS,
                                 dtype="float64" if change == "dtype" else "float32",
                                 feature_cache=cache)
    [after] = encode(other, [image])
    [fresh] = encode(other, [image])
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (1, 2, 2)
    assert not same(after, before) and same(fresh, after)


def test_eviction_keeps_the_cache_within_its_bytes_least_recently_used_first(make):
    probe = make(FeatureCache(0))
    [one] = encode(probe, [frame(0)])
    ad = make(FeatureCache(2 * one.nbytes))
    encode(ad, [frame(0)])
    encode(ad, [frame(1)])
    encode(ad, [frame(0)])
    encode(ad, [frame(2)])
    stats = ad.feature_cache.stats()
    assert (stats.evictions, stats.entries, stats.bytes) == (1, 2, 2 * one.nbytes)
    # frame 1 was the least recently used: it is gone, frame 0 stays.
    encode(ad, [frame(0)])
    encode(ad, [frame(1)])
    stats = ad.feature_cache.stats()
    assert (stats.hits, stats.misses, stats.evictions) == (2, 4, 2)
    assert stats.bytes <= stats.budget_bytes
