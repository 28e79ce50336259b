"""Moshi (kyutai) and its Mimi codec behind `models.base.DuplexModel`.

- `mimi_stream`: exact, batched streaming encode and decode for transformers' `MimiModel`, and the
  sliding-window KV buffers the adapter's transformers share.
- `tiny`: tiny random-weight configs and checkpoints, and offline loading of any checkpoint.
- `adapter`: `MoshiAdapter`, the stage calls over Moshi's main and depth decoders.
"""
