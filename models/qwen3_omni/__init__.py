"""Qwen3-Omni: Thinker-Talker with the Code2Wav codec decoder, behind `DuplexModel`.

- `adapter`: `Qwen3OmniAdapter`, the stage calls; it builds the parts below and checks every
  state it is handed before any part touches it.
- `options`: `Qwen3OmniOptions` (reply lengths, sampling, context sizes, voice) and sampling.
- `session`: one session's state and the rows it holds in the shared pools.
- `encoders`: the audio and vision towers with their preprocessing.
- `thinker`: each session's chat context, batched forwards over the paged KV, reply tokens.
- `memory`: admission and shares of the KV pools: who may take how many blocks.
- `talker`: codec frames from the Talker and its code predictor, fed as generate() feeds them.
- `codec`: exact frame-by-frame streaming Code2Wav, its state in rows of a pool.
- `tiny`: a tiny random-weight checkpoint, and offline loading of any checkpoint.
- `shaped`: random weights at Qwen3-Omni-30B-A3B's published widths, deep stacks cut to fit.
- `graphs`: the code predictor's per-frame loop in fixed buffers, as CUDA graphs on a GPU.
- `compat`: what transformers 5.17 and later releases name differently (the cache keyword,
  where the Thinker keeps its text model and encoders), read from the installed release.
"""
