"""The accuracy gate's figures: healthy and broken quantized exports of tiny models trained on two sets of questions
and answers (asked through the chat template, as the gate asks), two seeds each, every metric the gate judges (and
the plain agreement and top-5 overlap it does not), against its thresholds. These measurements chose the thresholds
in `dattn_export/stages/accuracy_gate.py`.

Healthy: int8 and int4 exports as `dattn-export onnx --quantize` writes them. Broken (int4): one matrix's scales
shifted a row (`shift-one`), every matrix's (`shift`), the first two layers' weights exchanged (`swap`). Each export
is validated on the gate's four prompts, 20 tokens each (80 positions).

    python bench/quantize_gate.py [--work DIR]        # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from helpers.builders import checkpoint_of  # noqa: E402
from helpers.quantized import CORPORA, broken_export, train  # noqa: E402

from dattn_export.artifacts import Scheme  # noqa: E402
from dattn_export.demo_model import write_demo_checkpoint  # noqa: E402
from dattn_export.stages import accuracy_gate  # noqa: E402
from dattn_export.stages.onnx_export import export_onnx  # noqa: E402
from dattn_export.stages.validate import validate  # noqa: E402

SEEDS = (0, 1)
DAMAGES = ("shift-one", "shift", "swap")


def plain_top5_overlap(reference: list[np.ndarray], quantized: list[np.ndarray]) -> float:
    ref, got = np.concatenate(reference), np.concatenate(quantized)
    top_ref, top_got = np.argsort(-ref, axis=-1)[:, :5], np.argsort(-got, axis=-1)[:, :5]
    return float(np.mean([len(set(a) & set(b)) / 5 for a, b in zip(top_ref, top_got)]))


def print_row(row: tuple, extra: str) -> None:
    """One export's gate figures as they come: (model, scheme, variant, GateResult, `extra`'s value)."""
    name, scheme, variant, g, value = row
    print(f"{name:10} {scheme:5} {variant:32} greedy mass {g.greedy_mass:.3f}  top-5 mass {g.top5_mass:.4f}  mean KL "
          f"{g.mean_kl:.4f}  ({'passed' if g.passed else 'FAILED'}; plain agreement {g.agreement:.3f}, {extra} "
          f"{value:.3f})", flush=True)  # fmt: skip


def print_table(rows: list[tuple], what: str, extra: str) -> None:
    print(f"\n| model | weights | {what} | greedy mass | top-5 mass | mean KL | gate | plain agreement | {extra}")
    print("| --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---:")
    for name, scheme, variant, g, value in rows:
        print(f"| {name} | {scheme} | {variant} | {g.greedy_mass:.3f} | {g.top5_mass:.4f} | {g.mean_kl:.4f} | "
              f"{'passed' if g.passed else 'FAILED'} | {g.agreement:.3f} | {value:.4f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="Folder for the checkpoints and exports (default: a temporary one).")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="quantize-gate-"))
    logits = {}  # the gate's inputs, kept for the plain top-5 overlap
    measured = accuracy_gate.gate

    def keeping(scheme, reference, quantized):
        logits["last"] = (reference, quantized)
        return measured(scheme, reference, quantized)

    accuracy_gate.gate = keeping
    rows = []
    for corpus, sentences in CORPORA.items():
        for seed in SEEDS:
            name = f"{corpus}-{seed}"
            base = write_demo_checkpoint(work / f"{name}-base", seed=seed)
            checkpoint = checkpoint_of(train(base, sentences, seed=seed), work / f"{name}-trained")
            for scheme in ("int8", "int4"):
                healthy = work / f"{name}-{scheme}"
                export_onnx(checkpoint, healthy, quantize=Scheme(scheme))
                variants = [("healthy", healthy)]
                if scheme == "int4":
                    variants += [(d, broken_export(healthy, work / f"{name}-{scheme}-{d}", d)) for d in DAMAGES]
                for variant, folder in variants:
                    g = validate(folder, checkpoint, steps=20, weight_check=False).gate  # the gate alone judges
                    rows.append((name, scheme, variant, g, plain_top5_overlap(*logits["last"])))
                    print_row(rows[-1], "top-5 overlap")
    print_table(rows, "export", "top-5 overlap")
    for scheme, t in accuracy_gate.GATES.items():
        print(f"{scheme}: greedy mass >= {t.greedy_mass}, top-5 mass >= {t.top5_mass}, mean KL <= {t.mean_kl}")
    wrong = [r[:3] for r in rows if r[3].passed != (r[2] == "healthy")]
    print("every healthy export passes and every broken one fails" if not wrong else f"MISJUDGED: {wrong}")


if __name__ == "__main__":
    main()
