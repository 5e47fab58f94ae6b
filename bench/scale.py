"""Every command on full-size checkpoints in the released layout, on this machine: wall time, peak anonymous memory
and bytes per command, and convert's time against its floor.

Two models, random weights written tensor by tensor in the released layout (ByteDance's Vidi: config.json with the
`mm_*` keys and tower folders it names, written offline with the towers' real configs; the towers' weights in the
checkpoint as `model.mm_vis.*` / `model.mm_aud.*`):
  vidi-7b     Vidi_7B as released, a video model: Mistral-7B (hidden 4096, 32 layers, 32/8 heads of 128, MLP 14336,
              vocab 32000), SigLIP so400m-patch14-384, Whisper large-v3, the conv-interpolate frame pool
  vidi1.5-9b  Gemma-2-9B (hidden 3584, 42 layers, 16/8 heads of 256, MLP 14336, vocab 256000, tied embeddings),
              SigLIP so400m-patch14-384 (the Vidi1.5 tree's image path, so that an image prompt runs at full size)
              and the Whisper large-v3 tower every released checkpoint carries
For each, in this order (outputs are deleted once measured, so the disk holds two copies of one model at a time:
about 50 GB at most for Vidi1.5-9B):
  floor      `cp -r` of the checkpoint folder then `sync`, and sha256 of its bytes on all cores, each after dropping
             nothing: the source is in the page cache for both, as it is for convert. The floor, max(the two), counts
             them as if they ran on separate resources; on a machine with few cores both are CPU work (the kernel's
             copy, the hash), so the same two jobs are also run at once (`cp -r` beside the hashing): what any
             converter that copies and hashes needs here, convert's second ratio
  convert    the safetensors checkpoint (5 GB shards), and the same model as Trainer `.bin` shards; timed with a
             `sync` after it, as cp is (each starts with nothing left to write back); floor and convert in turn,
             --rounds times (3), the medians reported
  info, verify, onnx --dtype fp16, onnx --quantize int4, validate --weights-only (the int4 export's weights against
  the converted folder), validate (the int4 export against the converted folder),
  generate (an image, or a video with its sound for the video model), analyze, push --dry-run, quantize w8a8 and
  w4a16 (compressed-tensors folders for vLLM and transformers), verify of each (every quantized matrix
  against the converted folder)
Each command runs in its own process; its peak anonymous memory (RssAnon of it and its children) is sampled every
20 ms (not the kernel's peak RSS: a child forked from this process starts with this process's, and the mapped
checkpoint's pages count in it). Prints one table per model and writes scale-MODELS.json beside this file.

    python bench/scale.py [--models vidi-7b vidi1.5-9b] [--commands ...] [--rounds 3] [--work DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dattn_export.checkpoints.source import model_shapes
from dattn_export.memory import AnonPeak

SIGLIP_SO400M = dict(
    model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
    num_attention_heads=16, image_size=384, patch_size=14, num_channels=3, hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6, vision_use_head=True,
)  # fmt: skip
SIGLIP_PROCESSOR = dict(
    image_processor_type="SiglipImageProcessor", do_resize=True, size={"height": 384, "width": 384}, resample=3,
    do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5] * 3, image_std=[0.5] * 3,
)  # fmt: skip
WHISPER_LARGE_V3 = dict(
    model_type="whisper", d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
    decoder_layers=32, decoder_attention_heads=20, decoder_ffn_dim=5120, num_mel_bins=128, max_source_positions=1500,
    max_target_positions=448, vocab_size=51866, activation_function="gelu", scale_embedding=False,
)  # fmt: skip
MODELS = {
    "vidi-7b": dict(
        model_type="dattn_mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=None,
        max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False, mm_input_type="video",
        mm_image_pool_size=8, mm_audio_pool_size=5, mm_time_interval=10000, mm_std=0.029,
    ),
    "vidi1.5-9b": dict(
        model_type="dattn_gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
        num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=8192, tie_word_embeddings=True, mm_input_type="image",
        mm_image_aspect_ratio="resize", mm_std=0.029,
    ),
}  # fmt: skip
# Vidi1.5-9B as a video model, as released (the GPU check's hour of video): space-to-depth frames, audio
MODELS["vidi1.5-9b-video"] = MODELS["vidi1.5-9b"] | dict(
    mm_input_type="video", mm_image_pool_size=2, mm_audio_pool_size=5, mm_time_interval=10000
)
BENCHED = ("vidi-7b", "vidi1.5-9b")  # the models `python bench/scale.py` measures unless told
SHARD = "5GB"
PROMPT = "USER: What happens here?\nASSISTANT:"


def model_config(name: str):
    from dattn_export.modeling.configuration_dattn import CONFIG_CLASSES
    from dattn_export.modeling.families import BY_MODEL_TYPE

    fields = dict(MODELS[name])
    model_type = fields.pop("model_type")
    if fields["mm_input_type"] == "video":
        fields |= dict(dattn_mode="dattn-sum", mm_pool_rule=BY_MODEL_TYPE[model_type].released_pool_rule)
    return CONFIG_CLASSES[model_type](
        **fields, vision_config=dict(SIGLIP_SO400M), audio_config=whisper_encoder(), pad_token_id=0, bos_token_id=1,
        eos_token_id=2, dtype="bfloat16",
    )  # fmt: skip


def whisper_encoder() -> dict:
    from dattn_export.checkpoints.towers import whisper_config

    return whisper_config(WHISPER_LARGE_V3)


class Filler:
    """Random bf16 weights without drawing 9 B random numbers: a 64 M-value block of N(0, 0.02), each tensor a
    stretch of it from its own offset (distinct tensors, finite values within fp16's range)."""

    def __init__(self, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.block = (torch.randn(1 << 26, generator=generator) * 0.02).to(torch.bfloat16)

    def __call__(self, name: str, shape: tuple[int, ...], out: torch.Tensor) -> torch.Tensor:
        count, start = math.prod(shape), int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % len(self.block)
        flat, done = out[: 2 * count].view(torch.bfloat16), 0
        while done < count:
            piece = self.block[start : start + count - done]
            flat[done : done + len(piece)] = piece
            done, start = done + len(piece), 0
        return flat.view(shape)


def write_checkpoint(name: str, folder: Path, layout: str) -> int:
    """The model in the released layout at `folder` (safetensors or Trainer .bin shards); returns its weight bytes."""
    from dattn_export.checkpoints.released import released_config
    from dattn_export.checkpoints.safetensors_writer import PlannedTensor, plan_shards, write_shards
    from dattn_export.checkpoints.source import model_shapes, tied_names
    from dattn_export.demo_model import build_tokenizer, save_tokenizer
    from dattn_export.stages.convert import parse_size

    config = model_config(name)
    shapes = {n: s for n, s in model_shapes(config).items() if n not in tied_names(config)}
    towers = folder.parent / "towers"
    vision, audio = towers / "siglip-so400m-patch14-384", towers / "whisper-large-v3"
    for tower, fields, processor in ((vision, SIGLIP_SO400M, SIGLIP_PROCESSOR), (audio, WHISPER_LARGE_V3, None)):
        tower.mkdir(parents=True, exist_ok=True)
        (tower / "config.json").write_text(json.dumps(fields, indent=2))
        if processor:
            (tower / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    folder.mkdir(parents=True)
    fill = Filler()
    planned = [
        PlannedTensor(n, torch.bfloat16, s, produce=lambda buffer, n=n, s=s: fill(n, s, buffer))
        for n, s in shapes.items()
    ]
    shards = plan_shards(planned, parse_size(SHARD))
    if layout == "safetensors":
        write_shards(shards, folder)
    else:  # what the Trainer's save_model writes with safe_serialization off
        weight_map, buffer = {}, torch.empty(max(t.nbytes for t in planned), dtype=torch.uint8)
        count = len(shards)
        for k, shard in enumerate(shards, 1):
            file = f"pytorch_model-{k:05d}-of-{count:05d}.bin"
            torch.save({t.name: t.produce(buffer).clone() for t in shard}, folder / file)
            weight_map |= dict.fromkeys((t.name for t in shard), file)
        index = {"metadata": {"total_size": sum(t.nbytes for t in planned)}, "weight_map": weight_map}
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(released_config(config, str(vision), str(audio)), indent=2))
    save_tokenizer(build_tokenizer(min(config.vocab_size, 4096), config.family.name), folder)
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return sum(t.nbytes for t in planned)


def demo_media(folder: Path) -> dict:
    """A picture and a 4-second video with a sound track, the demo's."""
    from dattn_export.demo_model import demo_audio, demo_frames, demo_image, write_video

    demo_image(384).save(folder / "picture.png")
    frames = demo_frames(8, 384)
    write_video(folder / "clip.mov", frames, 2, demo_audio(4.0))
    return {"image": folder / "picture.png", "video": folder / "clip.mov"}


def measure(command: list, what: str, cwd: Path | None = None) -> dict:
    """Runs one command, prints and returns its wall time, peak anonymous memory and exit code."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:  # a pipe nobody reads blocks it
        process = subprocess.Popen([str(c) for c in command], stdout=stdout, stderr=stderr, cwd=cwd)
        sampler = AnonPeak(process.pid)
        sampler.start()
        _, status = os.waitpid(process.pid, 0)
        peak = sampler.stop()
        out, err = (f.seek(0) or f.read().decode(errors="replace") for f in (stdout, stderr))
    row = dict(
        command=what,
        seconds=time.perf_counter() - start,
        anon_gib=peak / 2**30,
        code=os.waitstatus_to_exitcode(status),
        last_line=(err.strip().splitlines() or out.strip().splitlines() or [""])[-1][:160],
    )
    print(
        f"  {what:42s} {row['seconds']:8.1f} s  anon {row['anon_gib']:6.2f} GiB  "
        f"exit {row['code']}" + (f"  {row['last_line']}" if row["code"] else ""),
        flush=True,
    )
    return row


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def sha256_all_cores(folder: Path) -> float:
    """Seconds to sha256 every file of the folder, one file per core at a time (hashlib releases the GIL)."""

    def digest(path: Path) -> None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)

    start = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(digest, sorted(p for p in folder.iterdir() if p.is_file())))
    return time.perf_counter() - start


def copy_seconds(folder: Path, work: Path, beside=None) -> float:
    """Seconds of `cp -r` of the folder then `sync` (with `beside()` run meanwhile, when given)."""
    copy = work / "cp-copy"
    subprocess.run(["sync"], check=True)  # earlier writes are not cp's
    start = time.perf_counter()
    process = subprocess.Popen(["cp", "-r", folder, copy])
    if beside:
        beside()
    if process.wait():
        raise subprocess.CalledProcessError(process.returncode, process.args)
    subprocess.run(["sync"], check=True)
    seconds = time.perf_counter() - start
    shutil.rmtree(copy)
    return seconds


def floor(folder: Path, work: Path) -> dict:
    """convert's floor for this folder: max(cp -r of it, synced; sha256 of its bytes on all cores); and `both`, the
    two jobs run at once."""
    cp_seconds, hash_seconds = copy_seconds(folder, work), sha256_all_cores(folder)
    both = copy_seconds(folder, work, beside=lambda: sha256_all_cores(folder))
    return dict(cp=cp_seconds, sha256=hash_seconds, floor=max(cp_seconds, hash_seconds), both=both)


def convert_against_floor(checkpoint: Path, out: Path, work: Path, layout: str, rounds: int) -> dict:
    """The floor then convert, `rounds` times in turn (cp of the same bytes took 12.8 to 22.2 s in different runs
    here: the page cache's state); the median of each round's ratio, and of each time. The disk holds two copies of
    the checkpoint at most: the converted folder is deleted before each floor's copy."""
    results = []
    for _ in range(rounds):
        shutil.rmtree(out, ignore_errors=True)
        limits = floor(checkpoint, work)
        subprocess.run(["sync"], check=True)  # the floor's copy is not convert's to write back
        row = measure(cli("convert", checkpoint, "-o", out, "--force"), f"convert ({layout} shards)")
        start = time.perf_counter()
        subprocess.run(["sync"], check=True)  # its output on the disk, as cp's is in the floor
        row["seconds"] += time.perf_counter() - start
        row |= limits | dict(ratio=row["seconds"] / limits["floor"], ratio_both=row["seconds"] / limits["both"])
        print(
            f"  floor: cp -r {row['cp']:.1f} s, sha256 on all cores {row['sha256']:.1f} s, both at once "
            f"{row['both']:.1f} s; convert + sync {row['seconds']:.1f} s; convert / floor {row['ratio']:.2f}, "
            f"/ both at once {row['ratio_both']:.2f}",
            flush=True,
        )
        results.append(row)
    keys = ("seconds", "cp", "sha256", "both", "ratio", "ratio_both")
    median = {key: statistics.median(r[key] for r in results) for key in keys}
    rounds = dict(rounds=[r["ratio"] for r in results], rounds_both=[r["ratio_both"] for r in results])
    return results[-1] | median | rounds | dict(bytes=folder_bytes(out))


def cli(*args) -> list:
    return [sys.executable, "-m", "dattn_export", *args]


COMMANDS = [
    "convert", "info", "verify", "onnx fp16", "validate fp16", "onnx int4", "weight check int4", "validate int4",
    "generate", "analyze", "push --dry-run", "quantize w8a8", "verify w8a8", "quantize w4a16",
    "verify w4a16",
]  # fmt: skip


def run_model(name: str, work: Path, commands: list[str], rounds: int) -> list[dict]:
    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    media = demo_media(root)
    config = model_config(name)
    rows = []
    for layout in ("bin", "safetensors") if "convert" in commands else ("safetensors",):  # .bin first, then deleted
        checkpoint = root / f"checkpoint-{layout}"
        shutil.rmtree(root / "converted", ignore_errors=True)  # two copies of the model on the disk at most
        start = time.perf_counter()
        weight_bytes = write_checkpoint(name, checkpoint, layout)
        print(f"{name}: wrote {weight_bytes / 1e9:.1f} GB of {layout} shards in {time.perf_counter() - start:.0f} s")
        out = root / "converted"
        if "convert" not in commands:  # only what the other commands need
            measure(cli("convert", checkpoint, "-o", out, "--force"), f"convert ({layout} shards)")
            break
        row = convert_against_floor(checkpoint, out, root, layout, rounds)
        rows.append(row)
        if layout == "bin":
            shutil.rmtree(checkpoint)
    converted = root / "converted"
    media_args = [f"--{config.modality}", media[config.modality]]

    def run(command: str, *args, output: Path | None = None) -> None:
        if command in commands:
            rows.append(measure(cli(*args), command))
            rows[-1]["bytes"] = folder_bytes(output) if output and output.exists() else 0

    run("info", "info", checkpoint)
    run("verify", "verify", converted, "--against", checkpoint)
    shutil.rmtree(checkpoint)  # the rest reads the converted folder
    fp16, int4 = root / "onnx-fp16", root / "onnx-int4"
    run("onnx fp16", "onnx", converted, "-o", fp16, "--force", "--dtype", "fp16", output=fp16)
    run("validate fp16", "validate", fp16, "--max-new-tokens", "2", *media_args)  # refused on this machine: too big
    shutil.rmtree(fp16, ignore_errors=True)
    run("onnx int4", "onnx", converted, "-o", int4, "--force", "--quantize", "int4", output=int4)
    run("weight check int4", "validate", int4, "--against", converted, "--weights-only")
    run("validate int4", "validate", int4, "--against", converted, "--max-new-tokens", "4", *media_args)
    run("generate", "generate", converted, "--raw-prompt", PROMPT, "--max-new-tokens", "8", *media_args)
    analysis = ("analyze", converted, "--raw-prompt", f"<image> {PROMPT}", "-o", root / "analysis", "--force")
    run("analyze", *analysis, *media_args)
    run("push --dry-run", "push", converted, "--repo-id", "me/scale-test", "--dry-run")
    for scheme in ("w8a8", "w4a16"):  # compressed-tensors folders for vLLM and transformers (one on the disk at a time)
        quantized = root / f"converted-{scheme}"
        run(
            f"quantize {scheme}",
            "quantize",
            converted,
            "-o",
            quantized,
            "--scheme",
            scheme,
            "--force",
            output=quantized,
        )
        run(f"verify {scheme}", "verify", quantized)
        shutil.rmtree(quantized, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(BENCHED))
    parser.add_argument("--work", type=Path, default=Path("/tmp/dattn-scale"))
    parser.add_argument("--commands", nargs="+", choices=COMMANDS, default=COMMANDS)
    parser.add_argument("--rounds", type=int, default=3, help="convert and its floor in turn, this many times")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.models:
        parameters = sum(math.prod(shape) for shape in model_shapes(model_config(name)).values())
        print(f"== {name}: {parameters / 1e9:.2f} B parameters", flush=True)
        results[name] = run_model(name, args.work, args.commands, args.rounds)
        print(
            f"\n| {name} | wall (median) | peak anonymous | exit | bytes | / floor (median; rounds) "
            "| / both at once (median; rounds) |"
        )
        print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
        for r in results[name]:
            size = f"{r['bytes'] / 1e9:.1f} GB" if r.get("bytes") else ""
            ratios = [
                f"{r[key]:.2f}x ({', '.join(f'{x:.2f}' for x in r[rounds])})" if key in r else ""
                for key, rounds in (("ratio", "rounds"), ("ratio_both", "rounds_both"))
            ]
            print(
                f"| {r['command']} | {r['seconds']:.0f} s | {r['anon_gib']:.2f} GiB | {r['code']} | {size} "
                f"| {' | '.join(ratios)} |"
            )
    (Path(__file__).parent / f"scale-{'-'.join(args.models)}.json").write_text(
        json.dumps(results, indent=2, default=str)
    )


if __name__ == "__main__":
    main()
