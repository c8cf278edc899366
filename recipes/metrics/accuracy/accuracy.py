"""Top-1 accuracy as an `evaluate` metric that ships with co2_hf.

``evaluate.load("accuracy")`` downloads its script from the Hub; this copy loads from disk:
``evaluate.load("recipes/metrics/accuracy")``. Inputs: integer ``predictions`` and ``references``;
output: ``{"accuracy": fraction correct}`` (weighted when ``sample_weight`` is given).
"""

import datasets
import evaluate

_DESCRIPTION = "Fraction of predictions equal to their references (top-1 accuracy)."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): true labels.
    sample_weight (list of float, optional): weight of each example.
Returns:
    accuracy (float): in [0, 1].
"""


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}
            ),
        )

    def _compute(self, predictions, references, sample_weight=None):
        weights = sample_weight if sample_weight is not None else [1.0] * len(predictions)
        correct = sum(w for p, r, w in zip(predictions, references, weights) if p == r)
        return {"accuracy": float(correct / sum(weights)) if weights else 0.0}
