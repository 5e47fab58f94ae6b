"""VUE-TR's released scorer (`VUE_TR/qa_eval.py`, `VUE_TR_V2/qa_eval.py`) as an oracle for `dattn-export score`. Its
functions are imported from the checkout as they are (`load_result`, `success_overlap`, `compute_precision_recall`,
the per-attribute filter of `breakdown_results`); only its plots are not drawn, pandas (its table printer, not
called) is a stand-in, and numpy 2's `trapezoid` stands in for the `trapz` that numpy 2.4 removed.

    VIDI_SRC=/tmp/vidi_src python score_oracle.py cases tests/fixtures/vue_tr
        writes synthetic ground truths and prediction files (every rule's corner: overlapping, touching, reversed,
        zero-length and fractional ranges, empty answers, queries left out, V2's `id` and empty truth), and the
        released scorer's figures for each at full precision (oracle.json): the fixtures tests/test_score.py holds
        ours to
    VIDI_SRC=/tmp/vidi_src python score_oracle.py published
        scores every published prediction file (VUE-TR: Vidi, GPT-4o, Gemini-2.0-Flash, Gemini-2.5-Pro; V2: Vidi2,
        Vidi2.5, GPT-5, Gemini-3-Pro-Prev) with the released scorer and with `dattn-export score --json`, and prints
        both tables and the largest difference"""

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

VIDI_SRC = Path(os.environ["VIDI_SRC"])  # a checkout of github.com/bytedance/vidi
VERSIONS = {  # folder, ground truth, published predictions
    "v1": ("VUE_TR", "VUE-TR_ground_truth.json", ["Vidi", "GPT-4o", "Gemini-2.0-Flash", "Gemini-2.5-Pro"]),
    "v2": ("VUE_TR_V2", "VUE-TRv2_ground_truth.json", ["Vidi2", "Vidi2.5", "GPT-5", "Gemini-3-Pro-Prev"]),
}
ATTRIBUTES = [  # the released scorer's, in its order (V1's)
    "overall", "ultra-short", "short", "medium", "long", "ultra-long", "keyword", "phrase", "sentence", "audio",
    "vision", "vision+audio",
]  # fmt: skip


def released(version: str):
    sys.modules.setdefault("pandas", types.ModuleType("pandas"))  # used only by the table printer
    if not hasattr(np, "trapz"):
        np.trapz = np.trapezoid
    spec = importlib.util.spec_from_file_location(f"qa_eval_{version}", VIDI_SRC / VERSIONS[version][0] / "qa_eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def released_figures(qa_eval, truth: Path, predictions: Path) -> dict:
    """The released figures, overall and per attribute (its `breakdown_results` filter, without the plots)."""
    results = qa_eval.load_result(str(truth), str(predictions))
    out = {}
    for attribute in ATTRIBUTES:
        if attribute in ["ultra-short", "short", "medium", "long", "ultra-long"]:
            subset = [r for r in results if r["duration_category"] == attribute]
        elif attribute in ["keyword", "phrase", "sentence"]:
            subset = [r for r in results if r["query_format"] == attribute]
        elif attribute in ["audio", "vision", "vision+audio"]:
            subset = [r for r in results if r["query_modality"] == attribute]
        else:
            subset = results
        if not subset:
            continue
        _, iou = qa_eval.success_overlap(subset)
        precision, recall = qa_eval.compute_precision_recall(subset)
        out[attribute] = {"queries": len(subset), "precision": float(precision), "recall": float(recall),
                          "iou": float(iou)}  # fmt: skip
    return out


def synthetic_truth(rng: np.random.Generator, count: int, empty_truths: bool) -> list[dict]:
    """A ground truth in VUE-TR's fields: lengths from seconds to hours, 1-4 true ranges (some overlapping or
    touching each other, fractional or whole), every attribute value; with `empty_truths`, a few queries with none
    (V2's rule)."""
    categories = [("ultra-short", 10, 60), ("short", 60, 600), ("medium", 600, 1800), ("long", 1800, 3600),
                  ("ultra-long", 3600, 7200)]  # fmt: skip
    entries = []
    for query_id in range(count):
        category, low, high = categories[query_id % 5]
        duration = round(float(rng.uniform(low, high)), 3)
        truth = []
        for _ in range(int(rng.integers(1, 5))):
            start = float(rng.uniform(0, duration * 0.9))
            end = min(duration, start + float(rng.uniform(0.5, duration / 5)))
            truth.append([round(start, 2), round(end, 2)] if rng.random() < 0.6 else [int(start), int(np.ceil(end))])
        if len(truth) > 1 and rng.random() < 0.3:  # two true ranges that touch
            truth[1] = [truth[0][1], truth[0][1] + 3.0]
        if empty_truths and query_id % 23 == 7:
            truth = []
        entries.append({
            "query_id": query_id, "video_id": f"vid{query_id // 4:03d}", "duration": duration,
            "query": f"query {query_id}", "gt": truth, "task": "temporal_retrieval", "duration_category": category,
            "query_format": ["keyword", "phrase", "sentence"][query_id % 3],
            "query_modality": ["vision", "audio", "vision+audio"][(query_id // 3) % 3],
        })  # fmt: skip
    return entries


def synthetic_answer(rng: np.random.Generator, entry: dict, style: str) -> list:
    """A prediction of one of several styles, each a corner of the scoring rules."""
    duration, truth = entry["duration"], entry["gt"] or [[0.0, entry["duration"] / 3]]
    jitter = lambda t: float(np.clip(t + rng.normal(0, duration / 30), 0, duration * 1.05))
    if style == "close":  # the truth moved a little, fractional seconds
        return [[jitter(a), jitter(b)] for a, b in truth]
    if style == "messy":  # overlapping, touching, reversed, zero-length and repeated ranges
        answer = [[jitter(a), jitter(b)] for a, b in truth]
        kind = int(rng.integers(0, 6))
        if kind == 0:
            answer.append([answer[0][0] + 1, answer[0][1] + 5])  # overlaps the first
        elif kind == 1:
            answer.append([np.ceil(answer[0][1]), np.ceil(answer[0][1]) + 4])  # touches it, once ceiled
        elif kind == 2:
            answer[0] = [answer[0][1], answer[0][0]]  # reversed
        elif kind == 3:
            answer.append([answer[0][0], answer[0][0]])  # zero length (one second once floored and ceiled)
        elif kind == 4:
            answer.append(list(answer[0]))  # repeated
        else:
            answer = [[5.0, 5.0]]  # zero length, whole seconds
        return answer
    if style == "empty":
        return [] if rng.random() < 0.5 else [[]]
    start = float(rng.uniform(0, duration))  # "random": anywhere
    return [[start, min(duration, start + float(rng.uniform(1, duration / 4)))]]


def json_lines_list(records: list) -> str:
    """A JSON list, an entry a line."""
    return "[\n" + ",\n".join(json.dumps(record) for record in records) + "\n]\n"


def write_cases(out: Path) -> None:
    """The fixtures: two ground truths (V1's data: every query has truth; V2's: some have none), and prediction
    files of every style, a .json list and a .jsonl, one with queries left out and one keyed by V2's `id`; then
    the released scorer's figures for each (V1's script on V1's truth, V2's on V2's)."""
    rng = np.random.default_rng(20261206)
    out.mkdir(parents=True, exist_ok=True)
    oracle = {}
    for version, empty_truths in (("v1", False), ("v2", True)):
        truth = synthetic_truth(rng, 160, empty_truths)
        truth_path = out / f"truth_{version}.json"
        truth_path.write_text(json_lines_list(truth))
        styles = ["close", "messy", "empty", "random"]
        files = {
            "mixed.json": [
                {"query_id": e["query_id"], "answer": synthetic_answer(rng, e, styles[int(rng.integers(0, 4))])}
                for e in truth
            ],
            "messy.jsonl": [{"query_id": e["query_id"], "answer": synthetic_answer(rng, e, "messy")} for e in truth],
            "partial.jsonl": [  # a quarter of the queries left out
                {"query_id": e["query_id"], "answer": synthetic_answer(rng, e, "close")}
                for e in truth
                if rng.random() < 0.75
            ],
        }  # fmt: skip
        if version == "v2":  # V2's scorer also reads `id`
            files["by_id.jsonl"] = [{"id": e["query_id"], "answer": synthetic_answer(rng, e, "close")} for e in truth]
        qa_eval = released(version)
        for name, records in files.items():
            path = out / f"{version}_{name}"
            if name.endswith(".jsonl"):
                path.write_text("".join(json.dumps(r) + "\n" for r in records))
            else:
                path.write_text(json_lines_list(records))
            oracle[path.name] = {"truth": truth_path.name, "released": released_figures(qa_eval, truth_path, path)}
            answered = {r.get("query_id", r.get("id")) for r in records}
            if left_out := [e["query_id"] for e in truth if e["query_id"] not in answered]:
                # every query counted: the released scorer on the same file with the left-out ones answered empty
                completed = out / f".{path.stem}.completed.json"
                completed.write_text(json.dumps(records + [{"query_id": q, "answer": []} for q in left_out]))
                oracle[path.name]["completed"] = released_figures(qa_eval, truth_path, completed)
                completed.unlink()
    (out / "oracle.json").write_text(json.dumps(oracle, indent=1) + "\n")
    print(f"{out}: {len(oracle)} prediction files and the released scorer's figures")


def published() -> None:
    """Every published file: the released scorer's overall figures, ours (`dattn-export score --json`), the gap."""
    worst = 0.0
    for version, (folder, truth_name, models) in VERSIONS.items():
        qa_eval, truth = released(version), VIDI_SRC / folder / truth_name
        print(f"{folder} ({truth_name})")
        print(f"  {'model':<20} {'released P / R / IoU':>28} {'dattn-export score P / R / IoU':>34}  max |diff|")
        for model in models:
            path = VIDI_SRC / folder / f"results_{model}.json"
            theirs = released_figures(qa_eval, truth, path)["overall"]
            run = subprocess.run(
                ["dattn-export", "score", str(path), "--gt", str(truth), "--json"], capture_output=True, text=True
            )
            ours = json.loads(run.stdout)["overall"]
            gap = max(abs(theirs[m] - ours[m]) for m in ("precision", "recall", "iou"))
            worst = max(worst, gap)
            show = lambda f: " / ".join(f"{100 * f[m]:.4f}" for m in ("precision", "recall", "iou"))
            print(f"  {model:<20} {show(theirs):>28} {show(ours):>34}  {gap:.2e}")
    print(f"largest difference: {worst:.2e}")


if __name__ == "__main__":
    if sys.argv[1] == "cases":
        write_cases(Path(sys.argv[2]))
    else:
        published()
