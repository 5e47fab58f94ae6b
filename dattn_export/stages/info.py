"""`info`: what a checkpoint is, without reading its tensor data."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..artifacts import dtype_name
from ..checkpoints import open_checkpoint
from ..checkpoints.names import audio_tower_role, canonical_name, parameter_counts
from ..checkpoints.source import audit
from ..errors import InputError


@dataclass
class CheckpointInfo:
    path: str
    layout: str
    notes: list[str]
    tensors: int
    bytes: int
    dtypes: dict[str, int]  # tensors per dtype
    parameters: dict[str, int]  # per component
    architecture: dict | None = None  # None when the config cannot be read
    problems: list[str] = field(default_factory=list)


def describe(path: Path, base: Path | None = None, vision_heads: int | None = None) -> CheckpointInfo:
    reader = open_checkpoint(path, base)
    tensors = reader.tensors
    report = CheckpointInfo(
        path=str(path),
        layout=reader.layout,
        notes=reader.notes,
        tensors=len(tensors),
        bytes=sum(t.nbytes for t in tensors.values()),
        dtypes=dict(Counter(dtype_name(t.dtype) for t in tensors.values()).most_common()),
        parameters=parameter_counts({canonical_name(n): tuple(t.shape) for n, t in tensors.items()}),
    )
    try:
        source = audit(reader, vision_heads)
    except InputError as e:
        report.problems.append(str(e))
        return report
    c = source.config
    report.architecture = {
        "model_type": c.model_type,
        "dattn_mode": c.dattn_mode,
        "diagonal": c.use_diagonal,
        "debias": c.use_debias,
        "merge": c.merge,
        "layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size,
        "heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "vision_tower": c.mm_vision_tower,
        "vision_config": f"{c.vision_config['model_type']} "
        f"{c.vision_config['hidden_size']}x{c.vision_config['num_hidden_layers']} layers, "
        f"{c.vision_config['image_size']}px / patch {c.vision_config['patch_size']} ({source.vision_origin})",
        "audio_tower": "none"
        if c.audio_config is None
        else f"{c.mm_audio_tower}: Whisper encoder {c.audio_config['d_model']}x{c.audio_config['encoder_layers']} "
        f"layers, {audio_tower_role(c)} ({source.audio_origin})",
        "input": c.mm_input_type,
        **{fact: value for stream in c.streams for fact, value in stream.facts(c).items()},
        "sliding_window": "none" if c.text_window is None else f"{c.text_window} ({c.window_rule} rule)",
        "stream_scaling": c.mm_scale_streams,
        "mask_empty_images": c.mm_mask_empty_images,
        "inferred": c.dattn_inferred or {},
        "wings": f"rank {c.wings_rank} learners in layers {c.wings_layer_indices}" if c.wings_rank else "none",
    }
    report.problems = [str(p) for p in source.problems]
    return report
