"""What identifies a model part's weights, for cache keys that must never match another model.

A digest of the part's config, dtype, device and, for every tensor of its state, its name,
shape and an evenly spaced sample of its values: two checkpoints (or random initialisations)
of the same architecture differ there, and hashing a sample rather than every byte keeps this
to a fraction of a second even for a model of billions of parameters.
"""

from __future__ import annotations

import hashlib

import torch

SAMPLE = 4096
"""Values hashed per tensor, evenly spaced over it."""


def fingerprint(module: torch.nn.Module, config, *extra: object) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(config.to_json_string(use_diff=False).encode())
    for part in extra:
        h.update(repr(part).encode())
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            flat = tensor.detach().reshape(-1)
            h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.device.type}".encode())
            n = flat.numel()
            if n > SAMPLE:
                # Integer spacing: a float32 linspace rounds past the last index of a large tensor.
                flat = flat[torch.arange(SAMPLE, device=flat.device) * (n - 1) // (SAMPLE - 1)]
            h.update(flat.float().cpu().numpy().tobytes())
    return h.hexdigest()
