"""D-Attn vs S-Attn ONNX exports on ONNX Runtime CPU (2 threads) as the image grows.

One random mid-size config (hidden 1024, 8 layers, 16 heads, 8 KV heads, vocab 32000, fp32), exported twice:
`dattn` (diagonal V2V, debiased T2V, alpha merge) with the fused attention op, and `sattn` (conventional
attention) as a plain export (standard ONNX ops), as the baseline a user would otherwise ship. At |V| = 576, 2304,
9216 visual tokens and 64 text tokens each measurement runs in its own process:
  prefill      context_kv.onnx on the image + decoder.onnx on the prompt
  2nd prompt   decoder.onnx on another prompt, the image's visual K/V reused (cached)
  decode step  decoder.onnx on one token with 64 past tokens
and its peak RSS is read from the kernel. Prints the table and writes onnx_scaling.png.

D-Attn's prefill is mostly the visual stream's matrix products (k/v projections, o_proj, MLP per visual token).
The same run times each of those products alone on ORT; their sum plus the decoder's time on the prompt is a
floor for the prefill on this CPU, and the bench prints it with the S-Attn/D-Attn ratio it would allow.

Targets (issue 5): t_prefill(9216) / t_prefill(2304) <= 4.5; D-Attn >= 2.5x faster than S-Attn at 2304;
|V| = 9216 under 4 GB RSS; 2nd prompt >= 10x faster than the first at 9216; decode t(9216)/t(576) <= 3.0.

    pip install matplotlib && python bench/onnx_scaling.py

Long video (`--long-video`, issue 17): the same mid-size decoder as a video model (Vidi_7B's layout: frames through
a tiny SigLIP, 49 tokens a frame; audio through a tiny Whisper; text attends to each stream with its own softmax),
exported with `dattn-export onnx`. At 4k, 16k and 64k context tokens (3/4 frames, 1/4 audio), each in its own
process: the time to build the context caches (vision.onnx and audio.onnx part by part, context_kv into
preallocated caches), a decode step's time (16-token prompt, then one token) and the peak RSS after each; the
caches' own bytes are subtracted. Target: peak RSS beyond the caches within 10% from 4k to 64k.

    python bench/onnx_scaling.py --long-video
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VISUAL_TOKENS = (576, 2304, 9216)
TEXT_TOKENS = 64
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 1024, 4096, 16, 8, 64, 8
MEMORY_CAP = 20 << 30  # a measurement past this fails cleanly (S-Attn's |V|^2 logits) instead of swapping


def write_checkpoint(mode: str, work: Path, layers: int = 8) -> tuple[Path, int]:
    """The random mid-size checkpoint; returns its folder and its weights' size in bytes. `mode` video: a video
    model (the released Vidi_7B's layout) with tiny towers, 49 tokens a frame, 15 audio tokens a 30 s chunk."""
    from safetensors.torch import save_file

    from dattn_export.checkpoints.source import saved_state_dict
    from dattn_export.demo_model import write_demo_checkpoint
    from dattn_export.modeling.modeling_dattn import MODEL_CLASSES
    from dattn_export.presets import randomize_weights, tiny_config

    config = tiny_config(
        "mistral",
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=32000,
        **(dict(video=True, mm_image_pool_size=7) if mode == "video" else dict(dattn_mode=mode)),
    )
    model = randomize_weights(MODEL_CLASSES[config.model_type](config).eval())
    checkpoint = write_demo_checkpoint(work / f"{mode}-{layers}-checkpoint", video=mode == "video")
    for shard in checkpoint.glob("model*.safetensors*"):
        shard.unlink()
    tensors = saved_state_dict(model)
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(checkpoint)
    return checkpoint, sum(t.numel() * t.element_size() for t in tensors.values())


CONTEXT_TOKENS = (4096, 16384, 65536)
VIDEO_PROMPT_TOKENS = 16


def measure_video(folder: Path, context_tokens: int) -> dict:
    """Runs in its own process: a video's context caches at `context_tokens` (3/4 frames, 1/4 audio), then a
    decode step; peak RSS after each (the kernel's high-water mark, this process's own)."""
    from dattn_export.runtime.ort import OrtModel

    runtime = OrtModel(folder, threads=2)
    model, rng = runtime.manifest.model, np.random.default_rng(0)
    size = model.image_size
    frames = rng.standard_normal((3 * context_tokens // 4 // model.tokens_per_frame, 3, size, size), np.float32)
    audio_session = runtime.sessions["audio"].get_inputs()[0]
    bins, chunk_frames = audio_session.shape[1], audio_session.shape[2]
    per_chunk = chunk_frames // model.mel_frames_per_audio_token
    chunks = -(-(context_tokens // 4) // per_chunk)
    features = rng.standard_normal((chunks, bins, chunk_frames), np.float32)
    start = time.perf_counter()
    caches, mask = runtime.encode_streams(
        {"frames": frames, "audio": (features, context_tokens // 4 * model.mel_frames_per_audio_token)}
    )
    build_s = time.perf_counter() - start
    build_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    prompt = rng.integers(3, 32000, (1, VIDEO_PROMPT_TOKENS))
    _, past = runtime.decode(prompt, np.ones(prompt.shape, np.int64), runtime.empty_kv(1), caches, mask)
    step_mask = np.ones((1, VIDEO_PROMPT_TOKENS + 1), np.int64)
    decode_s = best_of(5, lambda: runtime.decode(np.array([[5]]), step_mask, past, caches, mask))
    return {
        "tokens": int(mask.shape[1]),
        "frames": len(frames),
        "audio_tokens": int((mask == 2).sum()),
        "build_s": build_s,
        "decode_ms": 1000 * decode_s,
        "cache_bytes": sum(c.nbytes for c in caches),
        "build_rss": build_rss,
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def long_video(work: Path) -> None:
    print("exporting the mid-size video model ...", file=sys.stderr, flush=True)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        checkpoint, _ = pool.apply(write_checkpoint, ("video", work))
    seconds, _ = export(checkpoint, work / "video-onnx", "fused")
    print(f"export: {seconds:.1f} s")
    rows = {}
    for tokens in CONTEXT_TOKENS:
        print(f"  context {tokens} ...", file=sys.stderr, flush=True)
        child = subprocess.run(
            [sys.executable, __file__, "--measure-video", str(work / "video-onnx"), str(tokens)],
            capture_output=True,
            text=True,
        )
        if child.returncode != 0:
            sys.exit(f"context {tokens} failed: {child.stderr[-2000:]}")
        rows[tokens] = json.loads(child.stdout.strip().splitlines()[-1])
    print(
        f"{'context':>8}{'frames':>8}{'audio':>7}{'build caches s':>16}{'decode ms':>11}{'caches':>9}"
        f"{'peak RSS':>10}{'beyond caches':>15}"
    )
    for r in rows.values():
        print(
            f"{r['tokens']:>8}{r['frames']:>8}{r['audio_tokens']:>7}{r['build_s']:>16.1f}{r['decode_ms']:>11.1f}"
            f"{r['cache_bytes'] / 1e9:>8.2f}G{r['rss'] / 1e9:>9.2f}G{(r['rss'] - r['cache_bytes']) / 1e9:>14.2f}G"
        )
    small, large = rows[CONTEXT_TOKENS[0]], rows[CONTEXT_TOKENS[-1]]
    for name, key in (("building the caches", "build_rss"), ("after a decode step", "rss")):
        ratio = (large[key] - large["cache_bytes"]) / (small[key] - small["cache_bytes"])
        print(f"peak RSS beyond the caches, {name}, 64k / 4k: {ratio:.3f}  {'ok' if ratio <= 1.10 else 'MISSED'}")


def export(checkpoint: Path, folder: Path, attention: str) -> tuple[float, int]:
    """`dattn-export onnx` as a user runs it: (seconds, peak RSS in bytes)."""
    start = time.perf_counter()
    child = subprocess.Popen(
        ["dattn-export", "onnx", str(checkpoint), "-o", str(folder), "--attention", attention],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=False,
    )
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"export of {checkpoint} failed")
    return time.perf_counter() - start, usage.ru_maxrss * 1024


def visual_products() -> dict[tuple[int, int], int]:
    """The visual stream's matrix products per visual token, {(in, out): count}: every layer projects k and v;
    every layer but the last (whose output nobody reads) also applies o_proj to the values (query heads of a KV
    head summed first: kv_dim -> hidden) and the MLP's gate, up and down."""
    kv_dim = KV_HEADS * HEAD_DIM
    return {
        (HIDDEN, kv_dim): 2 * LAYERS,
        (kv_dim, HIDDEN): LAYERS - 1,
        (HIDDEN, INTERMEDIATE): 2 * (LAYERS - 1),
        (INTERMEDIATE, HIDDEN): LAYERS - 1,
    }


def products_seconds(num_context: int) -> float:
    """The visual stream's products at `num_context` tokens, each timed alone on ONNX Runtime CPU (2 threads, fp32,
    best of 5): a floor for any graph that computes them there, whatever else it does."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    total = 0.0
    for (k, n), count in visual_products().items():
        weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n), dtype=np.float32), "w")
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])],
            "product",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, num_context, k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, num_context, n])],
            [weight],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        x = {"x": np.ones((1, num_context, k), np.float32)}
        session.run(None, x)
        total += count * best_of(5, lambda: session.run(None, x))
    return total


def best_of(runs: int, fn) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(folder: Path, num_context: int) -> dict:
    """Runs in its own process: prefill, cached second prompt and decode step at `num_context` visual tokens."""
    from dattn_export.runtime.ort import OrtModel

    runtime = OrtModel(folder, threads=2)
    rng = np.random.default_rng(0)
    hidden = runtime.manifest.model.hidden_size
    embeds = rng.standard_normal((1, num_context, hidden), dtype=np.float32)
    prompt = rng.integers(3, 32000, (1, TEXT_TOKENS))
    mask = np.ones((1, TEXT_TOKENS), np.int64)
    empty = runtime.empty_kv(1)
    visual = runtime.encode_context(embeds)  # warm-up
    state = {}

    def prefill():
        state["visual"] = runtime.encode_context(embeds)
        state["logits"], state["past"] = runtime.decode(prompt, mask, empty, state["visual"])

    prefill_s = best_of(2, prefill)
    other_prompt = rng.integers(3, 32000, (1, TEXT_TOKENS))
    cached_s = best_of(3, lambda: runtime.decode(other_prompt, mask, empty, visual))
    step_mask = np.ones((1, TEXT_TOKENS + 1), np.int64)
    token = np.array([[5]])
    decode_s = best_of(10, lambda: runtime.decode(token, step_mask, state["past"], visual))
    return {"prefill_s": prefill_s, "cached_prompt_s": cached_s, "decode_ms": 1000 * decode_s}


def measured(folder: Path, num_context: int) -> dict:
    """`measure` in a child process with a memory cap; adds its peak RSS (this process stays small, so the
    forked child's peak is its own), or the failure."""

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    child = subprocess.Popen(
        [sys.executable, __file__, "--measure", str(folder), str(num_context)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        preexec_fn=cap,
    )
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        return {"failed": f"exit {child.returncode} (memory cap {MEMORY_CAP >> 30} GB)", "rss": usage.ru_maxrss * 1024}
    return {**json.loads(out.decode().strip().splitlines()[-1]), "rss": usage.ru_maxrss * 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", nargs=2, metavar=("FOLDER", "VISUAL"), help=argparse.SUPPRESS)
    parser.add_argument("--measure-video", nargs=2, metavar=("FOLDER", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--long-video", action="store_true", help="Only the long-video measurements.")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=Path("onnx_scaling.png"))
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure[0]), int(args.measure[1]))))
        return
    if args.measure_video:
        print(json.dumps(measure_video(Path(args.measure_video[0]), int(args.measure_video[1]))))
        return
    work = Path(tempfile.mkdtemp(prefix="dattn-onnx-bench-", dir=args.workdir))
    if args.long_video:
        try:
            long_video(work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    results, exports = {}, []
    try:
        for mode, layers in (("dattn", 24), ("dattn", 8), ("sattn", 8)):  # 24 layers: export memory only
            print(f"exporting the {layers}-layer {mode} model ...", file=sys.stderr, flush=True)
            with multiprocessing.get_context("spawn").Pool(1) as pool:  # keeps torch and the model out of this process
                checkpoint, weight_bytes = pool.apply(write_checkpoint, (mode, work, layers))
            folder = work / f"{mode}-{layers}-onnx"
            seconds, rss = export(checkpoint, folder, "fused" if mode == "dattn" else "standard")
            exports.append((mode, layers, weight_bytes, rss))
            print(
                f"export ({mode}, {layers} layers): {seconds:.1f} s, peak RSS {rss / 1e9:.2f} GB = "
                f"{rss / weight_bytes:.2f} x the {weight_bytes / 1e9:.2f} GB of weights (target <= 1.5)"
            )
        for num_context in VISUAL_TOKENS:  # the two modes side by side at each size: the VM's speed drifts
            for mode in ("dattn", "sattn"):
                print(f"  {mode} |V|={num_context} ...", file=sys.stderr, flush=True)
                results[mode, num_context] = measured(work / f"{mode}-8-onnx", num_context)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # about 4 GB of checkpoints and graphs
    (_, _, big_weights, big_rss), (_, _, weights, rss) = exports[:2]
    per_byte = (big_rss - rss) / (big_weights - weights)
    print(
        f"export memory per weight byte (24 vs 8 layers): {per_byte:.2f}; "
        f"fixed part (interpreter, torch, transformers, the exporter): {(rss - weights * per_byte) / 1e9:.2f} GB"
    )
    report(results, products_seconds(2304), args.plot)


def report(results: dict, products_s: float, plot: Path) -> None:
    print(f"{'mode':<7}{'|V|':>6}{'prefill s':>11}{'2nd prompt s':>14}{'decode ms':>11}{'peak RSS':>10}")
    for (mode, num_context), r in sorted(results.items()):
        if "failed" in r:
            print(f"{mode:<7}{num_context:>6}  failed: {r['failed']}, peak RSS {r['rss'] / 1e9:.1f} GB")
            continue
        print(
            f"{mode:<7}{num_context:>6}{r['prefill_s']:>11.3f}{r['cached_prompt_s']:>14.4f}{r['decode_ms']:>11.1f}"
            f"{r['rss'] / 1e9:>9.2f}G"
        )
    d = {v: results["dattn", v] for v in VISUAL_TOKENS}
    s = results["sattn", 2304]
    checks = [
        ("prefill t(9216)/t(2304) <= 4.5", d[9216]["prefill_s"] / d[2304]["prefill_s"], 4.5, "<="),
        (
            "S-Attn / D-Attn prefill at 2304 >= 2.5",
            s["prefill_s"] / d[2304]["prefill_s"] if "failed" not in s else float("inf"),
            2.5,
            ">=",
        ),
        ("peak RSS at 9216 (GB) <= 4", d[9216]["rss"] / 1e9, 4.0, "<="),
        ("first / cached prompt at 9216 >= 10", d[9216]["prefill_s"] / d[9216]["cached_prompt_s"], 10.0, ">="),
        ("decode t(9216)/t(576) <= 3.0", d[9216]["decode_ms"] / d[576]["decode_ms"], 3.0, "<="),
    ]
    for name, value, bound, op in checks:
        ok = value <= bound if op == "<=" else value >= bound
        print(f"{name:<42}{value:>8.2f}  {'ok' if ok else 'MISSED'}")
    # the floor: the visual products alone, and the decoder as the cached prompt ran it (the same decoder work)
    floor = products_s + d[2304]["cached_prompt_s"]
    print(
        f"D-Attn prefill floor at 2304: {products_s:.2f} s of visual-stream products (each timed alone) + "
        f"{d[2304]['cached_prompt_s']:.2f} s decoder = {floor:.2f} s (measured {d[2304]['prefill_s']:.2f} s); "
        f"S-Attn / floor = {s['prefill_s'] / floor if 'failed' not in s else float('inf'):.2f}"
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("dattn", "o-"), ("sattn", "s--")):
        ok = [v for v in VISUAL_TOKENS if "failed" not in results[mode, v]]
        axes[0].plot(ok, [results[mode, v]["prefill_s"] for v in ok], style, label=mode)
        axes[1].plot(ok, [results[mode, v]["decode_ms"] for v in ok], style, label=mode)
    axes[0].set(xlabel="visual tokens |V|", ylabel="prefill (s)", title="prefill: image + 64-token prompt")
    axes[1].set(xlabel="visual tokens |V|", ylabel="decode step (ms)", title="decode step, 64 past tokens")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("ONNX Runtime CPU, 2 threads, fp32 (hidden 1024, 8 layers)")
    fig.tight_layout()
    fig.savefig(plot, dpi=110)
    print(f"plot: {plot}")


if __name__ == "__main__":
    main()
