"""The accuracy gate's figures under vLLM (`validate --backend vllm`): quantized folders of tiny models trained first,
both families, two seeds each, served by vLLM's CPU kernels against their 16-bit folder served alike; every metric
the gate judges, against the thresholds of `accuracy_gate.GATES` (the row `quantize.COMPRESSED_SCHEMES` names for
each scheme).

Healthy: w8a8, w4a16 (groups of 32: the tiny models' layers take 64 or 128 features) and fp8 folders as
`dattn-export quantize` writes them. Broken (w4a16, the weight check skipped as --no-weight-check skips it, so that
the gate alone judges them): every matrix's scales a row off (`every matrix's scales a row off`), the first two
layers' projections exchanged (`every matrix swapped`); and the first layer's q projection's scales a row off
(`scales a row off`), reported but not judged: it barely moves the answers, and the weight check fails it. Each
folder is asked the gate's four prompts about the demo's picture, 20 tokens each (80 positions).

    python bench/vllm_quantize_gate.py [--work DIR]        # about 4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).parent))

from helpers.builders import checkpoint_of  # noqa: E402
from helpers.quantized import CORPORA, corrupt, train  # noqa: E402
from quantize_gate import print_row, print_table  # noqa: E402

from dattn_export.demo_model import write_demo_checkpoint  # noqa: E402
from dattn_export.stages.accuracy_gate import GATES  # noqa: E402
from dattn_export.stages.convert import convert  # noqa: E402
from dattn_export.stages.quantize import COMPRESSED_SCHEMES, quantize  # noqa: E402
from dattn_export.stages.validate_vllm import validate_vllm  # noqa: E402

SEEDS = (0, 1)
GROUPS = {"w8a8": None, "w4a16": 32, "fp8": None}
DAMAGES = ("scales a row off", "every matrix's scales a row off", "every matrix swapped")
UNGATED = "scales a row off"  # one matrix's: barely moves the answers; the weight check's to catch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="Folder for the checkpoints and folders (default: a temporary one).")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="vllm-gate-"))
    rows = []
    for family in ("mistral", "gemma2"):
        for seed in SEEDS:
            name = f"{family}-{seed}"
            base = write_demo_checkpoint(work / f"{name}-base", family, seed=seed)
            sixteen = convert(checkpoint_of(train(base, CORPORA["demo"], seed=seed), work / f"{name}-trained"),
                              work / f"{name}-16-bit").out  # fmt: skip
            for scheme, group in GROUPS.items():
                healthy = quantize(sixteen, work / f"{name}-{scheme}", scheme, group).out
                variants = [("healthy", healthy)]
                if scheme == "w4a16":
                    for damage in DAMAGES:
                        broken = work / f"{name}-{scheme}-{damage.replace(' ', '-')}"
                        shutil.copytree(healthy, broken)
                        corrupt(broken, damage, scheme)
                        variants.append((damage, broken))
                for variant, folder in variants:
                    g = validate_vllm(folder, steps=20, weight_check=False).gate
                    rows.append((name, scheme, variant, g, g.max_kl))
                    print_row(rows[-1], "max KL")
    print_table(rows, "folder", "max KL")
    for scheme, spec in COMPRESSED_SCHEMES.items():
        t = GATES[spec.gate]
        print(f"{scheme} ({spec.gate}'s row): greedy mass >= {t.greedy_mass}, top-5 mass >= {t.top5_mass}, "
              f"mean KL <= {t.mean_kl}")  # fmt: skip
    wrong = [r[:3] for r in rows if r[2] != UNGATED and r[3].passed != (r[2] == "healthy")]
    caught = sum(not r[3].passed for r in rows if r[2] == UNGATED)
    print("every healthy folder passes and every broken one fails" if not wrong else f"MISJUDGED: {wrong}")
    print(f"one matrix's scales a row off (the weight check fails it): {caught} of {len(SEEDS) * 2} fail the gate too")


if __name__ == "__main__":
    main()
