"""The context streams text attends to besides itself, a class each: what one part of the input is, the tower and
the graph that encode it, how many parts go through them at once, how many tokens it makes, the segment id its keys
carry in the context mask (the op gives each segment its own softmax with the sum merge), the media a prompt gives
it, what its config must hold and the sizes it reports.

A model's streams follow its config (`streams_of`); every layer iterates over them, and one that adds its own part of
a stream (modules, graph, runtime loop) names it after the stream (`ContextStream.part_on`). Plain Python, no
imports: it ships in a Hub repo beside the model files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

CONTEXT_CHUNK = 2048  # context tokens through the decoder layers at once where each token's K/V depend on it alone


# space-to-depth pooling (Vidi1.5's mm_rand_img_pool): frames' grids are padded by one, and once a video's padded
# tokens pass RESIZE_TOKENS x pool^2 in all, every frame's grid is resized first (utils.resize_by_tokens)
RESIZE_TOKENS = 60000
RELEASED_PADDED_SIDE = 28  # the released code resizes only to a side other than this constant (SigLIP-384's 27 + 1)


def pooled_side(padded: int, pool: int, total_frames: int) -> int:
    """Space-to-depth: the side, in tokens, of each frame's pooled grid in a video of `total_frames` frames, whose
    tower grids are `padded` a side once padded: padded / pool, or past the resize budget the resize_by_tokens side
    (even, at least 10) / pool. Every backend counts a video's tokens and sizes its pool with this."""
    budget, counted = RESIZE_TOKENS * pool**2, total_frames * padded**2
    if counted <= budget:
        return padded // pool
    scaled = int(padded * (budget / counted) ** 0.5)
    side = max(10, scaled - scaled % 2)
    return (padded if side == RELEASED_PADDED_SIDE else side) // pool


def frame_tokens(pool_rule: str, pool: int, patch_grid: int, total_frames: int) -> int:
    """A video model's tokens per frame in a video of `total_frames` frames: conv-interpolate (Vidi_7B) pools every
    frame to pool x pool whatever the length; space-to-depth (Vidi1.5) as `pooled_side` says."""
    if pool_rule == "conv-interpolate":
        return pool**2
    return pooled_side(patch_grid + 1, pool, total_frames) ** 2


# how a video model pools a frame's tower features and its audio features (the released models differ):
#   conv-interpolate (Vidi_7B): a bias-free conv, stride 1, then bilinear resize to mm_image_pool_size a side;
#     the audio conv keeps the Whisper width
#   space-to-depth (Vidi1.5_9B): one zero row and column, then mm_image_pool_size-wide blocks stacked into
#     channels; the audio conv maps to the LLM width
POOL_RULES = ("conv-interpolate", "space-to-depth")


@dataclass(eq=False)  # not frozen: tests shrink parts_per_run to exercise the part loops on tiny inputs
class ContextStream:
    """One context stream: its facts here, and in its subclass what differs between streams: the media a prompt
    gives it, the config keys it needs, the sizes it reports. The layers above name their own part of a stream (its
    modules, graph, runtime loop, vLLM processing) after it (`part_on`). Streams are equal by name, and code tells
    them apart by name or attribute, never by class: a Hub repo's remote code loads copies of this module, whose classes
    are others than the package's."""

    name: str  # image | tiles | frames | audio
    segment: int  # its keys' id in the context mask (0 marks no key)
    tower: str  # the module that encodes it
    graph: str  # the ONNX graph that encodes its parts
    part: str  # what one part of the input is
    parts_per_run: int | None  # parts through the tower (or its graph) at once (None: all): bounds memory only
    tokens_per_part: str | None = None  # the config's (or manifest's) tokens per part: a number, or of the part count
    units_per_token: str | None = None  # or, where a part's tail may be cut: input units (log-mel frames) per token

    modality: ClassVar[str]  # the input a prompt gives: image | video (vLLM's modality; a video carries its sound)
    media: ClassVar[tuple[str, ...]]  # the prompt's media (media.Media's fields, the CLI's options) it reads
    pictures: ClassVar[int | None] = None  # the most pictures a prompt may give it (None: no limit)
    served_field: ClassVar[str]  # the field its media travels in to vLLM's model (the plugin's TensorSchemas)

    def __eq__(self, other) -> bool:
        return getattr(other, "name", None) == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def part_on(self, floor, role: str):
        """Its part on a floor above (a class or a module), found as ast.NodeVisitor finds a node's visitor: the
        floor's attribute `{role}_{name}` (`modules_frames`, `spec_audio`). Adding a stream adds its parts under
        those names; no floor keeps a table of streams."""
        return getattr(floor, f"{role}_{self.name}")

    def tokens(self, config, amount: int) -> int:
        """The tokens of `amount` parts (or, with units_per_token, of that many input units); `config`: the model's
        config or its export manifest's model facts, which name these sizes alike."""
        if self.units_per_token is not None:
            return amount // getattr(config, self.units_per_token)
        per_part = getattr(config, self.tokens_per_part)
        return amount * (per_part(amount) if callable(per_part) else per_part)

    def check(self, config) -> None:
        """What a model with this stream must configure (ValueError), checked when its config is."""

    def facts(self, config) -> dict:
        """Its sizes, as `info` shows them."""
        return {}

    def runtime_facts(self, config) -> dict:
        """The sizes the graphs' runtime reads from the export's manifest to run its graph."""
        return {}


class ImageStream(ContextStream):
    """Pictures, each prepared as mm_image_aspect_ratio says: projected, with row and column embeddings."""

    modality, media, served_field = "image", ("images",), "pixel_values"

    def position_grid(self, config) -> int:
        """How many positions the row / column embeddings spread over."""
        return config.patch_grid

    def facts(self, config) -> dict:
        return {"tokens_per_image": config.tokens_per_image}


class TilesStream(ImageStream):
    """anyres: one picture as a thumbnail plus the tiles of the best of mm_image_grid_points."""

    pictures = 1

    def check(self, config) -> None:
        if not config.mm_image_grid_points:
            raise ValueError("mm_image_aspect_ratio 'anyres' needs mm_image_grid_points (the tilings to choose from)")

    def position_grid(self, config) -> int:
        """The patch grid, times the widest tiling: the tiles' grids join into one."""
        return config.patch_grid * max(max(point) for point in config.mm_image_grid_points)

    def facts(self, config) -> dict:
        return super().facts(config) | {"anyres_tilings": f"{config.mm_image_grid_points} (columns, rows)"}


class FramesStream(ContextStream):
    """A video's frames, one a second: pooled (`mm_pool_rule`), with row, column and time embeddings."""

    modality, media, served_field = "video", ("video", "frames"), "frame_pixels"

    def check(self, config) -> None:
        needed = ("mm_image_pool_size", "mm_time_interval")
        if missing := [key for key in needed if getattr(config, key) is None]:
            raise ValueError(f"a video model (mm_input_type 'video') needs {', '.join(missing)}")
        if config.mm_image_aspect_ratio == "anyres":
            raise ValueError(
                "a video model's frames are prepared by resize, pad or crop, not anyres (the released "
                "video training asserts resize)"
            )
        if config.mm_pool_rule not in POOL_RULES:
            raise ValueError(f"mm_pool_rule must be one of {POOL_RULES}, got {config.mm_pool_rule!r}")
        if config.dattn_mode != "dattn-sum" or config.wings_rank:
            raise ValueError("a video model attends to its streams as the released code does: dattn_mode 'dattn-sum'")
        pool, grid = config.mm_image_pool_size, config.patch_grid
        if not 1 < pool <= grid:
            raise ValueError(f"mm_image_pool_size {pool} must lie in [2, {grid}] (the tower's patches a side)")
        if config.mm_pool_rule == "space-to-depth" and (grid + 1) % pool:
            raise ValueError(f"mm_image_pool_size {pool} must divide {grid + 1} (the tower's patches a side, plus one)")

    def facts(self, config) -> dict:
        return {"tokens_per_frame": config.tokens_per_frame, "pool_rule": config.mm_pool_rule}

    def runtime_facts(self, config) -> dict:
        return {
            "tokens_per_frame": config.tokens_per_frame,
            "pool_rule": config.mm_pool_rule,
            "pool_size": config.mm_image_pool_size,
        }


class AudioStream(ContextStream):
    """A video's sound track (or an audio file): every 30 s Whisper chunk, pooled, with time embeddings."""

    modality, media, served_field = "video", ("video", "audio"), "audio_mels"

    def check(self, config) -> None:
        if missing := [key for key in ("audio_config", "mm_audio_pool_size") if getattr(config, key) is None]:
            raise ValueError(f"a video model (mm_input_type 'video') needs {', '.join(missing)}")

    def facts(self, config) -> dict:
        return {"audio_tokens_per_chunk": config.audio_config["max_source_positions"] // config.mm_audio_pool_size}

    def runtime_facts(self, config) -> dict:
        return {"mel_frames_per_audio_token": config.mel_frames_per_audio_token}


IMAGE = ImageStream("image", 1, "mm_vis", "vision", "image", None, tokens_per_part="tokens_per_image")
TILES = TilesStream("tiles", 1, "mm_vis", "vision", "thumbnail and tiles", None)
FRAMES = FramesStream("frames", 1, "mm_vis", "vision", "frame", 16, tokens_per_part="frame_tokens")
AUDIO = AudioStream(
    "audio", 2, "mm_aud", "audio", "30 s log-mel chunk", 16, units_per_token="mel_frames_per_audio_token"
)

# the media inputs the processor gives (processing_dattn.py) and the model's forward and generate take: pictures (and
# an anyres picture's size), a video's frames and their count, its sound's log-mel chunks and their length
MEDIA_INPUTS = (
    "pixel_values", "image_sizes", "pixel_values_videos", "video_frames", "input_features", "audio_mel_frames"
)  # fmt: skip

STREAMS = {"image": (IMAGE,), "video": (FRAMES, AUDIO)}  # by input type (mm_input_type), in the context's order


def streams_of(input_type: str, aspect_ratio: str) -> tuple[ContextStream, ...]:
    """A model's streams, by its input type; an image model that prepares its picture by anyres tiles it."""
    streams = STREAMS[input_type]
    return (TILES,) if streams == (IMAGE,) and aspect_ratio == "anyres" else streams


def context_graphs(input_type: str) -> tuple[str, ...]:
    """The graphs an export of a model with this input type holds: its streams' encoders, then the context K/V and
    the decoder."""
    return (*dict.fromkeys(stream.graph for stream in STREAMS[input_type]), "context_kv", "decoder")
