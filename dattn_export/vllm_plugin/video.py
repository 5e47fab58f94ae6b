"""A served video's limits and sizes, shared by the plugin's processor and `serve` (which sizes vLLM's token budget
before vLLM starts); apart from `__init__`, which vLLM imports in every process whatever model it serves."""

from __future__ import annotations

from ..modeling.sound_decoding import AUDIO_RATE
from ..modeling.streams import STREAMS
from ..modeling.video_decoding import VIDEO_FPS

# frames a served video may have unless --limit-mm-per-prompt's num_frames says otherwise: two hours at 1 frame/s.
# The released code sets no limit; a server needs one, because it sizes its token budget and its profiling run for
# the longest video it takes
DEFAULT_MAX_FRAMES = 7200


def max_video_frames(limit: int | None) -> int:
    """The most frames a request's video may have: `limit` (`--limit-mm-per-prompt '{"video": {"count": 1,
    "num_frames": N}}'`), else DEFAULT_MAX_FRAMES, whatever the pool (past space-to-depth's resize budget, the
    frames' grids are resized as the released pool resizes them)."""
    return limit or DEFAULT_MAX_FRAMES


FRAME_LIMIT_OPTION = """--limit-mm-per-prompt '{"video": {"count": 1, "num_frames": N}}'"""


def longest_video(config, most_frames: int, hop: int) -> tuple[int, int]:
    """(frames, encoder tokens) of the video of at most `most_frames` frames, with a sound track as long (log-mel
    frames of `hop` samples), that has the most tokens: the longest, except where space-to-depth's resize gives
    a longer video fewer tokens a frame (within the budget the grid keeps its side; past it, the side shrinks)."""

    def tokens(frames: int) -> int:
        return video_tokens(config, frames, longest_sound_track(frames) // hop)

    frames = max(range(1, most_frames + 1), key=lambda count: (tokens(count), count))
    return frames, tokens(frames)


def encoder_token_budget(config, most_frames: int, hop: int) -> int:
    """The token budget vLLM needs for videos of at most `most_frames` frames: the `longest_video`'s tokens, which it
    takes in one step, and one more, since vLLM refuses an encoder prompt as long as its encoder cache (it counts an
    output token on it too)."""
    return longest_video(config, most_frames, hop)[1] + 1


def video_tokens(config, *amounts: int) -> int:
    """A video's encoder tokens: each of its streams' (`ContextStream.tokens`) of its amount, in the streams' order
    (frames, then the sound track's mel frames)."""
    return sum(stream.tokens(config, amount) for stream, amount in zip(STREAMS["video"], amounts, strict=True))


def longest_sound_track(frames: int) -> int:
    """The samples of the longest sound track a video of `frames` frames is sized for: as long as the frames."""
    return int(frames / VIDEO_FPS * AUDIO_RATE)
