"""The Thinker's input encoders: user audio through the audio tower, camera frames through the
vision tower, each a batch of sessions' inputs in one forward.

Audio features are Whisper log-mels, the chunks' frames concatenated in time as the tower takes
them. A frame is resized, normalised and cut into patches by Qwen2-VL's rules, on the model's
device. A frame seen before is not encoded again: its features come from the feature cache
(`models.feature_cache`), keyed by its pixels and everything below that shapes them.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    _get_feat_extract_output_lengths,
)

from models.feature_cache import FeatureCache, content_digest
from models.syncs import on_host, upload

FEATURE_KEYS = (
    "feature_size",
    "sampling_rate",
    "hop_length",
    "n_fft",
    "chunk_length",
    "padding_value",
    "dither",
)
"""The preprocessor_config.json entries that shape the audio features."""

VISION_PREPROCESS = "smart_resize; bicubic antialias, clamped to 0..255; (x/255-mean)/std; v1"
"""How `VisionEncoder.patchify` turns pixels into patches. Part of every feature cache key:
change the text whenever that code changes, so no embedding made by the old code is reused."""


@dataclass(frozen=True)
class AudioFeatures:
    embeds: torch.Tensor
    """(n, thinker hidden): audio tower output, placed directly at the audio positions."""


@dataclass(frozen=True)
class VisionFeatures:
    embeds: torch.Tensor
    """(n, thinker hidden): merged patch features of one frame."""
    deepstack: tuple[torch.Tensor, ...]
    """Per deepstack layer (n, thinker hidden), added to the hidden states of the first layers."""
    grid: tuple[int, int]
    """Merged grid (h, w); n == h * w."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, *self.deepstack))


class AudioEncoder:
    """Float32 mono chunks at `rate` -> `AudioFeatures`."""

    def __init__(
        self, tower, config, preprocessor: dict, rate: int, chunk_samples: int | None, device, dtype
    ) -> None:
        self.tower, self.rate, self.device, self.dtype = tower, rate, device, dtype
        self.features = WhisperFeatureExtractor(
            **{k: preprocessor[k] for k in FEATURE_KEYS if k in preprocessor},
            return_attention_mask=True,
        )
        self.n_window = config.n_window
        self.chunk_samples = chunk_samples or 2 * config.n_window * self.features.hop_length

    def encode(self, chunks: list[np.ndarray]) -> list[AudioFeatures]:
        with on_host():
            feats = self.features(
                [np.asarray(c, dtype=np.float32) for c in chunks],
                sampling_rate=self.rate,
                padding="longest",
                return_tensors="np",
                return_attention_mask=True,
            )
        plan = _TowerPlan(feats["input_features"], feats["attention_mask"].sum(-1), self.n_window,
                          self.tower.config.n_window_infer)
        # Everything the tower would derive from the lengths with a read from the device per
        # step (and one per layer, splitting attention windows) is worked out here and passed
        # in, as its forward allows: the windows' bounds stay on the host where only the host
        # reads them, and flash attention, which reads them on the device, gets them there.
        flash = self.tower.config._attn_implementation.startswith("flash")
        out = self.tower(
            padded_feature=upload(plan.padded, self.device, self.dtype),
            chunk_lengths=torch.from_numpy(plan.chunk_lengths),
            valid_indices=upload(plan.valid_indices, self.device),
            cu_seqlens=(upload(plan.cu_seqlens, self.device, torch.int32) if flash
                        else torch.from_numpy(plan.cu_seqlens)),
            max_seqlen=plan.max_seqlen,
        ).last_hidden_state
        return [AudioFeatures(e) for e in out.split(plan.sizes)]


class _TowerPlan:
    """The audio tower's chunking of a batch, on the host: `Qwen3OmniMoeAudioEncoder`'s
    `chunk_and_pad_features`, `get_valid_indices` and `get_audio_cu_seqlens` on numpy arrays,
    from the feature lengths the host already has."""

    def __init__(self, features: np.ndarray, lengths: np.ndarray, n_window: int,
                 n_window_infer: int) -> None:
        """`features` (B, mel, T) padded log-mels, `lengths` (B,) valid frames of each."""
        span = 2 * n_window
        counts = -(-lengths // span)
        chunk_lengths = np.full(int(counts.sum()), span, dtype=np.int64)
        tails = np.cumsum(counts) - 1
        chunk_lengths[tails] = np.where(lengths % span == 0, span, lengths % span)
        padded = np.zeros((len(chunk_lengths), features.shape[1], int(chunk_lengths.max())),
                          dtype=np.float32)
        chunk = 0
        for b, n in enumerate(lengths.tolist()):
            for start in range(0, n, span):
                width = min(span, n - start)
                padded[chunk, :, :width] = features[b, :, start : start + width]
                chunk += 1
        after_cnn = _get_feat_extract_output_lengths(chunk_lengths, n_window)
        longest = int(after_cnn.max())
        self.padded, self.chunk_lengths = padded, chunk_lengths
        self.valid_indices = np.flatnonzero(np.arange(longest)[None] < after_cnn[:, None])
        window = longest * (n_window_infer // span)
        self.sizes = _get_feat_extract_output_lengths(lengths, n_window).astype(int).tolist()
        windows = [0]
        for n in self.sizes:
            windows += [window] * (n // window) + ([n % window] if n % window else [])
        self.cu_seqlens = np.cumsum(windows).astype(np.int32)
        self.max_seqlen = max(windows[1:])


class VisionEncoder:
    """RGB uint8 frames (H, W, 3) -> `VisionFeatures`, resized and patched as Qwen2-VL does.

    `version` identifies the vision tower's weights (`models.fingerprint`)."""

    def __init__(self, visual, config, preprocessor: dict, max_pixels: int, device, dtype,
                 cache: FeatureCache, version: str) -> None:
        self.visual, self.max_pixels, self.device, self.dtype = visual, max_pixels, device, dtype
        self.patch = config.patch_size
        self.merge = config.spatial_merge_size
        self.temporal_patch = config.temporal_patch_size
        self.image_mean = torch.tensor(preprocessor["image_mean"], device=device)
        self.image_std = torch.tensor(preprocessor["image_std"], device=device)
        self.cache = cache
        settings = (version, VISION_PREPROCESS, self.patch, self.merge, self.temporal_patch,
                    max_pixels, tuple(preprocessor["image_mean"]),
                    tuple(preprocessor["image_std"]), str(dtype), str(device))
        self.cache_key = hashlib.blake2b(repr(settings).encode(), digest_size=16).hexdigest()

    def encode(self, frames: list[np.ndarray]) -> list[VisionFeatures]:
        """Features of each frame: from the cache where it holds them, the rest (each distinct
        frame once) in one forward."""
        keys = [(self.cache_key, content_digest(f)) for f in frames]
        found: dict[tuple[str, bytes], VisionFeatures | None] = {
            key: self.cache.get(key) for key in dict.fromkeys(keys)
        }
        missing = [key for key, feats in found.items() if feats is None]
        if missing:
            encoded = self._encode([frames[keys.index(key)] for key in missing])
            for key, feats in zip(missing, encoded, strict=True):
                self.cache.put(key, feats, feats.nbytes)
                found[key] = feats
        return [found[key] for key in keys]

    def _encode(self, frames: list[np.ndarray]) -> list[VisionFeatures]:
        patches, grids = zip(*(self.patchify(f) for f in frames), strict=True)
        grid_thw = torch.tensor([[1, h, w] for h, w in grids], device=self.device)
        out = self.visual(torch.cat(patches).to(self.dtype), grid_thw=grid_thw)
        sizes = [h * w // self.merge**2 for h, w in grids]
        embeds = out.pooler_output.split(sizes)
        deep = [d.split(sizes) for d in out.deepstack_features]
        # Copies, not views of the batch's output: a cached frame must hold its own bytes only.
        return [
            VisionFeatures(
                embeds[i].clone(),
                tuple(d[i].clone() for d in deep),
                (grids[i][0] // self.merge, grids[i][1] // self.merge),
            )
            for i in range(len(frames))
        ]

    def patchify(self, frame: np.ndarray) -> tuple[torch.Tensor, tuple[int, int]]:
        """RGB (H, W, 3) uint8 -> Qwen2-VL flat patches (h*w, C*T*P*P) and patch grid (h, w)."""
        factor = self.patch * self.merge
        height, width = frame.shape[:2]
        new_h, new_w = smart_resize(height, width, factor, factor * factor, self.max_pixels)
        image = torch.as_tensor(np.ascontiguousarray(frame), device=self.device)
        image = image.permute(2, 0, 1)[None].float()
        if (new_h, new_w) != (height, width):
            image = F.interpolate(image, (new_h, new_w), mode="bicubic", antialias=True).clamp(
                0, 255
            )
        image = ((image[0] / 255.0) - self.image_mean[:, None, None]) / self.image_std[
            :, None, None
        ]
        p, m, t = self.patch, self.merge, self.temporal_patch
        gh, gw = new_h // p, new_w // p
        x = image.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        # A still frame fills every temporal slot of the patch, as the image processor does.
        x = x[:, :, :, :, :, None].expand(*x.shape[:5], t, p, p)
        return x.reshape(gh * gw, 3 * t * p * p), (gh, gw)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's resize rule: multiples of `factor`, aspect kept, pixel count within bounds."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w
