"""The cache keyword each Qwen3-Omni forward takes, read from its signature. The GPU check's
test (tests/test_gpu_check.py) runs the adapter on transformers 5.17 for real."""

from __future__ import annotations

import pytest
import transformers
from packaging.version import Version
from transformers.utils.deprecation import deprecate_kwarg

from models.qwen3_omni import compat


class Renamed:
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, inputs_embeds=None, cache=None, use_cache=None, **kwargs):
        return cache


class Old:
    def forward(self, inputs_embeds=None, past_key_values=None, use_cache=None, **kwargs):
        return past_key_values


class Both:
    def forward(self, cache=None, past_key_values=None, **kwargs):
        return cache


class Neither:
    def forward(self, inputs_embeds=None, **kwargs):
        return kwargs


def test_the_cache_goes_under_the_name_the_forward_declares():
    # Through transformers' own deprecation decorator, as 5.24 and later wrap the forwards.
    assert compat.cache_keyword(Renamed) == "cache"
    assert compat.cache_keyword(Old) == "past_key_values"
    assert compat.cache_keyword(Both) == "cache"
    with pytest.raises(ImportError, match="Neither.forward"):
        compat.cache_keyword(Neither)


def test_the_installed_release_decides_the_keyword():
    renamed = Version(transformers.__version__) >= Version("5.24")
    expected = "cache" if renamed else "past_key_values"
    assert (compat.THINKER_CACHE, compat.TALKER_CACHE, compat.CODE_PREDICTOR_CACHE) == (
        expected, expected, expected)
