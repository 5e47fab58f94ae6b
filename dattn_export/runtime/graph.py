"""Run exported graphs, driven by their manifest: image (or a video's frames and audio) -> context K/V (once),
then prefill and decode steps through the one decoder graph with the text KV cache. `GraphRuntime` holds the
logic; a backend only says how to run one graph: ONNX Runtime (`ort.py`) or TensorRT (`tensorrt.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from pathlib import Path

import numpy as np

from ..artifacts import DTYPES, OnnxManifest
from ..errors import InputError
from ..modeling.images import PreparedFrames
from ..modeling.streams import CONTEXT_CHUNK, ContextStream, pooled_side

NUMPY_DTYPES = {d.onnx: d.numpy for d in DTYPES.values()}  # graph values' ONNX types
ATTENTION_BUDGET = 1 << 18  # new tokens x keys per decoder run (about 16 MB of fp32 logits a head group)


class GraphRuntime:
    manifest_class: type[OnnxManifest]

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.manifest = self.manifest_class.read(self.folder, "a folder this backend runs")
        decoder_inputs = self.manifest.graphs["decoder"].inputs
        # the caches, flat, in the graphs' order: every layer's key, value (and WINGS key, value)
        self.past_inputs = [i for i in decoder_inputs if i.name.startswith("past_key_values.")]
        self.context_names = [i.name for i in decoder_inputs if i.name.startswith("context_key_values.")]
        self.dtype = NUMPY_DTYPES[self.past_inputs[0].dtype]
        self.debias = self.manifest.model.debias

    def _run(self, graph: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """One graph's outputs, in the manifest's order."""
        raise NotImplementedError

    def empty_kv(self, batch: int, length: int = 0) -> list[np.ndarray]:
        """A cache to fill (batch, heads, length, head_dim) per input; an empty text cache by default."""
        return [np.empty((batch, spec.shape[1], length, spec.shape[3]), self.dtype) for spec in self.past_inputs]

    def no_context(self, batch: int) -> tuple[list[np.ndarray], np.ndarray]:
        """An empty context (no image, video or audio): its caches and (batch, 0) mask."""
        return self.empty_kv(batch), np.zeros((batch, 0), np.int64)

    def embed_images(self, pixel_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(context embeddings (B, V, hidden), context mask (B, V): 0 for the tokens of an image that means "none")."""
        embeds, mask = self._run("vision", {"pixel_values": pixel_values.astype(self.dtype)})
        return embeds, mask

    def encode_images(self, pixel_values: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """The images' K/V for every layer (flat, in the graphs' order) and their context mask."""
        embeds, mask = self.embed_images(pixel_values)
        return self.encode_context(embeds, mask), mask

    def encode_context(
        self, context_embeds: np.ndarray, context_mask: np.ndarray | None = None, chunk: int = CONTEXT_CHUNK
    ) -> list[np.ndarray]:
        """Every layer's context K/V (and WINGS keys/values), flat in the graphs' order [k0, v0, k1, v1, ...]. With
        diagonal V2V context tokens never mix, so long contexts run in chunks: memory stays that of one chunk and
        time stays linear."""
        if context_mask is None:
            context_mask = np.ones(context_embeds.shape[:2], np.int64)
        if not self.manifest.model.diagonal or context_embeds.shape[1] <= chunk:
            return self._run("context_kv", {"context_embeds": context_embeds, "context_attention_mask": context_mask})
        return self.fill_caches(iter([context_embeds]), context_mask, chunk)

    def fill_caches(
        self, parts: Iterator[np.ndarray], mask: np.ndarray, chunk: int = CONTEXT_CHUNK
    ) -> list[np.ndarray]:
        """Context caches (B, heads, V, D) built part by part: each part's tokens (B, n, hidden), in order, go
        through context_kv `chunk` tokens at a time straight into preallocated caches, so memory beyond the caches
        is that of one part; `mask` (B, V): the whole context's."""
        caches, offset = self.empty_kv(mask.shape[0], mask.shape[1]), 0
        for part in parts:
            for start in range(0, part.shape[1], chunk):
                embeds = part[:, start : start + chunk]
                end = offset + embeds.shape[1]
                feeds = {"context_embeds": embeds, "context_attention_mask": mask[:, offset:end]}
                for cache, piece in zip(caches, self._run("context_kv", feeds), strict=True):
                    cache[:, :, offset:end] = piece
                offset = end
        if offset != mask.shape[1]:
            raise ValueError(f"the context's parts hold {offset} tokens, its mask {mask.shape[1]}")
        return caches

    def encode_streams(self, inputs: dict[str, object]) -> tuple[list[np.ndarray], np.ndarray]:
        """A sample's context from its streams' inputs by stream name (each stream's `parts_{name}` says what it
        takes, `amount_{name}` how much of it its tokens count; one absent or None gives no tokens) -> every layer's
        K/V over the streams end to end, in the model's order, and the (1, V) mask giving each key its stream's
        segment. Built a part at a time (a stream's `parts_per_run` a run): memory beyond the caches does not grow
        with the length."""
        model = self.manifest.model
        given = [(s, inputs[s.name]) for s in model.streams if inputs.get(s.name) is not None]
        segments = [np.full(s.tokens(model, s.part_on(self, "amount")(x)), s.segment, np.int64) for s, x in given]
        mask = np.concatenate([np.zeros(0, np.int64), *segments])[None]
        return self.fill_caches(chain.from_iterable(s.part_on(self, "parts")(s, x) for s, x in given), mask), mask

    def encode_anyres(self, tiles: np.ndarray, columns: int, rows: int) -> tuple[list[np.ndarray], np.ndarray]:
        """An anyres image's context: its thumbnail and tiles (1 + columns x rows, 3, H, W), the tiling chosen for
        it -> every layer's K/V and the (1, V) mask."""
        feeds = {"thumbnail": tiles[:1], "tiles": tiles[1:].reshape(rows, columns, *tiles.shape[1:])}
        (embeds,) = self._run("vision", {name: t.astype(self.dtype) for name, t in feeds.items()})
        mask = np.ones(embeds.shape[:2], np.int64)
        return self.encode_context(embeds, mask), mask

    @staticmethod
    def batch_contexts(contexts: list[tuple[list[np.ndarray], np.ndarray]]) -> tuple[list[np.ndarray], np.ndarray]:
        """Samples' contexts (each `encode_streams`' caches and mask, batch 1) as one batch: right-padded to the
        longest, the padding masked out. Each video is pooled as a video of its own (past the resize budget, the
        released forward's pool counts a batch's frames together)."""
        length = max(mask.shape[1] for _, mask in contexts)

        def padded(t: np.ndarray, axis: int) -> np.ndarray:
            return np.pad(t, [(0, length - t.shape[axis]) if a == axis else (0, 0) for a in range(t.ndim)])

        caches = [np.concatenate([padded(c, 2) for c in parts]) for parts in zip(*(kv for kv, _ in contexts))]
        return caches, np.concatenate([padded(mask, 1) for _, mask in contexts])

    amount_frames = staticmethod(len)  # frames (F, 3, H, W): the frames its tokens count

    @staticmethod
    def amount_audio(audio: tuple[np.ndarray, int]) -> int:
        """(log-mel chunks, mel frames): the mel frames its tokens count."""
        return audio[1]

    def parts_frames(self, stream: ContextStream, frames: np.ndarray | PreparedFrames) -> Iterator[np.ndarray]:
        """A video's frames (F, 3, H, W; an array, or read a part at a time by slices as images.PreparedFrames is)
        through vision.onnx: (1, n * tokens per frame, hidden) a run; a space-to-depth pool's graph is told each
        frame's pooled side (`pooled_grid`'s length, of the video's length)."""
        model = self.manifest.model
        size = model.image_size
        if frames.ndim != 4 or frames.shape[1:] != (3, size, size):
            raise InputError("frames", f"of shape {list(frames.shape)}: vision.onnx takes [frames, 3, {size}, {size}]")
        side = {"pooled_grid": np.arange(pooled_side(model.patch_grid + 1, model.pool_size, len(frames)))}
        for start in range(0, len(frames), stream.parts_per_run):
            pixels = np.asarray(frames[start : start + stream.parts_per_run], dtype=self.dtype)
            index = np.arange(start, start + len(pixels), dtype=np.int64)
            feeds = {"pixel_values": pixels, "frame_index": index, "num_frames": np.array(len(frames))}
            (embeds,) = self._run("vision", feeds | (side if model.pool_rule == "space-to-depth" else {}))
            yield embeds

    def parts_audio(self, stream: ContextStream, audio: tuple[np.ndarray, int]) -> Iterator[np.ndarray]:
        """A sound track's log-mel 30 s chunks (C, bins, frames) and its length in mel frames through audio.onnx:
        its tokens a run, cut to its length."""
        features, mel_frames = audio
        for start in range(0, len(features), stream.parts_per_run):
            feeds = {
                "input_features": features[start : start + stream.parts_per_run].astype(self.dtype),
                "first_chunk": np.array(start, np.int64),
                "mel_frames": np.array(mel_frames, np.int64),
            }
            embeds, within = self._run("audio", feeds)
            yield embeds[:, within[0] == 1]

    def positions(self, attention_mask: np.ndarray, num_new: int, num_context: int) -> np.ndarray:
        """As the reference model: text positions count text tokens (after the context's when not debiased)."""
        offset = 0 if self.debias else num_context
        return offset + np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None)[:, -num_new:]

    def decode(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        past: list[np.ndarray],
        context: list[np.ndarray],
        context_mask: np.ndarray | None = None,
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """The decoder on new tokens (prefill when `past` is empty, a decode step when input_ids has one column).
        A prompt whose queries times keys pass ATTENTION_BUDGET runs in pieces of tokens, each with the cache the
        last one left: the graphs' attention holds its logits, so this bounds that memory however long the
        context (a long video) is."""
        num_new, num_keys = input_ids.shape[1], attention_mask.shape[1] + context[0].shape[2]
        step = max(1, ATTENTION_BUDGET // num_keys)
        if num_new <= step:
            return self.decoder_call(input_ids, attention_mask, past, context, context_mask)
        pieces, num_past = [], attention_mask.shape[1] - num_new
        for start in range(0, num_new, step):
            end = min(start + step, num_new)
            logits, past = self.decoder_call(
                input_ids[:, start:end], attention_mask[:, : num_past + end], past, context, context_mask
            )
            pieces.append(logits)
        return np.concatenate(pieces, axis=1), past

    def decoder_call(self, input_ids, attention_mask, past, context, context_mask) -> tuple[np.ndarray, list]:
        """One run of decoder.onnx."""
        batch, num_new = input_ids.shape
        num_context = context[0].shape[2]
        if context_mask is None:
            context_mask = np.ones((batch, num_context), np.int64)
        feeds = {
            "input_ids": input_ids.astype(np.int64),
            "attention_mask": attention_mask.astype(np.int64),
            "position_ids": self.positions(attention_mask, num_new, num_context),
            "context_attention_mask": context_mask,
        }
        feeds |= zip((spec.name for spec in self.past_inputs), past, strict=True)
        feeds |= zip(self.context_names, context, strict=True)
        logits, *present = self._run("decoder", feeds)
        return logits, present

    def generate(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        context: list[np.ndarray],
        max_new_tokens: int,
        eos_token_id: int | None = None,
        context_mask: np.ndarray | None = None,
    ) -> np.ndarray:
        """Greedy decoding, as the reference model's `generate`."""
        logits, past = self.decode(input_ids, attention_mask, self.empty_kv(input_ids.shape[0]), context, context_mask)
        tokens = []
        for step in range(max_new_tokens):
            next_token = logits[:, -1].argmax(-1)[:, None]
            tokens.append(next_token)
            if step == max_new_tokens - 1 or (eos_token_id is not None and (next_token == eos_token_id).all()):
                break
            attention_mask = np.concatenate([attention_mask, np.ones_like(next_token)], axis=1)
            logits, past = self.decode(next_token, attention_mask, past, context, context_mask)
        return np.concatenate(tokens, axis=1)
