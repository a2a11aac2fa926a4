"""How long one rank's share of a step takes: a linear model of work features.

    seconds ~ c_fixed * fixed + c_nodes * nodes + c_tokens * tokens + c_attention * attention

(features: :mod:`dtree.distributed.features`). AREAL-DTA balances ranks with a time
model of this form; the coefficients are machine-, model- and runtime-setting
specific, so they are either

* **derived** from the model's FLOPs (:meth:`CostModel.from_spec`): FLOPs per token
  and per attention pair from :class:`dtree.models.ModelSpec`, divided by a nominal
  throughput, plus a nominal per-node launch overhead; good enough to balance when
  nothing was measured, or
* **fitted** by non-negative least squares to measured step times
  (:meth:`CostModel.fit`; ``dtree calibrate`` measures and fits, see
  :mod:`dtree.bench.calibrate`).

Only the ratios of the coefficients matter to the balancer; the absolute scale
(seconds) makes reports readable.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ..forest.forest import Forest
from ..models.protocol import ModelSpec
from .features import FEATURES, CostFeatures, forest_features
from .nnls import nnls

__all__ = ["CostModel", "FitReport", "NOMINAL_SPEC"]

# The model balanced for when no spec is given: Qwen2.5-0.5B's published shape. Only
# the ratio of attention to matmul FLOPs (hidden size vs head count x head dim) and
# of launches to FLOPs matters, and that varies little between similar models.
NOMINAL_SPEC = ModelSpec(
    num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, hidden_size=896, vocab_size=151936,
    intermediate_size=4864, name="qwen2.5-0.5b (nominal)",
)

# Nominal device figures for uncalibrated models. Effective training throughput of a
# bf16 model on a current datacenter GPU (about 30-40% of an H100's dense peak), the
# host cost of one eager kernel launch, the kernels one decoder layer issues per
# forward (norms, projections, rotary, attention, MLP, residuals), and the fixed
# host-side cost of a step (planning, copies, the loss sync).
NOMINAL_FLOPS_PER_SECOND = 300e12
NOMINAL_LAUNCH_SECONDS = 6e-6
NOMINAL_KERNELS_PER_LAYER = 20
NOMINAL_FIXED_SECONDS = 2e-3


@dataclass
class FitReport:
    """How well a fit explains the measured times."""

    r2: float
    mean_abs_rel_error: float
    max_abs_rel_error: float
    residual_norm: float
    num_samples: int

    def format(self) -> str:
        return (
            f"R^2 {self.r2:.4f}, mean |rel error| {100 * self.mean_abs_rel_error:.1f}%, "
            f"max |rel error| {100 * self.max_abs_rel_error:.1f}% over {self.num_samples} samples"
        )


@dataclass
class CostModel:
    """Linear time model; see the module docstring.

    Args:
        coefficients: seconds per unit of each feature, as a mapping with the keys of
            :data:`dtree.distributed.features.FEATURES` (missing keys are 0) or a
            sequence in that order. All must be finite and >= 0.
        meta: free-form provenance (spec, device, fit quality), saved with the model.
    """

    coefficients: Mapping[str, float] | Sequence[float]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = self.coefficients
        if isinstance(c, Mapping):
            unknown = sorted(set(c) - set(FEATURES))
            if unknown:
                raise ValueError(f"unknown cost features {unknown}; the features are {FEATURES}")
            values = tuple(float(c.get(name, 0.0)) for name in FEATURES)
        else:
            values = tuple(float(v) for v in c)
            if len(values) != len(FEATURES):
                raise ValueError(f"need {len(FEATURES)} coefficients {FEATURES}, got {len(values)}")
        bad = [(n, v) for n, v in zip(FEATURES, values) if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ValueError(f"cost coefficients must be finite and >= 0, got {bad}")
        if not any(values[1:]):
            raise ValueError("a cost model needs a positive coefficient on nodes, tokens or attention")
        self.coefficients = dict(zip(FEATURES, values))
        self._values = values

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_spec(
        cls,
        spec: ModelSpec,
        *,
        flops_per_second: float = NOMINAL_FLOPS_PER_SECOND,
        launch_seconds: float = NOMINAL_LAUNCH_SECONDS,
        kernels_per_layer: int = NOMINAL_KERNELS_PER_LAYER,
        fixed_seconds: float = NOMINAL_FIXED_SECONDS,
        passes: float = 3.0,
    ) -> "CostModel":
        """Uncalibrated coefficients from the model's FLOPs.

        ``passes``: forward + backward as multiples of one forward (3 for ``retain``;
        use 4 for ``mode="recompute"``, which runs every forward twice). A node costs
        ``passes x (kernels_per_layer x layers + a few)`` launches.
        """
        if flops_per_second <= 0 or launch_seconds < 0 or fixed_seconds < 0 or passes <= 0:
            raise ValueError("flops_per_second and passes must be > 0; launch_seconds and fixed_seconds >= 0")
        launches = passes * (kernels_per_layer * spec.num_layers + 8)
        return cls(
            {
                "fixed": fixed_seconds,
                "nodes": launches * launch_seconds,
                "tokens": passes * spec.forward_flops_per_token() / flops_per_second,
                "attention": passes * spec.forward_attention_flops_per_key() / flops_per_second,
            },
            meta={"source": "flops", "spec": spec.name, "flops_per_second": flops_per_second,
                  "launch_seconds": launch_seconds, "passes": passes},
        )

    @classmethod
    def default(cls) -> "CostModel":
        """FLOP-derived coefficients of :data:`NOMINAL_SPEC` (used when none is given)."""
        return cls.from_spec(NOMINAL_SPEC)

    @classmethod
    def token_count(cls) -> "CostModel":
        """Cost = unique tokens: the naive balancer, for comparisons."""
        return cls({"tokens": 1.0}, meta={"source": "token count"})

    # ------------------------------------------------------------------ evaluation
    def features(self, forest_or_features: Forest | CostFeatures | None) -> CostFeatures:
        """The features of a forest (``None``: an empty rank), or the argument itself."""
        if isinstance(forest_or_features, CostFeatures):
            return forest_or_features
        return forest_features(forest_or_features)

    def cost(self, forest_or_features: Forest | CostFeatures | None) -> float:
        """Predicted seconds. Summed in a fixed order in Python floats, so every rank
        computes bit-identical costs (numpy dot products may reorder the sum)."""
        x = self.features(forest_or_features).as_tuple()
        total = 0.0
        for c, v in zip(self._values, x):
            total += c * v
        return total

    # ------------------------------------------------------------------ fitting
    @classmethod
    def fit(
        cls, feature_rows: Sequence[CostFeatures | Sequence[float]], times: Sequence[float], *, meta: dict | None = None
    ) -> tuple["CostModel", FitReport]:
        """Non-negative least squares fit of measured step times.

        Fits relative error rather than absolute: each row is divided by its time, so
        a 10 ms step counts as much as a 10 s one (otherwise the large steps decide
        every coefficient and small ranks are mispredicted). Columns are scaled to
        unit norm before the solve, as the raw features span ten orders of magnitude.

        Returns (model, fit report).
        """
        rows = [r.as_tuple() if isinstance(r, CostFeatures) else tuple(r) for r in feature_rows]
        x = np.array(rows, dtype=np.float64)
        t = np.asarray(times, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != len(FEATURES) or x.shape[0] != t.shape[0]:
            raise ValueError(f"need [n, {len(FEATURES)}] feature rows and n times, got {x.shape} and {t.shape}")
        if x.shape[0] < 2:
            raise ValueError("need at least 2 measured samples to fit a cost model")
        if not np.all(t > 0) or not np.all(np.isfinite(t)):
            raise ValueError("measured times must be finite and > 0")
        a = x / t[:, None]
        b = np.ones_like(t)
        scale = np.linalg.norm(a, axis=0)
        scale[scale == 0] = 1.0
        coef, _ = nnls(a / scale, b)
        coef = coef / scale
        if not np.any(coef[1:] > 0):
            raise ValueError("the fit put zero cost on nodes, tokens and attention; measure more varied forests")
        pred = x @ coef
        rel = (pred - t) / t
        ss_res = float(((pred - t) ** 2).sum())
        ss_tot = float(((t - t.mean()) ** 2).sum())
        report = FitReport(
            r2=1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
            mean_abs_rel_error=float(np.abs(rel).mean()),
            max_abs_rel_error=float(np.abs(rel).max()),
            residual_norm=math.sqrt(ss_res),
            num_samples=int(t.shape[0]),
        )
        info = {"source": "fit", "fit": report.__dict__.copy(), **(meta or {})}
        return cls(dict(zip(FEATURES, coef.tolist())), meta=info), report

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        return {"format": "dtree-cost-model", "version": 1, "features": list(FEATURES),
                "coefficients": dict(self.coefficients), "meta": self.meta}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "CostModel":
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("format") != "dtree-cost-model":
            raise ValueError(f"{path} is not a dtree cost model (written by CostModel.save / dtree calibrate)")
        return cls(data["coefficients"], meta=data.get("meta", {}))

    def format(self) -> str:
        return ", ".join(f"{n}={v:.3g}s" for n, v in self.coefficients.items())
