"""What the plugin adds to vLLM's media handling, each under vLLM's own registries (selected by `dattn-export serve`):

- the `dattn` video backend (`--media-io-kwargs '{"video": {"video_backend": "dattn"}}'`): a request's video file
  decoded as our reference decodes one (`generate --video`): frames at 1 frame/s and, in the metadata, its sound
  track (None without one) and the file's digest; with `"cache_gib": N` the server keeps up to N GiB of decoded
  videos by their files' content, so that a question on a video file seen before does not decode it again;
- the `dattn` media connector (`VLLM_MEDIA_CONNECTOR=dattn`): vLLM's, except that what a request's media makes fail
  is answered as the request's fault (4xx, with the reason), not as the server's (500), and that a local video file
  (`file://`) whose decode is kept and that has not changed since is not even read again (`UnchangedFiles`).
"""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import numpy as np
import torch
from PIL import Image
from vllm.exceptions import VLLMError, VLLMUnprocessableEntityError
from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector, MediaWithBytes
from vllm.multimodal.video import VIDEO_LOADER_REGISTRY, VideoLoader

from ..modeling.media_files import FileBytes, MediaError
from ..modeling.video_decoding import VIDEO_FPS, load_video
from . import MEDIA_CONNECTOR, VIDEO_BACKEND
from .context_cache import ByteBoundCache, media_digest

FILE_DIGEST = "dattn_file_digest"  # in a decoded video's metadata: its file's digest, which keys its processing

# a request's media that cannot be fetched or decoded: the URL refused, unresolvable or timed out; a picture that
# decodes past Pillow's decompression-bomb limit
REQUEST_MEDIA_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError, Image.DecompressionBombError)


def request_error(url: str, error: Exception) -> VLLMUnprocessableEntityError:
    what = "picture" if isinstance(error, Image.DecompressionBombError) else "media"
    reason = " ".join(str(error).split()) or type(error).__name__
    shown = url if not url.startswith("data:") else url[:40] + "..."
    return VLLMUnprocessableEntityError(f"the request's {what} cannot be used: {reason}", value=shown)


@MEDIA_CONNECTOR_REGISTRY.register(MEDIA_CONNECTOR)
class DAttnMediaConnector(MediaConnector):
    """vLLM's connector (its URLs, domains, caches and limits), with fetch and decode failures of a request's media
    turned into HTTP 422 naming the reason: vLLM answers those with 500, as if the server had failed, though a
    retry of the same request fails the same way."""

    def load_from_url(self, url: str, media_io, *, fetch_timeout: int | None = None):
        try:
            return super().load_from_url(url, UnchangedFiles.of(media_io), fetch_timeout=fetch_timeout)
        except VLLMError:
            raise
        except REQUEST_MEDIA_ERRORS as e:
            raise request_error(url, e) from e

    async def load_from_url_async(self, url: str, media_io, *, fetch_timeout: int | None = None):
        try:
            return await super().load_from_url_async(url, UnchangedFiles.of(media_io), fetch_timeout=fetch_timeout)
        except VLLMError:
            raise
        except REQUEST_MEDIA_ERRORS as e:
            raise request_error(url, e) from e


class UnchangedFiles:
    """A video MediaIO of the `dattn` backend whose `load_file` does not read a file again when the loader still
    keeps its decode and the file has not changed since it was read: the same inode, size, modification and change
    times (no call can set a change time back), its times over SETTLED_NS older than that read (a write within one
    tick of the file system's clock after them would leave them as they were). Every other load is vLLM's. A
    question on an hour of video must not read and hash the file again: an hour of 1080p is gigabytes."""

    SETTLED_NS = 2 * 10**9  # FAT's clock ticks every 2 s; ext4's and XFS's every few ms

    def __init__(self, media_io):
        self.media_io = media_io

    @classmethod
    def of(cls, media_io):
        return cls(media_io) if isinstance(getattr(media_io, "video_loader", None), DAttnVideoLoader) else media_io

    def __getattr__(self, name: str):
        return getattr(self.media_io, name)

    def load_file(self, filepath):
        identity = self.identity(filepath)
        if (kept := DAttnVideoLoader.unchanged_file(identity, **self.media_io.kwargs)) is not None:
            return MediaWithBytes(kept, bytes(kept[1][FILE_DIGEST].tolist()))  # its digest stands for its bytes
        loaded = self.media_io.load_file(filepath)
        settled = time.time_ns() - max(identity[-2:]) > self.SETTLED_NS
        if settled and self.identity(filepath) == identity:
            DAttnVideoLoader.file_read(identity, loaded.media[1][FILE_DIGEST], **self.media_io.kwargs)
        return loaded

    @staticmethod
    def identity(filepath) -> tuple[int, ...]:
        """What stays the same while a file is unchanged; its modification and change times (ns) last."""
        stat = os.stat(filepath)
        return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


@VIDEO_LOADER_REGISTRY.register(VIDEO_BACKEND)
class DAttnVideoLoader(VideoLoader):
    decoded = ByteBoundCache(0)  # this server's decoded videos by file digest: (frames, sound track)
    files: dict[tuple, bytes] = {}  # a file's identity and settings -> its decode's key (`UnchangedFiles`)

    @classmethod
    def load_bytes(
        cls, data: bytes, frame_size: int | None = None, max_frames: int | None = None, cache_gib: float = 0, **_
    ) -> tuple[np.ndarray, dict]:
        """(frames (F, H, W, 3) uint8, {"audio": mono samples at 16 kHz or None, ...}). vLLM's `num_frames` and
        `fps` are not taken: the released models sample 1 frame/s. `frame_size` (the tower's square) and
        `max_frames` (the model's limit), which `serve` passes, bound the memory a large or long video takes:
        frames are resized as they are decoded, and decoding stops one frame past the limit (the processor then
        refuses the video). With `cache_gib`, a file decoded before (the same bytes, the same two settings) is
        not decoded again: hashing its bytes is far cheaper than decoding them."""
        digest = media_digest(data, f"{frame_size} {max_frames}".encode())
        if (decoded := cls.cache(cache_gib).get(key := bytes(digest.tolist()))) is None:
            try:
                limit = None if max_frames is None else max_frames + 1
                pictures, audio = load_video(FileBytes(data, "the request's video"), limit=limit, square=frame_size)
            except MediaError as e:
                raise ValueError(f"the request's video {e.problem}") from None
            decoded = np.stack([np.asarray(picture) for picture in pictures]), audio
            for array in decoded:  # shared by every request on this file from now on
                if array is not None:
                    array.flags.writeable = False
            cls.decoded.put(key, decoded, sum(array.nbytes for array in decoded if array is not None))
        return cls.video(decoded, digest)

    @classmethod
    def cache(cls, cache_gib: float) -> ByteBoundCache:
        """The decodes kept at the server's setting (the same for every call), made anew with the file table when
        the setting is another."""
        if cls.decoded.limit_bytes != int(cache_gib * 2**30):
            cls.decoded, cls.files = ByteBoundCache(int(cache_gib * 2**30)), {}
        return cls.decoded

    @staticmethod
    def video(decoded: tuple[np.ndarray, np.ndarray | None], digest: torch.Tensor) -> tuple[np.ndarray, dict]:
        frames, audio = decoded
        return frames, {"fps": VIDEO_FPS, "total_num_frames": len(frames), "audio": audio, FILE_DIGEST: digest}

    @classmethod
    def file_read(cls, identity: tuple, digest: torch.Tensor, frame_size=None, max_frames=None, **_) -> None:
        """`UnchangedFiles` read the file of this identity (stat's figures) with these settings: it decoded to the
        decode kept by `digest`'s key (while the cache keeps it)."""
        if not cls.decoded.limit_bytes:
            return
        if len(cls.files) > 2 * len(cls.decoded.entries) + 64:  # forget the files whose decodes left the cache
            cls.files = {name: key for name, key in list(cls.files.items()) if key in cls.decoded.entries}
        cls.files[(identity, frame_size, max_frames)] = bytes(digest.tolist())

    @classmethod
    def unchanged_file(
        cls, identity: tuple, frame_size=None, max_frames=None, cache_gib: float = 0, **_
    ) -> tuple[np.ndarray, dict] | None:
        """The video a file of this identity decoded to before with these settings, while the cache keeps it."""
        cache = cls.cache(cache_gib)
        if (key := cls.files.get((identity, frame_size, max_frames))) is None:
            return None
        if (decoded := cache.get(key)) is None:  # evicted since: the file is read again
            cls.files.pop((identity, frame_size, max_frames), None)
            return None
        return cls.video(decoded, torch.frombuffer(bytearray(key), dtype=torch.uint8))
