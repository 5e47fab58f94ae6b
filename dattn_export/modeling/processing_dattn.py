"""The model's processor, as every vision-language model on the Hub has one (`AutoProcessor`, `trust_remote_code=True`):
`processor(text=..., images=..., videos=..., audio=..., return_tensors="pt")` gives what `model.generate(**inputs)`
takes, every medium prepared as the released code prepares it, by the repo's own config.json:
  text    the released ids: a leading BOS text dropped (its chat template writes one), the media's marker cut out
          (`marked_prompts.py`); a batch left-padded;
  images  pictures (PIL, arrays, paths, URLs) by mm_image_aspect_ratio (`images.py`): `pixel_values`
          (prompts, pictures, 3, H, W); anyres: one picture's thumbnail and tiles, zero-padded, and `image_sizes`;
  videos  a file's path or URL (decoded at 1 frame a second with its sound track, as the released decoder reads it:
          `video_decoding.py`), frames, or an array (frames, H, W, 3): `pixel_values_videos` (prompts, frames, 3, H, W),
          zero-padded, and `video_frames`;
  audio   16 kHz samples, or a video's own sound track (`use_audio_in_video`): Whisper's 30 s log-mel chunks
          `input_features` (prompts, chunks, mel bins, chunk frames), zero-padded, and `audio_mel_frames`.
Media the model cannot take is a ValueError naming it. The chat template is the tokenizer's: a message's image,
video or audio parts become the one marker the released models were trained on.

dattn-export's own commands prepare media with the same functions (`images.py`, `video_decoding.py`,
`sound_decoding.py`, `audio_features` below).
"""

from __future__ import annotations

import io
import urllib.request
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    BatchFeature,
    PretrainedConfig,
    ProcessorMixin,
    WhisperFeatureExtractor,
)
from transformers.image_transforms import to_pil_image

from .configuration_dattn import CONFIG_CLASSES
from .images import UNSCALED, PreparedFrames, anyres_tiles, as_bytes, prepare_pictures, tower_side
from .marked_prompts import media_marker, prompt_ids
from .media_files import FileBytes, MediaError, resized_to_tower
from .sound_decoding import AUDIO_RATE, load_audio
from .streams import AUDIO, MEDIA_INPUTS
from .video_decoding import VIDEO_FPS, load_video

HUB_OPTIONS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
FEATURE_EXTRACTOR = "feature_extractor"  # its key in processor_config.json, as transformers 5 nests a processor's
IGNORED_OPTIONS = ("padding", "truncation", "return_attention_mask", "return_mm_token_type_ids")


def default_audio_processor(audio_config: dict | None) -> WhisperFeatureExtractor:
    """Whisper's feature extractor at the audio tower's mel bins, its chunk the encoder's input (2 x
    max_source_positions mel frames: 3000 for Whisper), as the released towers' preprocessor is; a model without an
    audio tower: Whisper's (its processor holds one as every processor holds its components; it takes no audio)."""
    if audio_config is None:
        return WhisperFeatureExtractor()
    hop = WhisperFeatureExtractor().n_samples // (2 * audio_config["max_source_positions"])
    return WhisperFeatureExtractor(feature_size=audio_config["num_mel_bins"], hop_length=hop)


def saved_feature_extractor(processor_fields: dict) -> WhisperFeatureExtractor | None:
    """The feature extractor a processor_config.json holds (`convert` writes the audio tower's), None without one."""
    saved = processor_fields.get(FEATURE_EXTRACTOR)
    return WhisperFeatureExtractor(**saved) if saved else None


def audio_features(samples: np.ndarray, extractor) -> tuple[torch.Tensor, int]:
    """(chunks, mel bins, chunk frames) log-mel features of 30 s chunks and the real mel frames in all
    (process_audio; its `num_frames`, which transformers 4.x returned: each chunk's samples // hop length)."""
    chunks = [samples[i : i + extractor.n_samples] for i in range(0, len(samples), extractor.n_samples)]
    features = extractor(chunks, sampling_rate=extractor.sampling_rate, return_tensors="pt")
    return features.input_features, sum(len(chunk) // extractor.hop_length for chunk in chunks)


def read_url(url: str) -> FileBytes:
    with urllib.request.urlopen(url) as response:
        return FileBytes(response.read(), url)


def is_url(item) -> bool:
    return isinstance(item, str) and item.startswith(("http://", "https://"))


def load_picture(item) -> Image.Image:
    """A picture as the released loaders open one (`.convert('RGB')`, no EXIF turn): a PIL image, a path or URL, or an
    array (H, W, C or C, H, W)."""
    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, (str, Path)):
        source = io.BytesIO(read_url(item).data) if is_url(item) else item
        try:
            with Image.open(source) as picture:
                return picture.convert("RGB")
        except OSError as e:
            raise MediaError(item, f"cannot be read as a picture ({e})") from None
    if is_array(item, 3):
        return to_pil_image(item).convert("RGB")
    raise ValueError(f"a picture is a PIL image, a path, a URL or an array (H, W, C), not {type(item).__name__}")


def per_prompt(media, prompts: int, is_item) -> list[list]:
    """Media for each of `prompts` prompts: one item, a list of one item per prompt (a single prompt's list of
    several), or a list of lists, as transformers' processors take them."""
    if media is None:
        return [[] for _ in range(prompts)]
    if is_item(media):
        media = [media]
    media = list(media)
    if all(isinstance(m, (list, tuple)) and not is_item(m) for m in media):
        nested = [list(m) for m in media]
    elif prompts == 1:
        nested = [media]
    else:
        nested = [[m] for m in media]
    if len(nested) != prompts:
        raise ValueError(f"{len(nested)} prompts' media for {prompts} prompts")
    return nested


def is_array(item, ndim: int) -> bool:
    return isinstance(item, (np.ndarray, torch.Tensor)) and item.ndim == ndim


def is_picture(item) -> bool:
    return isinstance(item, (Image.Image, str, Path)) or is_array(item, 3)


def is_video(item) -> bool:
    """One video: a path or URL, an array of frames (frames, H, W, C), or a list of frames."""
    if isinstance(item, (str, Path, FileBytes)) or is_array(item, 4):
        return True
    frames = isinstance(item, (list, tuple)) and len(item) > 0
    return frames and all(isinstance(f, Image.Image) or is_array(f, 3) for f in item)


def is_samples(item) -> bool:
    return isinstance(item, (str, Path)) or is_array(item, 1)


def padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Tensors of one shape but the first dimension, stacked and zero-padded along it (zeros: nothing, to the model)."""
    longest = max(len(t) for t in tensors)
    out = tensors[0].new_zeros(len(tensors), longest, *tensors[0].shape[1:])
    for row, tensor in zip(out, tensors):
        row[: len(tensor)] = tensor
    return out


class DAttnProcessor(ProcessorMixin):
    """The tokenizer, the vision tower's image processor and the audio tower's Whisper feature extractor (saved in
    processor_config.json by `convert`, as transformers 5 saves a processor's; Whisper's defaults at the tower's size
    where a folder has none), each loaded once, each medium prepared as the released code prepares it.
    `model_config`: the repo's config.json, read by `from_pretrained` (the aspect rule, the anyres tilings, the
    streams a model takes)."""

    def __init__(self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None, **kwargs):
        # the chat template is the tokenizer's: the one the released scripts and dattn-export ask through
        chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        super().__init__(image_processor, feature_extractor, tokenizer, chat_template=chat_template, **kwargs)
        self.model_config = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        path, options = pretrained_model_name_or_path, {key: kwargs[key] for key in HUB_OPTIONS if key in kwargs}
        fields, _ = PretrainedConfig.get_config_dict(path, **options)
        config = CONFIG_CLASSES[fields["model_type"]].from_dict(fields)
        # the released code prepares pictures with PIL: torchvision's resize (transformers' default where it is
        # installed) gives other pixels
        image_processor = AutoImageProcessor.from_pretrained(path, backend="pil", **options)
        saved = saved_feature_extractor(cls.get_processor_dict(path, **options)[0])
        feature_extractor = saved or default_audio_processor(config.audio_config)
        tokenizer = AutoTokenizer.from_pretrained(path, config=config, **options)  # the config read: no remote code
        processor = cls(image_processor, feature_extractor, tokenizer)
        processor.model_config = config
        return processor

    @property
    def model_input_names(self) -> list[str]:
        return ["input_ids", "attention_mask", *MEDIA_INPUTS]

    def __call__(
        self,
        images=None,
        text=None,
        videos=None,
        audio=None,
        return_tensors=None,
        use_audio_in_video: bool = True,
        fps: float = VIDEO_FPS,
        sampling_rate: int | None = None,
        add_special_tokens: bool = True,
        **kwargs,
    ) -> BatchFeature:
        """`text`: a prompt or a list of prompts, each with the media's marker (`<image>`) where its media sit (the
        chat template writes it); the media per prompt as transformers' processors take them. `use_audio_in_video`:
        a video file's sound track as the audio stream where the model has one and no `audio` is given; `fps`: frames
        kept a second of a video file (the released models: 1)."""
        if unknown := [key for key in kwargs if key not in IGNORED_OPTIONS]:
            raise TypeError(f"DAttnProcessor got unexpected options {unknown}")
        if sampling_rate not in (None, AUDIO_RATE):
            raise ValueError(f"audio is taken at {AUDIO_RATE} Hz (Whisper's rate), not {sampling_rate}")
        texts = [text] if isinstance(text, str) else list(text or [""])
        pictures = per_prompt(images, len(texts), is_picture)
        videos = per_prompt(videos, len(texts), is_video)
        sounds = per_prompt(audio, len(texts), is_samples)
        self.check_media(pictures, videos, sounds)

        data = {}
        if any(pictures):
            data.update(self.pictures([[load_picture(p) for p in prompt] for prompt in pictures]))
        if any(videos) and not all(videos):
            raise ValueError("videos: every prompt of a batch carries a video, or none does")
        if any(videos):
            frames, tracks = zip(*(self.video(prompt[0], fps, use_audio_in_video and not sound)
                                   for prompt, sound in zip(videos, sounds)))  # fmt: skip
            data.update(pixel_values_videos=padded(frames), video_frames=torch.tensor([len(f) for f in frames]))
            sounds = [sound or ([track] if track is not None else []) for sound, track in zip(sounds, tracks)]
        if any(sounds):
            data.update(self.audio([self.samples(prompt[0]) if prompt else None for prompt in sounds]))

        media = [bool(p or v or s) for p, v, s in zip(pictures, videos, sounds)]
        ids = [self.text_ids(t, given, add_special_tokens) for t, given in zip(texts, media)]
        data.update(self.left_padded(ids))
        return BatchFeature(data, tensor_type=return_tensors)

    def check_media(self, pictures: list[list], videos: list[list], sounds: list[list]) -> None:
        """What the model cannot take, as a ValueError naming the medium."""
        config, streams = self.model_config, self.model_config.streams
        takes = {medium for stream in streams for medium in stream.media}
        if any(pictures) and "images" not in takes:
            raise ValueError(f"images: this model ({config.model_type}) takes videos and their sound, not pictures")
        if any(videos) and "video" not in takes:
            raise ValueError(f"videos: this model ({config.model_type}) takes pictures, not videos")
        if any(sounds) and AUDIO not in streams:
            raise ValueError(f"audio: this model ({config.model_type}) has no audio tower")
        if any(len(v) > 1 for v in videos):
            raise ValueError("videos: this model takes one video a prompt")
        if any(len(s) > 1 for s in sounds):
            raise ValueError("audio: this model takes one sound track a prompt")
        limit = streams[0].pictures
        if limit is not None and any(len(p) > limit for p in pictures):
            raise ValueError(f"images: this model (mm_image_aspect_ratio 'anyres') takes {limit} picture a prompt")
        if any(pictures) and len({len(p) for p in pictures}) > 1:
            raise ValueError("images: every prompt of a batch carries as many pictures")

    def text_ids(self, text: str, media: bool, add_special_tokens: bool) -> list[int]:
        """The released ids of one prompt (`prompt_ids`): a BOS text dropped (Vidi's preprocess_chat) and added back
        as the tokenizer adds it."""
        bos = self.tokenizer.bos_token
        if bos and text.startswith(bos):
            text, add_special_tokens = text.replace(bos, ""), True
        marker = media_marker(text)
        if media and marker is None:
            raise ValueError(
                f"the prompt {text!r} comes with media but holds no <image> marker where they sit: ask through "
                "processor.apply_chat_template (it places it), or begin the prompt with '<image>\\n'"
            )
        if marker and not media:
            raise ValueError(f"the prompt {text!r} holds {marker} but no picture, video or audio was given")
        return prompt_ids(self.tokenizer, text, add_special_tokens)

    def left_padded(self, ids: list[list[int]]) -> dict:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        longest = max(len(row) for row in ids)
        return {
            "input_ids": [[pad] * (longest - len(row)) + row for row in ids],
            "attention_mask": [[0] * (longest - len(row)) + [1] * len(row) for row in ids],
        }

    def pictures(self, pictures: list[list[Image.Image]]) -> dict:
        """Each prompt's pictures prepared by the config's aspect rule; anyres: a picture's thumbnail and tiles."""
        config = self.model_config
        if config.mm_image_aspect_ratio != "anyres":
            rule = config.mm_image_aspect_ratio
            return {"pixel_values": torch.stack([prepare_pictures(p, rule, self.image_processor) for p in pictures])}
        tiles = [self.anyres(p[0])[0] for p in pictures]
        return {"pixel_values": padded(tiles), "image_sizes": torch.tensor([p[0].size for p in pictures])}

    def anyres(self, picture: Image.Image, **options) -> tuple[torch.Tensor, tuple[int, int]]:
        """An anyres model's picture as its thumbnail and tiles (tiles + 1, 3, H, W), and the tiling (columns, rows).
        `options` go to the image processor's call."""
        return anyres_tiles(picture, self.image_processor, self.model_config.mm_image_grid_points, **options)

    def picture_bytes(self, pictures: list[Image.Image]) -> torch.Tensor:
        """(N, 3, H, W) uint8: pictures prepared as the `pictures` method prepares them (the aspect rule, not
        anyres), before the image processor rescales and normalizes them: a quarter of the bytes, for many frames held
        or sent at once (vLLM's requests: its workers normalize them)."""
        rule = self.model_config.mm_image_aspect_ratio
        return as_bytes(prepare_pictures(pictures, rule, self.image_processor, **UNSCALED))

    def anyres_bytes(self, picture: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """`anyres`' thumbnail and tiles as uint8, before they are rescaled and normalized, and the tiling."""
        pixels, tiling = self.anyres(picture, **UNSCALED)
        return as_bytes(pixels), tiling

    @property
    def frame_square(self) -> int | None:
        """The side a video model's frames are resized to before the tower where they are prepared by `resize` (as
        the released video models' are), else None: a frame can then be resized as it is decoded, and an hour of
        1080p holds 3600 squares, not 3600 x 6.2 MB of RGB (the preparation's own resize leaves it as it is)."""
        config = self.model_config
        if config.modality != "video" or config.mm_image_aspect_ratio != "resize":
            return None
        return tower_side(self.image_processor)

    def prepared_frames(self, frames: list[Image.Image]) -> PreparedFrames:
        """A video's frames (RGB, at `frame_square`) as the tower reads them, each part prepared when it is read: an
        hour of frames never held as float pixels at once."""
        return PreparedFrames(frames, self.model_config.mm_image_aspect_ratio, self.image_processor)

    def video(self, video, fps: float, sound: bool) -> tuple[torch.Tensor, np.ndarray | None]:
        """One video's pixel values (frames, 3, H, W), and its sound track where `sound` and the model has an audio
        stream (None otherwise, or for a file without one)."""
        square, sound = self.frame_square, sound and AUDIO in self.model_config.streams
        if isinstance(video, (str, Path, FileBytes)):
            source = read_url(video) if is_url(video) else video
            frames, samples = load_video(source, fps=fps, square=square, sound=sound)
        else:
            frames = [load_picture(frame) for frame in video]
            frames = frames if square is None else [resized_to_tower(frame, square) for frame in frames]
            samples = None
        return self.prepared_frames(frames)[:], samples

    @staticmethod
    def samples(item) -> np.ndarray:
        """A sound track: 16 kHz mono samples, or a media file's (decoded as the released code decodes it)."""
        if isinstance(item, (str, Path)):
            return load_audio(read_url(item) if is_url(item) else item)
        return np.asarray(item, dtype=np.float32)

    def sound_features(self, samples: np.ndarray) -> tuple[torch.Tensor, int]:
        """A sound track's log-mel 30 s chunks (chunks, mel bins, chunk frames) and its length in mel frames."""
        return audio_features(samples, self.feature_extractor)

    def audio(self, sounds: list[np.ndarray | None]) -> dict:
        """Each prompt's sound track as Whisper's log-mel chunks (zeros: none) and its length in mel frames."""
        features = [self.sound_features(s) if s is not None else None for s in sounds]
        shape = next(f[0] for f in features if f is not None).shape[1:]
        chunks = [f[0] if f is not None else torch.zeros(1, *shape) for f in features]
        lengths = [f[1] if f is not None else 0 for f in features]
        return {"input_features": padded(chunks), "audio_mel_frames": torch.tensor(lengths)}
