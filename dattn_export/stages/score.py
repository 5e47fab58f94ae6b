"""`dattn-export score`: VUE-TR's metrics, computed as the released scorer (`qa_eval.py`, both versions) computes
them, written here from its rules, plus lmms-eval's R@IoU and mIoU; honest about coverage.

The released rules, per query, on the prediction's ranges with each start floored and each end ceiled to whole
seconds:
- IoU: the prediction's ranges sorted and merged where they overlap or touch, reversed ones then dropped; the truth
  as given; overlap / (merged length + true length - overlap), clipped to [0, 1]; no truth and no prediction 1, no
  prediction 0. Reported as the area (trapezoid rule) under the share of queries whose IoU is above t, t = 0, 0.01,
  ..., 1.
- precision and recall on the unmerged prediction (`[min, max]` of each pair) against the truth, their overlap by the
  released two-pointer walk over both lists as given: overlap / predicted length where something is predicted (V2:
  no truth and no prediction is 1; V1's data never has empty truth, so one rule reproduces both), overlap / true
  length where there is truth; the area under the share at or above t.
The released scorer averages over the predictions a file holds, so a file that leaves queries out scores them as if
they were not asked; here every query of the ground truth counts, one without a prediction as empty, and the
released figure is reported beside it. lmms-eval's temporal grounding keeps one range each: the prediction's first
against the truth's first, IoU over their hull; R@t the share at or above t, mIoU the mean."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..retrieval import ATTRIBUTES, Predictions, Query, read_benchmark, read_predictions

THRESHOLDS = np.linspace(0, 1, 101)  # the released scorer's
RECALL_AT = (0.3, 0.5, 0.7)  # lmms-eval's
METRICS = ("precision", "recall", "iou")


def area(rates: np.ndarray) -> float:
    """The area under a curve over THRESHOLDS by the trapezoid rule (the released scorer's np.trapz)."""
    trapezoid = getattr(np, "trapezoid", None) or np.trapz  # numpy 2 renamed it (and 2.4 removed trapz)
    return float(trapezoid(rates, THRESHOLDS))


def whole_seconds(answer: list[list[float]]) -> np.ndarray:
    """A prediction as the released scorer reads it: (ranges, 2), each start floored and each end ceiled."""
    spans = np.array(answer, dtype=np.float64).reshape(-1, 2)
    return np.stack([np.floor(spans[:, 0]), np.ceil(spans[:, 1])], axis=1)


def merged(spans: np.ndarray) -> np.ndarray:
    """Ranges sorted by start and merged where one starts at or before the previous one's end (the released
    `merge_time_spans`, sort included)."""
    spans = spans[np.argsort(spans[:, 0])]
    out = [spans[0].copy()]
    for start, end in spans[1:]:
        if start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append(np.array([start, end]))
    return np.array(out)


def iou(prediction: np.ndarray, truth: np.ndarray) -> float:
    """The released `overlap_ratio`, its order of additions kept (a threshold compares the result with `>`)."""
    if len(truth) == 0:
        return 1.0 if len(prediction) == 0 else 0.0
    if len(prediction) == 0:
        return 0.0
    prediction = merged(prediction)
    prediction = prediction[prediction[:, 0] <= prediction[:, 1]]
    true_length = np.sum(truth[:, 1] - truth[:, 0])
    overlap = 0
    for start, end in prediction:
        for true_start, true_end in truth:
            overlap += np.maximum(0.0, np.minimum(end, true_end) - np.maximum(start, true_start))
    union = np.sum(prediction[:, 1] - prediction[:, 0]) + true_length - overlap
    return float(np.clip(overlap / (union + 1e-16), 0.0, 1.0))


def walked_overlap(truth: list, prediction: list) -> float:
    """The released `interval_intersection`: a two-pointer walk over both lists in their given order, summed."""
    i = j = 0
    pieces = []
    while i < len(truth) and j < len(prediction):
        (a_start, a_end), (b_start, b_end) = truth[i], prediction[j]
        if a_start <= b_end and b_start <= a_end:
            pieces.append(min(a_end, b_end) - max(a_start, b_start))
        if a_end < b_end:
            i += 1
        else:
            j += 1
    return sum(pieces)


def precision_recall(prediction: np.ndarray, truth: np.ndarray) -> tuple[float | None, float | None]:
    """One query's precision and recall (None where the released scorer leaves the query out of that average)."""
    true_spans = [[min(pair), max(pair)] for pair in truth]
    predicted = [[min(pair), max(pair)] for pair in prediction]
    overlap = walked_overlap(true_spans, predicted)
    true_length = sum(end - start for start, end in true_spans)
    predicted_length = sum(end - start for start, end in predicted)
    precision = 1.0 if true_length == 0 and predicted_length == 0 else None
    if predicted_length != 0:
        precision = overlap / predicted_length
    return precision, (overlap / true_length if true_length != 0 else None)


def first_range_iou(answer: list[list[float]], truth: list[list[float]]) -> float:
    """lmms-eval's: the prediction's first range (ordered) against the truth's first, overlap over their hull."""
    if not answer:
        return 0.0
    (a, b), (c, d) = sorted(answer[0]), sorted(truth[0])
    hull = max(b, d) - min(a, c)
    return max(min(b, d) - max(a, c), 0.0) / hull if hull > 0 else 0.0


@dataclass
class Figures:
    """The figures of a set of queries: VUE-TR's areas (None where no query qualifies, where the released scorer
    prints nan), lmms-eval's R@IoU and mIoU over the queries with truth, and how many queries they cover."""

    queries: int
    precision: float | None
    recall: float | None
    iou: float | None
    recall_at: dict[str, float | None]
    miou: float | None
    curves: dict[str, list[float]]  # each metric's share over THRESHOLDS (the plots)


def share_above(values: list[float], strictly: bool) -> np.ndarray | None:
    if not values:
        return None
    values = np.array(values)
    return np.array([np.mean(values > t) if strictly else np.mean(values >= t) for t in THRESHOLDS])


def figures(pairs: list[tuple[np.ndarray, np.ndarray, list, list]]) -> Figures:
    """Figures over (prediction in whole seconds, truth, answer as given, truth as given) per query."""
    ious = [iou(prediction, truth) for prediction, truth, _, _ in pairs]
    measured = [precision_recall(prediction, truth) for prediction, truth, _, _ in pairs]
    curves = {
        "iou": share_above(ious, strictly=True),
        "precision": share_above([p for p, _ in measured if p is not None], strictly=False),
        "recall": share_above([r for _, r in measured if r is not None], strictly=False),
    }
    firsts = [first_range_iou(answer, truth) for _, _, answer, truth in pairs if truth]
    return Figures(
        queries=len(pairs),
        **{name: None if curves[name] is None else area(curves[name]) for name in METRICS},
        recall_at={f"{t:.1f}": float(np.mean(np.array(firsts) >= t)) if firsts else None for t in RECALL_AT},
        miou=float(np.mean(firsts)) if firsts else None,
        curves={name: [] if curve is None else curve.tolist() for name, curve in curves.items()},
    )


@dataclass
class Score:
    """A predictions file scored: every query of the truth (`overall`, one without a prediction as empty), the
    released scorer's figure (`submitted`: the predictions given, alone), and each attribute's values."""

    predictions: str
    truth: str
    queries: int
    predicted: int
    missing: list
    overall: Figures
    submitted: Figures
    attributes: dict[str, dict[str, Figures]]

    def to_json(self) -> dict:
        drop_curves = lambda figures: {k: v for k, v in asdict(figures).items() if k != "curves"}
        return {
            "predictions": self.predictions,
            "truth": self.truth,
            "queries": self.queries,
            "predicted": self.predicted,
            "missing": self.missing,
            "overall": drop_curves(self.overall),
            "released_scorer": drop_curves(self.submitted),
            "attributes": {
                name: {value: drop_curves(figures) for value, figures in values.items()}
                for name, values in self.attributes.items()
            },
        }


def truth_from(predictions: Predictions, queries: list[Query] | None) -> list[Query]:
    """`--against`: another predictions file's answers as the truth, the queries' attributes from the ground truth
    where one is given."""
    attributes = {query.query_id: query.attributes for query in queries or []}
    return [
        Query(query_id, "", "", None, answer, attributes.get(query_id, {}))
        for query_id, answer in predictions.answers.items()
    ]


def score(predictions_path: Path, truth_path: Path | None = None, against: Path | None = None) -> Score:
    """Score a predictions file against a ground-truth file (VUE-TR's, or a JSONL with `gt`), or `against` another
    predictions file (the truth's attributes, when given too, break the figures down)."""
    benchmark = read_benchmark(truth_path) if truth_path else None
    if against is not None:
        queries, truth_name = truth_from(read_predictions(against), benchmark), str(against)
    else:
        queries, truth_name = benchmark, str(truth_path)
        if unknown := next((q for q in queries if q.truth is None), None):
            raise InputError(truth_path, f'query_id {unknown.query_id} has no "gt": not a ground-truth file')
    given = read_predictions(predictions_path)
    known = {query.query_id for query in queries}
    if stray := next((query_id for query_id in given.answers if query_id not in known), None):
        raise InputError(predictions_path, f"answers query_id {stray!r}, which {truth_name} does not hold")
    rows, none = [], np.zeros((0, 2))
    for query in queries:
        answer = given.answers.get(query.query_id)
        prediction = whole_seconds(answer) if answer else none
        if against is not None:  # answers as the truth: in whole seconds as predictions are read (equal ones score 1)
            truth = whole_seconds(query.truth) if query.truth else none
        else:
            truth = np.array(query.truth, dtype=np.float64).reshape(-1, 2)
        rows.append((query, answer is not None, (prediction, truth, answer or [], query.truth)))
    attributes = {}
    for name, values in ATTRIBUTES.items():
        present = [value for value in values if any(q.attributes.get(name) == value for q, _, _ in rows)]
        attributes[name] = {
            value: figures([pair for q, _, pair in rows if q.attributes.get(name) == value]) for value in present
        }
    return Score(
        predictions=str(predictions_path),
        truth=truth_name,
        queries=len(rows),
        predicted=sum(given for _, given, _ in rows),
        missing=[q.query_id for q, given, _ in rows if not given],
        overall=figures([pair for _, _, pair in rows]),
        submitted=figures([pair for _, given, pair in rows if given]),
        attributes={name: values for name, values in attributes.items() if values},
    )


def percent(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.1f}"


def plot_curves(result: Score, folder: Path) -> list[Path]:
    """The three curves (the share of queries at or above each threshold) as the release's figures draw them:
    overall_{IoU,Precision,Recall}_plot.png, and one per attribute value in a folder per attribute; where queries
    have no prediction, the released scorer's curve (the predictions given) beside every query's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written, names = [], {"iou": "IoU", "precision": "Precision", "recall": "Recall"}
    sets = [("", "overall", result.overall, result.submitted if result.missing else None)]
    sets += [
        (name, value, figures, None) for name, values in result.attributes.items() for value, figures in values.items()
    ]
    for sub, label, figures, released in sets:
        (folder / sub).mkdir(parents=True, exist_ok=True)
        for metric, title in names.items():
            fig, ax = plt.subplots(figsize=(7, 5.6))
            for what, line in (("every query", figures), ("predictions given (released scorer)", released)):
                if line is not None and line.curves[metric]:
                    value = getattr(line, metric)
                    ax.plot(THRESHOLDS, line.curves[metric], linewidth=2.5, label=f"{what} [{percent(value)}%]")
            ax.set(xlim=(0, 1), ylim=(0, 1), xlabel=f"{title} threshold", ylabel="share of queries",
                   title=f"{title}: {label} ({figures.queries} queries)")  # fmt: skip
            ax.set_xticks(np.arange(0, 1.01, 0.1))
            ax.set_yticks(np.arange(0, 1.01, 0.1))
            ax.grid(True)
            ax.legend(loc="best")
            path = folder / sub / f"{label}_{title}_plot.png"
            fig.savefig(path, dpi=120, bbox_inches="tight")
            plt.close(fig)
            written.append(path)
    return written
