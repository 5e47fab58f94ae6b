"""The GPU check's rows for the PyTorch model as `generate --device cuda` runs it: 16 bits, the Triton kernel as every
attention, decoding from a static cache replayed from a CUDA graph (runtime/static_decode.py).

  bounds   what this GPU can do, measured here: a bf16 matrix product's rate (the FLOP bound's peak) and a large
           copy's rate (read + write bytes a second: the memory-bandwidth bound's)
  decode   Vidi-7B's shape (Mistral 7B, 32 layers, bf16, random weights) decoding after 16k and 64k context tokens:
           ms a token beside its bound, the bytes a step reads (the LLM's weights and every layer's context and text
           K/V, once) over the copy rate; a row passes within DECODE_SLOWER x the bound
  validate `validate --backend torch --device cuda` (stages/validate_model.py) on both demo models and a model of
           Mistral-7B's width: the deployed model against its fp32 run on the same GPU
  hour     `generate --device cuda --video` of an hour of video (3600 frames at 1 frame/s and its sound track) at
           Vidi-7B's and Vidi1.5-9B's shapes, random weights written as bench/scale.py writes them: the file's
           decode, the towers and context stream, the prompt (time to the first token), decode tokens a second, peak
           GPU memory
In the dry run, the same code at tiny shapes on the CPU (no CUDA graph)."""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

DECODE_SLOWER = 1.5  # a decode step's time against its bandwidth bound, on a GPU: at most this many times it
PREFILL_SHARE = 0.65  # a prefill's rate against the measured matmul peak, on a GPU: at least this share of it
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Deployment:
    """The shapes of this part: the GPU's (the released models'), or the dry run's (tiny)."""

    decode_model: dict  # tiny_config overrides of the model decoding is timed on
    decode_contexts: tuple[int, ...]
    decode_steps: int
    matmul: int  # the side of the square bf16 product the peak is measured on
    copy_bytes: int
    hour_models: tuple[str, ...]  # bench/scale.py's MODELS, or the demo families in the dry run
    hour_seconds: int


# tiny_config overrides: Mistral-7B's width (Vidi-7B's LLM), and a tiny model of the same kinds for the dry run
MISTRAL_7B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=32000,
)
TINY = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    num_hidden_layers=2, vocab_size=512,
)  # fmt: skip

GPU = Deployment(
    decode_model=MISTRAL_7B | {"num_hidden_layers": 32},
    decode_contexts=(16384, 65536),
    decode_steps=64,
    matmul=8192,
    copy_bytes=4 << 30,
    hour_models=("vidi-7b", "vidi1.5-9b-video"),
    hour_seconds=3600,
)
DRY = Deployment(
    decode_model=TINY,
    decode_contexts=(40,),
    decode_steps=4,
    matmul=256,
    copy_bytes=64 << 20,
    hour_models=("mistral", "gemma2"),
    hour_seconds=12,
)


def synchronize(device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def bounds(device: str, sizes: Deployment) -> dict:
    """The measured peaks: bf16 matmul TFLOP/s and copy GB/s (read + written), each the best of a few runs."""
    return measured_bounds(device, sizes.matmul, sizes.copy_bytes)


@cache
def measured_bounds(device: str, side: int, copy_bytes: int) -> dict:
    import torch

    a = torch.randn(side, side, device=device, dtype=torch.bfloat16)
    source = torch.empty(copy_bytes // 2, device=device, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    best_matmul = best_copy = float("inf")
    for _ in range(5):
        start = synchronize(device)
        a @ a
        best_matmul = min(best_matmul, synchronize(device) - start)
        start = synchronize(device)
        target.copy_(source)
        best_copy = min(best_copy, synchronize(device) - start)
    return dict(matmul_tflops=2 * side**3 / best_matmul / 1e12, copy_gbs=2 * copy_bytes / best_copy / 1e9)


def bounds_rows(sizes: Deployment, device: str) -> list[dict]:
    return [dict(**bounds(device, sizes), device=device)]


def random_model(overrides: dict, device: str):
    import torch

    from dattn_export.modeling.modeling_dattn import MODEL_CLASSES
    from dattn_export.presets import randomize_weights, tiny_config

    config = tiny_config("mistral", **overrides)
    with torch.device(device):
        model = MODEL_CLASSES[config.model_type](config)
    return randomize_weights(model.eval(), seed=1).to(torch.bfloat16)


def step_bytes(model, context: int, text: int) -> int:
    """What a decode step reads once: the LLM's weights (not the towers', nor more than a row of the embedding
    table) and every layer's context and text K/V."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                  if not name.startswith(("model.mm_", "model.embed_tokens")))  # fmt: skip
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2  # bf16 K and V
    return weights + per_token * (context + text)


def decode_rows(sizes: Deployment, device: str) -> list[dict]:
    """ms a greedy token after N context tokens, against the bandwidth bound."""
    import torch

    from dattn_export.plugins.torch_op import model_op
    from dattn_export.runtime.static_decode import static_generate

    model, peak = random_model(sizes.decode_model, device), bounds(device, sizes)
    config, rows = model.config, []
    ids = torch.randint(3, config.vocab_size, (1, 64), device=device)
    for context in sizes.decode_contexts:
        kv = (1, config.num_key_value_heads, context, config.head_dim)
        random = lambda: torch.randn(kv, device=device, dtype=torch.bfloat16)
        keys = [(random(), random()) for _ in range(config.num_hidden_layers)]
        mask = torch.ones(1, context, dtype=torch.bool, device=device)
        decoded = static_generate(model, ids, sizes.decode_steps + 1, context_key_values=keys, context_mask=mask,
                                  op=model_op, cuda_graph=device == "cuda")  # fmt: skip
        ms = 1e3 * decoded.seconds["steps"] / decoded.steps
        bound = 1e3 * step_bytes(model, context, ids.shape[1] + decoded.steps) / (peak["copy_gbs"] * 1e9)
        rows.append(dict(model=f"Mistral, hidden {config.hidden_size}, {config.num_hidden_layers} layers, bf16",
                         context_tokens=context, ms_per_token=ms, bound_ms=bound, vs_bound=ms / bound,
                         capture_s=decoded.seconds["capture"],
                         passed=device != "cuda" or ms <= DECODE_SLOWER * bound))  # fmt: skip
        del keys
    return rows


def validate_rows(sizes: Deployment, device: str, wide: dict) -> list[dict]:
    """validate --backend torch --device cuda on the demo models and one of Mistral-7B's width."""
    from dattn_export.demo_model import write_demo_checkpoint
    from dattn_export.stages.validate_model import validate_model

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, family, overrides in (("demo (Mistral)", "mistral", {}), ("demo (Gemma 2)", "gemma2", {}),
                                        (f"Mistral, hidden {wide['hidden_size']}", "mistral", wide)):  # fmt: skip
            checkpoint = write_demo_checkpoint(Path(folder) / name.split()[0] / family, family, **overrides)
            report = validate_model(checkpoint, device, steps=16)
            logits = [c for c in report.comparisons if c.output.startswith("logits")]
            rows.append(dict(model=name, dtype=report.dtype, logits_max_abs=max(c.max_abs for c in logits),
                             tolerance=report.tolerance, tokens_agree=report.agreement,
                             tokens=len(report.reference_tokens), passed=report.passed))  # fmt: skip
    return rows


def hour_video(path: Path, seconds: int) -> Path:
    """A QuickTime file of `seconds` 1 frame/s frames (64 x 48, each its own colour) and a sine sound track as
    long (16 kHz mono)."""
    import numpy as np

    from dattn_export.demo_model import write_video

    frames = [np.full((48, 64, 3), (i * 7 % 256, i * 13 % 256, 90), np.uint8) for i in range(seconds)]
    samples = (np.sin(np.arange(16000 * seconds) * 0.05) * 8000).astype(np.int16)
    write_video(path, frames, 1, samples)
    return path


def hour_checkpoint(name: str, folder: Path) -> Path:
    """The model `name` written to `folder`: bench/scale.py's full-size writer on a GPU, the demo's in the dry run."""
    import sys

    from dattn_export.demo_model import write_demo_checkpoint

    if name in ("mistral", "gemma2"):
        return write_demo_checkpoint(folder / "checkpoint", name, video=True)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from scale import write_checkpoint
    finally:
        sys.path.pop(0)
    write_checkpoint(name, folder / "checkpoint", "safetensors")
    return folder / "checkpoint"


def hour_rows(sizes: Deployment, device: str) -> list[dict]:
    """An hour of video answered on the GPU: its stages' seconds, decode tokens a second and peak GPU memory."""
    import torch

    from dattn_export.checkpoints.source import build_model, open_source
    from dattn_export.media import context_tokens, decode_media, encode_media
    from dattn_export.media_options import Media
    from dattn_export.modeling.marked_prompts import prompt_ids
    from dattn_export.plugins.torch_op import model_op
    from dattn_export.processing import load_processor
    from dattn_export.runtime.static_decode import static_generate
    from dattn_export.stages.generate import gpu_dtype

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        video = hour_video(Path(folder) / "hour.mov", sizes.hour_seconds)
        for name in sizes.hour_models:
            work = Path(folder) / name
            checkpoint = hour_checkpoint(name, work)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            source = open_source(checkpoint)
            start = synchronize(device)
            model = build_model(source, gpu_dtype(source), device=device)
            loaded = synchronize(device)
            processor = load_processor(checkpoint, source.config)
            decoded = decode_media(Media(video=video), processor)
            read = synchronize(device)
            streams = encode_media(model, processor, decoded, {})
            encoded = synchronize(device)
            tokenizer = processor.tokenizer
            prompt = "USER: <image>\nDuring which time segments in the video can we see a clock?\nASSISTANT:"
            ids = torch.tensor([prompt_ids(tokenizer, prompt)], device=device)
            answer = static_generate(model, ids, 33, op=model_op, cuda_graph=device == "cuda", **streams)
            visual, audio = context_tokens(source.config, streams["context_mask"].cpu())
            peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
            rows.append(dict(model=name, frames=len(decoded.frames), visual_tokens=visual, audio_tokens=audio,
                             load_s=loaded - start, decode_file_s=read - loaded, towers_and_context_s=encoded - read,
                             prompt_s=answer.seconds["prefill"],
                             first_token_s=encoded - loaded + answer.seconds["prefill"],
                             tokens_per_s=answer.steps / answer.seconds["steps"] if answer.steps else 0.0,
                             peak_gpu_gib=peak, passed=True))  # fmt: skip
            del model, streams
            shutil.rmtree(work)  # a full-size checkpoint at a time on the machine's disk
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows
