"""Decoding speed of transformers' own `generate` (the published model's path: its loop, a DynamicCache, the context
carried in its keyword arguments) against `greedy` (the reference loop every backend is held to), side by side in one
run, on a picture and on a 60-frame video with its sound: the same inputs, the same number of new tokens (the end
token left out of both, so that every run decodes all of them), the best of 5 runs each.

    python bench/generate_speed.py                          # gemma2's demo shapes, 64 new tokens
    python bench/generate_speed.py --family mistral --tokens 128 --hidden 512 --layers 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from onnx_scaling import best_of  # noqa: E402

from dattn_export.checkpoints.source import load_model  # noqa: E402
from dattn_export.demo_model import write_demo_checkpoint, write_video  # noqa: E402
from dattn_export.modeling.processing_dattn import DAttnProcessor  # noqa: E402
from dattn_export.stages.convert import convert  # noqa: E402


def inputs_for(folder: Path, kind: str, work: Path):
    processor = DAttnProcessor.from_pretrained(folder, trust_remote_code=True)
    if kind == "video":
        frames = [np.random.default_rng(i).integers(0, 256, (48, 64, 3), np.uint8) for i in range(60)]
        write_video(work / "clip.mov", frames, 1, (np.sin(np.arange(16000 * 60) / 7.0) * 8000).astype(np.int16))
        medium = {"type": "video", "path": str(work / "clip.mov")}
    else:
        medium = {"type": "image", "path": str(folder.parent / "checkpoint" / "demo.png")}
    conversation = [{"role": "user", "content": [medium, {"type": "text", "text": "What happens here?"}]}]
    return processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="gemma2")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, help="a wider model than the demo's (its hidden size)")
    parser.add_argument("--layers", type=int, help="and its layers")
    args = parser.parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    print(f"{args.family}, {args.tokens} new tokens, best of 5 (seconds a token)")
    print(f"{'input':<8} {'greedy (reference loop)':>24} {'transformers generate':>22} {'ratio':>7}")
    for kind in ("image", "video"):
        sizes = {}
        if args.hidden:
            heads = args.hidden // 64
            sizes = {"hidden_size": args.hidden, "intermediate_size": 4 * args.hidden, "head_dim": 64,
                     "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4)}  # fmt: skip
        if args.layers:
            sizes["num_hidden_layers"] = args.layers
            if args.family == "gemma2":  # its layers alternate: a sliding window, then global
                sizes["layer_types"] = ["sliding_attention", "full_attention"] * (args.layers // 2)
        checkpoint = write_demo_checkpoint(work / kind / "checkpoint", args.family, video=kind == "video", **sizes)
        folder = convert(checkpoint, work / kind / "converted").out
        model, inputs = load_model(folder), inputs_for(folder, kind, work)
        model.generation_config.eos_token_id = None  # neither loop ends early: both decode every token
        with torch.no_grad():
            context, segments = model.model.encode_inputs(
                **{k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
            )
            text = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
            streams = {"context_key_values": context, "context_mask": segments}
            greedy = best_of(5, lambda: model.greedy(**text, **streams, max_new_tokens=args.tokens, eos_token_id=None))
            settings = dict(max_new_tokens=args.tokens, do_sample=False)
            generated = best_of(5, lambda: model.generate(**text, **streams, **settings))
            once = model.generate(**text, **streams, **settings)
            assert once.shape[1] - text["input_ids"].shape[1] == args.tokens
        print(f"{kind:<8} {greedy / args.tokens:>24.5f} {generated / args.tokens:>22.5f} {generated / greedy:>6.2f}x")


if __name__ == "__main__":
    main()
