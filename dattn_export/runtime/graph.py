"""Run exported graphs, driven by their manifest: image -> visual K/V (once), then prefill and decode steps
through the one decoder graph with the text KV cache. `GraphRuntime` holds the logic; a backend only says how to
run one graph: ONNX Runtime (`ort.py`) or TensorRT (`tensorrt.py`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..artifacts import DTYPES, OnnxManifest

NUMPY_DTYPES = {d.onnx: d.numpy for d in DTYPES.values()}  # graph values' ONNX types
VISUAL_CHUNK = 2048  # visual tokens per visual_kv run (diagonal models)


class GraphRuntime:
    manifest_class: type[OnnxManifest]

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.manifest = self.manifest_class.read(self.folder, "a folder this backend runs")
        decoder_inputs = self.manifest.graphs["decoder"].inputs
        # the caches, flat, in the graphs' order: every layer's key, value (and WINGS key, value)
        self.past_inputs = [i for i in decoder_inputs if i.name.startswith("past_key_values.")]
        self.visual_names = [i.name for i in decoder_inputs if i.name.startswith("visual_key_values.")]
        self.dtype = NUMPY_DTYPES[self.past_inputs[0].dtype]
        self.debias = self.manifest.model.debias

    def _run(self, graph: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """One graph's outputs, in the manifest's order."""
        raise NotImplementedError

    def empty_kv(self, batch: int) -> list[np.ndarray]:
        """An empty text cache: (batch, heads, 0, head_dim) per input."""
        return [np.zeros((batch, spec.shape[1], 0, spec.shape[3]), self.dtype) for spec in self.past_inputs]

    def embed_images(self, pixel_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(visual embeddings (B, V, hidden), visual mask (B, V): 0 for the tokens of an image that means "none")."""
        embeds, mask = self._run("vision", {"pixel_values": pixel_values.astype(self.dtype)})
        return embeds, mask

    def encode_images(self, pixel_values: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """The images' visual K/V for every layer (flat, in the graphs' order) and their visual mask."""
        embeds, mask = self.embed_images(pixel_values)
        return self.encode_visual(embeds, mask), mask

    def encode_visual(
        self, visual_embeds: np.ndarray, visual_mask: np.ndarray | None = None, chunk: int = VISUAL_CHUNK
    ) -> list[np.ndarray]:
        """Every layer's visual K/V (and WINGS keys/values), flat in the graphs' order [k0, v0, k1, v1, ...]. With
        diagonal V2V visual tokens never mix, so long visual sequences run in chunks: memory stays that of one
        chunk and time stays linear."""
        if visual_mask is None:
            visual_mask = np.ones(visual_embeds.shape[:2], np.int64)
        if not self.manifest.model.diagonal or visual_embeds.shape[1] <= chunk:
            return self._run("visual_kv", {"visual_embeds": visual_embeds, "visual_attention_mask": visual_mask})
        parts = [
            self._run(
                "visual_kv",
                {
                    "visual_embeds": visual_embeds[:, i : i + chunk],
                    "visual_attention_mask": visual_mask[:, i : i + chunk],
                },
            )
            for i in range(0, visual_embeds.shape[1], chunk)
        ]
        return [np.concatenate(outputs, axis=2) for outputs in zip(*parts)]

    def positions(self, attention_mask: np.ndarray, num_new: int, num_visual: int) -> np.ndarray:
        """As the reference model: text positions count text tokens (after the visual ones when not debiased)."""
        offset = 0 if self.debias else num_visual
        return offset + np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None)[:, -num_new:]

    def decode(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        past: list[np.ndarray],
        visual: list[np.ndarray],
        visual_mask: np.ndarray | None = None,
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """One decoder call (prefill when `past` is empty, a decode step when input_ids has one column)."""
        batch, num_new = input_ids.shape
        num_visual = visual[0].shape[2]
        if visual_mask is None:
            visual_mask = np.ones((batch, num_visual), np.int64)
        feeds = {
            "input_ids": input_ids.astype(np.int64),
            "attention_mask": attention_mask.astype(np.int64),
            "position_ids": self.positions(attention_mask, num_new, num_visual),
            "visual_attention_mask": visual_mask,
        }
        feeds |= zip((spec.name for spec in self.past_inputs), past, strict=True)
        feeds |= zip(self.visual_names, visual, strict=True)
        logits, *present = self._run("decoder", feeds)
        return logits, present

    def generate(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        visual: list[np.ndarray],
        max_new_tokens: int,
        eos_token_id: int | None = None,
        visual_mask: np.ndarray | None = None,
    ) -> np.ndarray:
        """Greedy decoding, as the reference model's `generate`."""
        logits, past = self.decode(input_ids, attention_mask, self.empty_kv(input_ids.shape[0]), visual, visual_mask)
        tokens = []
        for step in range(max_new_tokens):
            next_token = logits[:, -1].argmax(-1)[:, None]
            tokens.append(next_token)
            if step == max_new_tokens - 1 or (eos_token_id is not None and (next_token == eos_token_id).all()):
                break
            attention_mask = np.concatenate([attention_mask, np.ones_like(next_token)], axis=1)
            logits, past = self.decode(next_token, attention_mask, past, visual, visual_mask)
        return np.concatenate(tokens, axis=1)
