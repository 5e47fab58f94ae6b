"""The video loader the plugin registers as vLLM's `dattn` video backend (`--media-io-kwargs '{"video":
{"video_backend": "dattn"}}'`, which `dattn-export serve` passes): a request's video file decoded as our reference
decodes one (`generate --video`): frames at 1 frame/s and, in the metadata, its sound track (None without one)."""

from __future__ import annotations

import io

import numpy as np
from vllm.multimodal.video import VIDEO_LOADER_REGISTRY, VideoLoader

from ..errors import InputError
from ..processing import VIDEO_FPS, load_audio, load_video_frames
from . import VIDEO_BACKEND


@VIDEO_LOADER_REGISTRY.register(VIDEO_BACKEND)
class DAttnVideoLoader(VideoLoader):
    @classmethod
    def load_bytes(
        cls, data: bytes, frame_size: int | None = None, max_frames: int | None = None, **_
    ) -> tuple[np.ndarray, dict]:
        """(frames (F, H, W, 3) uint8, {"audio": mono samples at 16 kHz or None, ...}). vLLM's `num_frames` and
        `fps` are not taken: the released models sample 1 frame/s. `frame_size` (the tower's square) and
        `max_frames` (the model's limit), which `serve` passes, bound the memory a large or long video takes:
        frames are resized as they are decoded, and decoding stops one frame past the limit (the processor then
        refuses the video)."""
        try:
            limit = None if max_frames is None else max_frames + 1
            frames = load_video_frames(io.BytesIO(data), limit=limit, square=frame_size)
            audio = load_audio(io.BytesIO(data), missing_ok=True)
        except InputError as e:
            raise ValueError(f"the request's video {e.problem}") from None
        metadata = {"fps": VIDEO_FPS, "total_num_frames": len(frames), "audio": audio}
        return np.stack([np.asarray(frame) for frame in frames]), metadata
