"""The context streams text attends to besides itself, one spec each: what one part of the input is, the tower and the
graph that encode it, how many parts go through them at once, how many tokens it makes, and the segment id its keys
carry in the context mask (the op gives each segment its own softmax with the sum merge).

The reference model, the export's manifest, the graphs' runtime and the vLLM plugin read these facts here; a model's
streams follow its input type (`STREAMS`). Plain Python, no imports: it ships in a Hub repo beside the model files.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass  # not frozen: tests shrink parts_per_run to exercise the part loops on tiny inputs
class ContextStream:
    name: str  # image | frames | audio
    segment: int  # its keys' id in the context mask (0 marks no key)
    tower: str  # the module that encodes it
    graph: str  # the ONNX graph that encodes its parts
    part: str  # what one part of the input is
    parts_per_run: int | None  # parts through the tower (or its graph) at once (None: all): bounds memory only
    tokens_per_part: str | None = None  # the config's (or manifest's) tokens per part: a number, or of the part count
    units_per_token: str | None = None  # or, where a part's tail may be cut: input units (log-mel frames) per token

    def tokens(self, config, amount: int) -> int:
        """The tokens of `amount` parts (or, with units_per_token, of that many input units); `config`: the model's
        config or its export manifest's model facts, which name these sizes alike."""
        if self.units_per_token is not None:
            return amount // getattr(config, self.units_per_token)
        per_part = getattr(config, self.tokens_per_part)
        return amount * (per_part(amount) if callable(per_part) else per_part)


IMAGE = ContextStream("image", 1, "mm_vis", "vision", "image", None, tokens_per_part="tokens_per_image")
FRAMES = ContextStream("frames", 1, "mm_vis", "vision", "frame", 16, tokens_per_part="frame_tokens")
AUDIO = ContextStream(
    "audio", 2, "mm_aud", "audio", "30 s log-mel chunk", 16, units_per_token="mel_frames_per_audio_token"
)

STREAMS = {"image": (IMAGE,), "video": (FRAMES, AUDIO)}  # by input type (mm_input_type), in the context's order


def context_graphs(input_type: str) -> tuple[str, ...]:
    """The graphs an export of a model with this input type holds: its streams' encoders, then the context K/V and
    the decoder."""
    return (*dict.fromkeys(stream.graph for stream in STREAMS[input_type]), "context_kv", "decoder")
