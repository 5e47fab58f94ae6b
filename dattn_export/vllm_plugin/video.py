"""A served video's limits and sizes, shared by the plugin's processor and `serve` (which sizes vLLM's token budget
before vLLM starts); apart from `__init__`, which vLLM imports in every process whatever model it serves."""

from __future__ import annotations

from ..modeling.streams import AUDIO, FRAMES, RESIZE_TOKENS
from ..processing import AUDIO_RATE, VIDEO_FPS

DEFAULT_MAX_FRAMES = 300  # frames a video may have, where the model's pool sets no limit (5 minutes at 1 frame/s)


def max_video_frames(config, limit: int | None) -> int:
    """The most frames a request's video may have: DEFAULT_MAX_FRAMES, or for a space-to-depth pool the most
    before its resize budget (served videos are not resized yet), lowered by `limit` (`--limit-mm-per-prompt
    '{"video": {"count": 1, "num_frames": N}}'`)."""
    most = DEFAULT_MAX_FRAMES
    if config.mm_pool_rule == "space-to-depth":
        most = RESIZE_TOKENS * config.mm_image_pool_size**2 // (config.patch_grid + 1) ** 2
    return min(most, limit) if limit else most


def video_tokens(config, frames: int, mel_frames: int) -> int:
    """A video's encoder tokens: its frames', then its sound track's (`mel_frames` long)."""
    return FRAMES.tokens(config, frames) + AUDIO.tokens(config, mel_frames)


def longest_sound_track(frames: int) -> int:
    """The samples of the longest sound track a video of `frames` frames is sized for: as long as the frames."""
    return int(frames / VIDEO_FPS * AUDIO_RATE)
