"""The plugin's processor on vLLM's encoder-decoder path: a request's prompt as the reference tokenizes it, and its
picture or video processed (pictures, tiles and frames as bytes; log-mel chunks of the sound track) into the fields
`inputs.py` types, with one encoder placeholder per context token; media processed before are taken from a cache."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from functools import cached_property, partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import BatchFeature
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.parse import MultiModalDataParser
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseProcessingInfo,
    EncDecMultiModalProcessor,
    PromptReplacement,
)

from ..modeling.marked_prompts import media_marker, prompt_ids
from ..modeling.processing_dattn import DAttnProcessor
from ..modeling.streams import AUDIO
from ..processing import load_processor
from . import VIDEO_BACKEND
from .context_cache import ByteBoundCache, context_cache_bytes, media_digest, named_digest
from .inputs import picture_parts, video_field_parts
from .media import FILE_DIGEST
from .video import FRAME_LIMIT_OPTION, longest_sound_track, longest_video, max_video_frames, video_tokens

MAX_IMAGE_PIXELS = 64 * 2**20  # a request's image may hold at most this many pixels (it is resized to the tower's)
PROFILING = "dattn_profiling"  # in a video's metadata: the dummy video vLLM profiles and warms up with
# the names (vLLM's multi_modal_uuids) of the items the processor is processing, per item
ITEM_NAMES: ContextVar[Sequence[str | None]] = ContextVar("dattn_item_names", default=())
# the name vLLM gives an item its request does not name, where its processor cache and prefix caching are off (ours:
# encoder-decoder), unique to the request (renderers/base.py `_process_mm_uuids`): not a name of the medium
UNNAMED = re.compile(r"renderer\d+-mm-\d+-(image|video)-\d+")


class DAttnProcessingInfo(BaseProcessingInfo):
    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {self.get_hf_config().modality: 1}

    def get_data_parser(self) -> MultiModalDataParser:
        """A video comes with its metadata, which carries its sound track (`media.DAttnVideoLoader`)."""
        return MultiModalDataParser(
            expected_hidden_size=self._get_expected_hidden_size(),
            video_needs_metadata=AUDIO in self.get_hf_config().streams,
        )

    @cached_property
    def processor(self) -> DAttnProcessor:
        """The folder's processor, as every dattn-export command prepares media with it (vLLM's tokenizer its own)."""
        return load_processor(Path(self.ctx.model_config.model), self.get_hf_config(), self.get_tokenizer())

    def get_hf_processor(self, **kwargs: object) -> DAttnProcessor:
        return self.processor

    @cached_property
    def processed_media(self) -> ByteBoundCache:
        """Pictures and videos as processed (pictures, tiles and frames as bytes; log-mel chunks) by digest, within the
        context cache's size: vLLM keeps no processed media for encoder-decoder models, so a question on a picture
        seen before would resize and normalize it again, one on a video would process its every frame and its whole
        sound track."""
        return ByteBoundCache(context_cache_bytes(self.get_hf_config()))

    def processed(self, digest: torch.Tensor, process: Callable[[], tuple[torch.Tensor, ...]], keep: bool = True):
        """`process()`'s tensors for the medium of `digest`, from the cache when it was processed before."""
        key = bytes(digest.tolist())
        if (item := self.processed_media.get(key)) is None:
            item = process()
            if keep:
                self.processed_media.put(key, item, sum(t.nbytes for t in item if isinstance(t, torch.Tensor)))
        return item

    def max_frames(self) -> int:
        options = self.ctx.get_mm_config().limit_per_prompt.get("video")
        return max_video_frames(None if options is None else options.num_frames)


class DAttnDummyInputsBuilder(BaseDummyInputsBuilder[DAttnProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return ""

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options):
        """The largest image: an anyres model's widest tiling, filled exactly; the video with the most tokens
        (`video.longest_video`), with a sound track as long."""
        config = self.info.get_hf_config()
        size = config.vision_config["image_size"]
        if config.modality == "video":
            frames, _ = longest_video(config, self.info.max_frames(), self.info.processor.feature_extractor.hop_length)
            video = self._get_dummy_videos(width=size, height=size, num_frames=frames, num_videos=1)[0]
            audio = np.random.default_rng(0).uniform(-0.5, 0.5, longest_sound_track(frames))
            metadata = {"audio": audio.astype(np.float32), PROFILING: True}
            return {"video": [(video, metadata)] * mm_counts.get("video", 0)}
        columns, rows = config.streams[0].part_on(self, "largest")(config)
        images = self._get_dummy_images(
            width=columns * size,
            height=rows * size,
            num_images=mm_counts.get("image", 0),
            overrides=mm_options.get("image"),
        )
        return {"image": images}

    @staticmethod
    def largest_image(config) -> tuple[int, int]:
        """The largest picture's size in tower squares (columns, rows): a picture is resized to one."""
        return 1, 1

    @staticmethod
    def largest_tiles(config) -> tuple[int, int]:
        """An anyres model's: its widest tiling, filled exactly."""
        return max(config.mm_image_grid_points, key=lambda point: point[0] * point[1])


class DAttnMultiModalProcessor(EncDecMultiModalProcessor[DAttnProcessingInfo]):
    skip_decoder_start_token = True  # the prompt is the tokenizer's, as the reference reads it: no BOS added

    def create_encoder_prompt(self, prompt: list[int], mm_items) -> list[int]:
        """One placeholder, which becomes one per visual token: the length of the request's cross-attention cache."""
        return [0]

    def create_decoder_prompt(self, prompt: str | list[int], mm_items) -> list[int]:
        """The text's ids as the reference makes them (`prompt_ids`: a media marker cut out, as the released code
        does); ids that hold no marker are taken as they are."""
        tokenizer = self.info.get_tokenizer()
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        if isinstance(prompt, str) or media_marker(text) is not None:
            return prompt_ids(tokenizer, text.removeprefix(tokenizer.bos_token or ""))
        return prompt

    def apply(self, inputs, timing_ctx):
        """vLLM's processing, with the request's names for its items (`multi_modal_uuids`) at hand: a named item's
        digest is its name's (`named_digest`), as vLLM's own caches take the name for the item's hash, so a
        question about a named video hashes none of its frames and samples."""
        names = ITEM_NAMES.set((inputs.mm_uuid_items or {}).get(self.info.get_hf_config().modality, ()))
        try:
            return super().apply(inputs, timing_ctx)
        finally:
            ITEM_NAMES.reset(names)

    @staticmethod
    def digests(items: Sequence, content_digest: Callable[[object], torch.Tensor]) -> list[torch.Tensor]:
        """Each item's digest: its name's where its request names it, else `content_digest(item)`."""
        names = ITEM_NAMES.get() or [None] * len(items)  # vLLM checks that a request names each item or none
        return [
            content_digest(item) if name is None or UNNAMED.fullmatch(name) else named_digest(name)
            for item, name in zip(items, names)
        ]

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> BatchFeature:
        if "videos" in hf_data:
            return self.video_features(hf_data["videos"])
        images = hf_data["images"]
        for image in images:
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"image of {image.width}x{image.height} pixels: at most {MAX_IMAGE_PIXELS} are taken")
        images = [image if image.mode == "RGB" else image.convert("RGB") for image in images]
        digests = torch.stack(self.digests(images, lambda image: media_digest(np.asarray(image))))
        process = self.info.get_hf_config().streams[0].part_on(self, "process")
        processed = [self.info.processed(d, partial(process, i)) for d, i in zip(digests, images)]
        pixels, tilings = zip(*processed)
        field = self.info.get_hf_config().streams[0].served_field
        return BatchFeature({field: joined(pixels), "tiling": torch.tensor(tilings), "digest": digests})

    def process_image(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """A picture as the released code prepares one (mm_image_aspect_ratio), as bytes until the model normalizes
        it (a quarter of what is kept, sent and batched): (1, 3, H, W), and its tiling ((0, 0): not tiled)."""
        return self.info.processor.picture_bytes([image]), (0, 0)

    def process_tiles(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """An anyres picture's thumbnail and tiles, as bytes, and its tiling (columns, rows)."""
        return self.info.processor.anyres_bytes(image)

    def video_features(self, videos: list[tuple[np.ndarray, dict]]) -> BatchFeature:
        """The videos' fields (`inputs.VideoInputs`): frames as bytes, a quarter of the memory and of what is sent
        to the workers."""
        most, processed = self.info.max_frames(), []
        for video, _ in videos:
            if len(video) > most:
                raise ValueError(
                    f"video of {len(video)} frames: at most {most} are served ({FRAME_LIMIT_OPTION} raises it)"
                )
        tracks = [sound_track(metadata) for _, metadata in videos]
        digests = self.digests(range(len(videos)), lambda i: video_digest(videos[i], tracks[i]))
        for (video, metadata), samples, digest in zip(videos, tracks, digests):
            # vLLM's start-up video (the longest) is never asked about
            process = partial(self.process_video, video, samples)
            processed.append(self.info.processed(digest, process, keep=not metadata.get(PROFILING)))
        *fields, sizes = zip(*processed)
        names = [stream.served_field for stream in self.info.get_hf_config().streams]
        flat = {name: joined(parts) for name, parts in zip(names, fields, strict=True)}
        return BatchFeature(flat | {"sizes": torch.tensor(sizes), "digest": torch.stack(digests)})

    def process_video(self, video: np.ndarray, samples: np.ndarray | None) -> tuple:
        """A video's processed media, a tensor per stream, and its sizes [parts, amount] per stream."""
        tensors, sizes = [], []
        for stream in self.info.get_hf_config().streams:
            tensor, amount = stream.part_on(self, "process")(video, samples)
            tensors.append(tensor)
            sizes += [len(tensor), amount]
        return *tensors, sizes

    def process_frames(self, video: np.ndarray, samples: np.ndarray | None) -> tuple[torch.Tensor, int]:
        """The frames as bytes (F, 3, side, side), and their count."""
        pictures = [Image.fromarray(np.asarray(frame)).convert("RGB") for frame in video]
        return self.info.processor.picture_bytes(pictures), len(pictures)

    def process_audio(self, video: np.ndarray, samples: np.ndarray | None) -> tuple[torch.Tensor, int]:
        """The sound track's log-mel chunks and its length in mel frames; one chunk of zeros and 0 without one (or
        with one too short for a token)."""
        config, processor = self.info.get_hf_config(), self.info.processor
        if samples is not None:
            mels, mel_frames = processor.sound_features(samples)
            if mel_frames >= config.mel_frames_per_audio_token:
                return mels, mel_frames
        extractor = processor.feature_extractor
        return torch.zeros(1, extractor.feature_size, extractor.nb_max_frames), 0

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs) -> Mapping[str, MultiModalFieldConfig]:
        if "sizes" in hf_inputs:
            parts = video_field_parts(self.info.get_hf_config().streams, hf_inputs["sizes"])
            return {name: MultiModalFieldConfig.flat_from_sizes("video", counts) for name, counts in parts.items()} | {
                "sizes": MultiModalFieldConfig.batched("video", keep_on_cpu=True),
                "digest": MultiModalFieldConfig.batched("video", keep_on_cpu=True),
            }
        per_image, field = picture_parts(hf_inputs["tiling"]), self.info.get_hf_config().streams[0].served_field
        return {
            field: MultiModalFieldConfig.flat_from_sizes("image", per_image),
            "tiling": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
            "digest": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
        }

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs) -> Sequence[PromptReplacement]:
        """One placeholder per visual token, counted from the item as processed (its digest's processed media: a
        named item's may be another call's), so that the request's cross-attention cache fits its context."""
        config = self.info.get_hf_config()
        if config.modality == "video":

            def video_placeholders(item: int) -> list[int]:
                amounts = out_mm_kwargs.get_data()["sizes"][item][1::2].tolist()  # each stream's
                return [0] * video_tokens(config, *amounts)

            return [PromptReplacement(modality="video", target=[0], replacement=video_placeholders)]

        def placeholders(item: int) -> list[int]:
            columns, rows = out_mm_kwargs.get_data()["tiling"][item].tolist()  # the thumbnail's grid, then the tiles'
            return [0] * (config.tokens_per_image * (1 + columns * rows))

        return [PromptReplacement(modality="image", target=[0], replacement=placeholders)]


def joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Items' processed media one after another: a request's one item (the usual case) as it is kept, not copied."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def video_digest(video: tuple[np.ndarray, Mapping[str, object]], samples: np.ndarray | None) -> torch.Tensor:
    """A video's content digest: its file's where it was read from one (which names its decoded frames and sound as
    well as theirs does, and costs nothing here), else its frames' and `samples`'."""
    frames, metadata = video
    digest = metadata.get(FILE_DIGEST)
    return media_digest(np.asarray(frames), samples) if digest is None else digest


def sound_track(metadata: Mapping[str, object]) -> np.ndarray | None:
    """A video's sound track from its metadata (None: a video without one); a video that another of vLLM's loaders
    decoded is refused: those sample a fixed count of frames, not the released 1 frame/s, and drop the sound."""
    if "audio" not in metadata:
        backend = metadata.get("video_backend", "its own")
        raise ValueError(
            f"the video was decoded by vLLM's {backend} loader, which drops its sound track: serve with "
            f'--media-io-kwargs \'{{"video": {{"video_backend": "{VIDEO_BACKEND}"}}}}\' (dattn-export serve '
            "does), or give the frames with {'audio': samples or None}"
        )
    samples = metadata["audio"]
    return None if samples is None else np.asarray(samples, dtype=np.float32)
