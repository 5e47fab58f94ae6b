"""The released task through every deployment of the demo's trained video model (demo_retrieval.py), side by side in
one run: the synthetic benchmark's held-out split (20 clips, about 130 queries) answered by `retrieve` on

  exact        the PyTorch reference (fp32), the ONNX export on ONNX Runtime and on onnxruntime-genai, vLLM's engine
  16-bit       the ONNX export in fp16 on ONNX Runtime
  quantized    int8 and int4 ONNX exports (`onnx --quantize`) on ONNX Runtime; w8a8 and w4a16 folders (`quantize`)
               on vLLM's CPU kernels
  broken       int4 exports with every matrix's scales a row off and with the first two layers exchanged, a w4a16
               folder with every matrix's scales a row off (tests/helpers/quantized.py: what no real tool writes)

each scored by `score` as VUE-TR scores (IoU: the area under the curve over 101 thresholds) against the truth and
against the reference's own answers (`score --against`), with how many answers are the reference's, text for text.

    python bench/retrieval_task.py                       # both families, about 8 minutes on 2 cores
    python bench/retrieval_task.py --family gemma2 --deployments torch,ort,int4
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from helpers.quantized import broken_export, corrupt  # noqa: E402

from dattn_export.demo_corpus import write_benchmark  # noqa: E402
from dattn_export.demo_retrieval import ANSWER_TOKENS, HELD_OUT_CLIPS, trained_weights, write_retrieval_checkpoint  # noqa: E402,E501

CLI = [sys.executable, "-m", "dattn_export"]
# name -> (what it is, the backend that answers, the folder it answers from); the reference first
DEPLOYMENTS = {
    "torch": ("PyTorch reference, fp32", "torch", "converted"),
    "ort": ("ONNX export, fp32", "ort", "onnx"),
    "genai": ("ONNX export on onnxruntime-genai", "genai", "onnx"),
    "vllm": ("vLLM, fp32", "vllm", "converted"),
    "fp16": ("ONNX export, fp16", "ort", "onnx-fp16"),
    "int8": ("ONNX export, int8 weights", "ort", "onnx-int8"),
    "int4": ("ONNX export, int4 weights", "ort", "onnx-int4"),
    "w8a8": ("compressed-tensors w8a8 on vLLM", "vllm", "w8a8"),
    "w4a16": ("compressed-tensors w4a16 on vLLM (bf16)", "vllm", "w4a16"),
    "int4 scales": ("BROKEN int4: every matrix's scales a row off", "ort", "int4-shift"),
    "int4 swap": ("BROKEN int4: layers 0 and 1 exchanged", "ort", "int4-swap"),
    "w4a16 scales": ("BROKEN w4a16: every matrix's scales a row off", "vllm", "w4a16-shift"),
}
# folder -> how it is made from the others: a CLI command, or a damage done to a copy
MADE = {
    "converted": ("convert", "checkpoint"),
    "onnx": ("onnx", "converted"),
    "onnx-fp16": ("onnx", "converted", "--dtype", "fp16"),
    "onnx-int8": ("onnx", "converted", "--quantize", "int8"),
    "onnx-int4": ("onnx", "converted", "--quantize", "int4"),
    "w8a8": ("quantize", "converted", "--scheme", "w8a8"),
    "w4a16": ("quantize", "converted", "--scheme", "w4a16", "--group-size", "32"),  # the tiny layers take 64 or 128
}
BROKEN = {"int4-shift": ("onnx-int4", "shift"), "int4-swap": ("onnx-int4", "swap"),
          "w4a16-shift": ("w4a16", "every matrix's scales a row off")}  # fmt: skip


def cli(*args) -> subprocess.CompletedProcess:
    run = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, args[:2]))}: exit {run.returncode}\n{run.stderr[-3000:]}")
    return run


def make(root: Path, folder: str) -> Path:
    """`root/folder`, made (with what it is made from) unless it is there."""
    path = root / folder
    if path.exists():
        return path
    if folder in BROKEN:
        source, damage = BROKEN[folder]
        if source.startswith("onnx"):
            return broken_export(make(root, source), path, damage)
        corrupt(shutil.copytree(make(root, source), path), damage, "w4a16")
        return path
    command, source, *options = MADE[folder]
    cli(command, make(root, source), "-o", path, *options)
    return path


def answered(root: Path, name: str, benchmark: Path) -> tuple[Path, float]:
    """The deployment's predictions file, and the seconds `retrieve` took (its process, loading included)."""
    _, backend, folder = DEPLOYMENTS[name]
    out = root / "predictions" / f"{name.replace(' ', '-')}.jsonl"
    out.parent.mkdir(exist_ok=True)
    folder, start = make(root, folder), time.perf_counter()
    cli("retrieve", folder, "--backend", backend, "--benchmark", benchmark, "--videos",
        benchmark.parent / "videos", "-o", out, "--max-new-tokens", ANSWER_TOKENS, "--force")  # fmt: skip
    return out, time.perf_counter() - start


def scored(predictions: Path, benchmark: Path, against: Path | None = None) -> float:
    options = ["--against", against] if against else []
    return json.loads(cli("score", predictions, "--gt", benchmark, "--json", *options).stdout)["overall"]["iou"]


def texts(predictions: Path) -> list[str]:
    return [json.loads(line)["text"] for line in predictions.read_text().splitlines()]


def family_rows(family: str, names: list[str], work: Path, benchmark: Path) -> list[tuple]:
    root = work / family
    write_retrieval_checkpoint(root / "checkpoint", family, trained_weights(family))
    reference, reference_seconds = answered(root, "torch", benchmark)
    truth_iou, wanted = scored(reference, benchmark), texts(reference)
    rows = []
    for name in names:
        out, seconds = answered(root, name, benchmark) if name != "torch" else (reference, reference_seconds)
        iou, got = scored(out, benchmark), texts(out)
        same = sum(a == b for a, b in zip(got, wanted))
        rows.append((family, name, iou, iou - truth_iou, scored(out, benchmark, reference), same, len(wanted), seconds))
        print(f"{family:8} {name:13} IoU {iou:.3f} ({iou - truth_iou:+.3f})  against the reference {rows[-1][4]:.3f}  "
              f"answers the reference's {same}/{len(wanted)}  {seconds:.0f} s", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=["mistral", "gemma2"], help="one family (default: both)")
    parser.add_argument("--deployments", default=",".join(DEPLOYMENTS), help="comma-separated, of: " +
                        ", ".join(DEPLOYMENTS))  # fmt: skip
    parser.add_argument("--work", type=Path, help="Folder for the models and predictions (default: a temporary one).")
    args = parser.parse_args()
    names = ["torch", *[n for n in args.deployments.split(",") if n != "torch"]]
    if unknown := set(names) - set(DEPLOYMENTS):
        parser.error(f"unknown deployments: {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        benchmark = write_benchmark(work / "held-out", "held-out", HELD_OUT_CLIPS)
        rows = [row for family in ([args.family] if args.family else ["mistral", "gemma2"])
                for row in family_rows(family, names, work, benchmark)]  # fmt: skip
    print("\n| family | deployment | IoU | vs the reference | IoU against the reference's answers | answers the "
          "reference's | retrieve's seconds |\n| --- | --- | ---: | ---: | ---: | ---: | ---: |")  # fmt: skip
    for family, name, iou, delta, against, same, count, seconds in rows:
        print(f"| {family} | {name}: {DEPLOYMENTS[name][0]} | {iou:.3f} | {delta:+.3f} | {against:.3f} | "
              f"{same}/{count} | {seconds:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
