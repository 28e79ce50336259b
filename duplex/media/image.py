"""Still images (PNG, JPEG, ...) to RGB arrays, with PyAV."""

import io

import numpy as np


def decode_image(data: bytes) -> np.ndarray:
    """RGB uint8 (H, W, 3); ValueError when the bytes are not an image FFmpeg can read."""
    # Imported here: the bench imports the Realtime session on hosts that carry no PyAV.
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            frame = next(container.decode(video=0))
            return frame.to_ndarray(format="rgb24")
    except (av.FFmpegError, StopIteration, IndexError) as exc:
        raise ValueError(f"the image could not be decoded: {exc}") from None
