"""score: VUE-TR's metrics as the released scorer computes them. The fixtures (tests/fixtures/vue_tr) are synthetic
ground truths and prediction files with every corner of its rules, and the figures the released `qa_eval.py` (V1's
and V2's, run as they are by tools/vidi_oracle/score_oracle.py) gave for each; lmms-eval's R@IoU and mIoU against
their formula written out here."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.cli import error_line, run_cli

from dattn_export.retrieval import read_benchmark
from dattn_export.stages.score import score

FIXTURES = Path(__file__).parent / "fixtures" / "vue_tr"
ORACLE = json.loads((FIXTURES / "oracle.json").read_text())
METRICS = ("precision", "recall", "iou")


def figures_of(result, attribute: str):
    if attribute == "overall":
        return result.overall
    return next(values[attribute] for values in result.attributes.values() if attribute in values)


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_the_released_scorer_s_figures(name):
    """Over the predictions a file gives, the released scorer's overall and per-attribute figures to 1e-12 (the
    same additions in the same order); with queries left out, every query counted equals the released scorer on the
    file completed with empty answers."""
    recorded = ORACLE[name]
    result = score(FIXTURES / name, FIXTURES / recorded["truth"])
    truth = read_benchmark(FIXTURES / recorded["truth"])
    assert result.queries == len(truth) and result.predicted + len(result.missing) == len(truth)
    for metric in METRICS:
        assert getattr(result.submitted, metric) == pytest.approx(recorded["released"]["overall"][metric], abs=1e-12)
    assert result.submitted.queries == recorded["released"]["overall"]["queries"]
    if "completed" in recorded:  # queries left out: every query counted, they as empty
        assert result.missing and result.submitted.queries < result.overall.queries
        expected = recorded["completed"]
        assert result.overall.iou < result.submitted.iou
    else:
        assert not result.missing
        expected = recorded["released"]
    for attribute, figures in expected.items():
        ours = figures_of(result, attribute)
        assert ours.queries == figures["queries"], attribute
        for metric in METRICS:
            assert getattr(ours, metric) == pytest.approx(figures[metric], abs=1e-12), (attribute, metric)


def test_the_json_carries_full_precision_and_the_released_figure(tmp_path):
    result = run_cli("score", FIXTURES / "v1_partial.jsonl", "--gt", FIXTURES / "truth_v1.json", "--json")
    assert result.returncode == 0, result.stderr
    printed, recorded = json.loads(result.stdout), ORACLE["v1_partial.jsonl"]
    for metric in METRICS:
        assert printed["released_scorer"][metric] == recorded["released"]["overall"][metric]
        assert printed["overall"][metric] == pytest.approx(recorded["completed"]["overall"][metric], abs=1e-12)
    assert printed["queries"] == 160 and printed["predicted"] == recorded["released"]["overall"]["queries"]
    assert len(printed["missing"]) == 160 - printed["predicted"]
    table = run_cli("score", FIXTURES / "v1_partial.jsonl", "--gt", FIXTURES / "truth_v1.json", "--plots",
                    tmp_path / "plots")  # fmt: skip
    assert table.returncode == 0, table.stderr
    released = recorded["released"]["overall"]
    assert (
        f"Precision: {100 * released['precision']:.1f}%, Recall: {100 * released['recall']:.1f}%, "
        f"IoU: {100 * released['iou']:.1f}%" in table.stdout
    )
    assert f"{len(printed['missing'])} of 160 queries have no prediction" in table.stdout
    plots = {p.relative_to(tmp_path / "plots").as_posix() for p in (tmp_path / "plots").rglob("*.png")}
    assert {"overall_IoU_plot.png", "overall_Precision_plot.png", "duration_category/short_Recall_plot.png"} <= plots


def lmms_eval_iou(a: list[float], b: list[float]) -> float:
    """lmms-eval's charades_sta `iou`, written out."""
    return max(min(a[1], b[1]) - max(a[0], b[0]), 0) / (max(a[1], b[1]) - min(a[0], b[0]))


def test_recall_at_iou_and_miou_as_lmms_eval_reports_them():
    """The prediction's first range (ordered) against the truth's first; no prediction is IoU 0; queries without
    truth are left out."""
    name = "v2_mixed.json"
    result = score(FIXTURES / name, FIXTURES / "truth_v2.json")
    truth = {q.query_id: q.truth for q in read_benchmark(FIXTURES / "truth_v2.json")}
    answers = {r["query_id"]: r["answer"] for r in json.loads((FIXTURES / name).read_text())}
    ious = [
        lmms_eval_iou(sorted(answers[q][0]), truth[q][0]) if answers[q] and answers[q] != [[]] else 0.0
        for q in truth
        if truth[q]
    ]
    assert len(ious) < len(truth)  # V2's truth has queries with none
    assert result.overall.miou == pytest.approx(np.mean(ious), abs=1e-12)
    for t in (0.3, 0.5, 0.7):
        assert result.overall.recall_at[f"{t:.1f}"] == pytest.approx(np.mean(np.array(ious) >= t), abs=1e-12)


def test_a_file_against_itself_and_against_another(tmp_path):
    """--against: another predictions file's answers are the truth, in whole seconds as predictions are read: a
    file of ranges a second long or more scores every query's IoU 1 against itself (an area of 0.995: no IoU is
    above the last threshold, 1), precision and recall 1; the truth's attributes break the figures down."""
    records = json.loads((FIXTURES / "v1_mixed.json").read_text())
    tidy = [r | {"answer": [sorted(p) for p in r["answer"] if p and abs(p[1] - p[0]) >= 1][:1]} for r in records]
    (tmp_path / "reference.json").write_text(json.dumps(tidy))
    itself = score(tmp_path / "reference.json", FIXTURES / "truth_v1.json", against=tmp_path / "reference.json")
    assert itself.overall.iou == pytest.approx(0.995, abs=1e-12) and itself.overall.miou == pytest.approx(1.0)
    assert itself.overall.precision == itself.overall.recall == pytest.approx(1.0, abs=1e-12)
    assert set(itself.attributes) == {"duration_category", "query_format", "query_modality"}
    other = run_cli("score", FIXTURES / "v1_mixed.json", "--against", tmp_path / "reference.json", "--json")
    assert other.returncode == 0, other.stderr
    assert 0 < json.loads(other.stdout)["overall"]["iou"] < 1 and "attributes" in json.loads(other.stdout)


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda r: r + [{"query_id": 9999, "answer": []}], "answers query_id 9999, which"),
        (lambda r: r + [r[0]], "query_id 0 is answered twice"),
        (lambda r: [r[0] | {"answer": [[1, 2, 3]]}] + r[1:], "not a list of [start, end] pairs of seconds"),
        (lambda r: [{"video": "x"}] + r[1:], "entry 1 has no query_id"),
    ],
)
def test_a_bad_predictions_file_is_one_line(tmp_path, edit, problem):
    records = json.loads((FIXTURES / "v1_mixed.json").read_text())
    (tmp_path / "bad.json").write_text(json.dumps(edit(records)))
    result = run_cli("score", tmp_path / "bad.json", "--gt", FIXTURES / "truth_v1.json")
    assert result.returncode == 2 and problem in error_line(result.stderr) and "bad.json" in result.stderr


def test_a_truth_without_gt_and_a_missing_truth_are_refused(tmp_path):
    shutil.copy(FIXTURES / "truth_v1.json", tmp_path / "t.json")
    entries = json.loads((tmp_path / "t.json").read_text())
    del entries[3]["gt"]
    (tmp_path / "t.json").write_text(json.dumps(entries))
    result = run_cli("score", FIXTURES / "v1_mixed.json", "--gt", tmp_path / "t.json")
    assert result.returncode == 2 and 'query_id 3 has no "gt"' in error_line(result.stderr)
    result = run_cli("score", FIXTURES / "v1_mixed.json")
    assert result.returncode == 2 and "--gt FILE" in error_line(result.stderr)
