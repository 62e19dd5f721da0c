"""Sparsity predictors (LLM in a flash §3.1, Appendix B): per layer a low-rank map from the FFN
input x to one logit per neuron, `(x @ U) @ V + b`; a neuron is predicted active when its logit
exceeds the layer's cut (a sigmoid threshold, stored as a logit). Inference is numpy (a few hundred
thousand multiply-adds per layer per token); training is offline (calibrate/predictor_training.py).

Saved beside the store: `predictors.safetensors` (U, V, b per layer) and `predictors.json`
(ranks, cuts, the magnitude thresholds that define 'active', and validation metrics).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np

from ..durable import write_durably, write_json
from ..errors import StoreError
from ..store.atomic_dir import OutputError

WEIGHTS_NAME = "predictors.safetensors"
META_NAME = "predictors.json"
FORMAT_VERSION = 1


def weights_digest(tensors: dict[str, np.ndarray]) -> str:
    """sha256 over the tensors' names, shapes, types and bytes (in name order): what ties a
    predictors.json to its predictors.safetensors."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{a.dtype.str}|{list(a.shape)}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


@dataclass
class LayerPredictor:
    U: np.ndarray  # [D, r] float32
    V: np.ndarray  # [r, F] float32
    b: np.ndarray  # [F] float32
    cut: float = 0.0  # logit above which a neuron is predicted active

    @property
    def rank(self) -> int:
        return int(self.U.shape[1])

    def logits(self, x: np.ndarray) -> np.ndarray:
        return (x.astype(np.float32, copy=False) @ self.U) @ self.V + self.b

    def active(self, x: np.ndarray) -> np.ndarray:
        """x [N, D] -> bool [N, F]."""
        return self.logits(x) > self.cut


@dataclass
class Predictors:
    layers: list[LayerPredictor]
    sparsity: float  # target fraction of inactive neurons that defined the labels
    magnitude_thresholds: list[float]  # per layer: |h| above this counts as active
    metrics: list[dict] = field(default_factory=list)  # per layer: recall, precision, predicted fraction
    trained_on: str = ""
    # Recall target -> per-layer cuts (set on held-out calibration data); `recall` is the one in use.
    cuts_by_recall: dict[str, list[float]] = field(default_factory=dict)
    recall: str = ""
    # Window behaviour of the true activity on the validation text (calibrate.activations.window_activity):
    # {"union": [...], "new": [...]} for windows of 1..k tokens; the planner sizes the window from it.
    activity: dict = field(default_factory=dict)

    def use_recall(self, recall: float | str) -> None:
        """Switch every layer to the cuts calibrated for this recall (a quality/I-O knob)."""
        key = f"{float(recall):g}"
        if key not in self.cuts_by_recall:
            raise StoreError(
                f"predictors have no cut for recall {key} (calibrated: "
                f"{', '.join(sorted(self.cuts_by_recall)) or 'none'}; retrain with tools/train_predictor.py)"
            )
        for p, c in zip(self.layers, self.cuts_by_recall[key]):
            p.cut = float(c)
        self.recall = key

    def save(self, store_path: str) -> None:
        from safetensors.numpy import save

        tensors = {}
        for i, p in enumerate(self.layers):
            tensors.update({f"layers.{i}.U": p.U, f"layers.{i}.V": p.V, f"layers.{i}.b": p.b})
        meta = {
            "format_version": FORMAT_VERSION,
            "sparsity": self.sparsity,
            "cuts": [p.cut for p in self.layers],
            "ranks": [p.rank for p in self.layers],
            "magnitude_thresholds": list(map(float, self.magnitude_thresholds)),
            "metrics": self.metrics,
            "trained_on": self.trained_on,
            "cuts_by_recall": self.cuts_by_recall,
            "recall": self.recall,
            "window_activity": self.activity,
        }
        wpath, mpath = os.path.join(store_path, WEIGHTS_NAME), os.path.join(store_path, META_NAME)
        # Two files, each replaced durably; a crash between the two leaves one of each training:
        # both carry the weights' digest, and load refuses a pair whose digests differ
        meta["weights_sha256"] = weights_digest(tensors)
        write_durably(wpath, [save(tensors, metadata={"weights_sha256": meta["weights_sha256"]})], OutputError)
        write_json(mpath, meta, OutputError)

    @classmethod
    def load(cls, store_path: str, n_layers: int, d_model: int, n_neurons: int) -> "Predictors":
        mpath, wpath = os.path.join(store_path, META_NAME), os.path.join(store_path, WEIGHTS_NAME)
        if not os.path.isfile(mpath) or not os.path.isfile(wpath):
            raise StoreError(
                f"{store_path}: the store has no sparsity predictors (train them with "
                f"python tools/train_predictor.py --model {store_path})"
            )
        try:
            with open(mpath) as fh:
                meta = json.load(fh)
            from safetensors import safe_open
            from safetensors.numpy import load_file

            t = load_file(wpath)
            with safe_open(wpath, "np") as f:
                digest = (f.metadata() or {}).get("weights_sha256")
        except Exception as e:  # noqa: BLE001 - any parse failure is one named error
            raise StoreError(f"{store_path}: predictor files are unreadable ({type(e).__name__}: {e})") from None
        if meta.get("format_version") != FORMAT_VERSION:
            raise StoreError(f"{mpath}: predictor format {meta.get('format_version')!r} is not {FORMAT_VERSION}")
        if meta.get("weights_sha256") != digest:
            raise StoreError(
                f"{store_path}: {META_NAME} and {WEIGHTS_NAME} are of different trainings (a save cut short); "
                f"train them again with python tools/train_predictor.py --model {store_path}"
            )
        layers = []
        for i in range(n_layers):
            names = [f"layers.{i}.{k}" for k in "UVb"]
            missing = [n for n in names if n not in t]
            if missing:
                raise StoreError(f"{wpath}: predictor tensor {missing[0]} is missing ({n_layers} layers expected)")
            U, V, b = (t[n].astype(np.float32) for n in names)
            r = U.shape[1] if U.ndim == 2 else -1
            if U.shape != (d_model, r) or V.shape != (r, n_neurons) or b.shape != (n_neurons,):
                raise StoreError(
                    f"{wpath}: predictor of layer {i} has shapes U{list(U.shape)} V{list(V.shape)} "
                    f"b{list(b.shape)}; the model needs U[{d_model}, r] V[r, {n_neurons}] b[{n_neurons}]"
                )
            layers.append(LayerPredictor(U, V, b, float(meta["cuts"][i])))
        cuts = {k: list(map(float, v)) for k, v in meta.get("cuts_by_recall", {}).items()}
        bad = [k for k, v in cuts.items() if len(v) != n_layers]
        if bad:
            raise StoreError(f"{mpath}: cuts for recall {bad[0]} cover {len(cuts[bad[0]])} layers, not {n_layers}")
        return cls(
            layers,
            float(meta["sparsity"]),
            list(meta["magnitude_thresholds"]),
            meta.get("metrics", []),
            meta.get("trained_on", ""),
            cuts,
            meta.get("recall", ""),
            meta.get("window_activity", {}),
        )
