"""Offline work that prepares what inference reads: calibration text, activation capture, sparsity
predictor training, MoE-fication, routing traces, expert bit-widths, synthetic stores, perplexity.
Nothing on the per-token path imports this package (tests/test_layering.py checks it).

Public surface (what the tools and notebooks call):
  corpora             corpus_path, read_corpus, fetch_all: the offline Austen / Wikipedia texts
  perplexity_eval     perplexity(engine, text, ...), token_nlls
  activations         collect (x and |h| per layer), magnitude_thresholds, window_activity
  read_unit           OracleUnits: the read unit's quality cost (python -m mlx_flash.bench read-unit)
  predictor_training  train_predictors, measure_activity, summarize (-> sparse.predictor.Predictors)
  derive_moe          moefy: a dense model -> a MoE-fied HF-style directory (method: moefication)
  routes              record_routes, decode_trace, fit_routing_predictor, routing_accuracy
  expert_bits         choose_widths (importance + width search), ExpertSwapper and its steps
  mixed_store         expert_rows, write_expert_store: a store with experts at per-expert widths
  synthetic           make_synthetic_store, SHAPES, StatisticalActivity: random-weight stores of big shapes
  synthetic_gguf      write_synthetic_gguf: random-weight GGUF checkpoints of big shapes (Q4_1/Q4_0/Q8_0)
  io_replay           replay: I/O-only replay of the sparse FFN path on a store
  thresholds          sparsity_thresholds, calibrate: activation-sparsity thresholds (sparse/thresholds.py)
"""

from .activations import collect, magnitude_thresholds, window_activity
from .corpora import corpus_path, fetch_all, read_corpus
from .derive_moe import moefy
from .expert_bits import ExpertSwapper, assign_widths, choose_widths, importance, perplexity_at, uniform_widths
from .io_replay import replay
from .mixed_store import expert_rows, write_expert_store
from .perplexity_eval import perplexity, token_nlls
from .read_unit import OracleUnits
from .predictor_training import measure_activity, summarize, train_predictors
from .routes import decode_trace, fit_routing_predictor, record_routes, routing_accuracy
from .synthetic import SHAPES, StatisticalActivity, make_synthetic_store
from .synthetic_gguf import write_synthetic_gguf
from .thresholds import sparsity_thresholds

__all__ = [
    "sparsity_thresholds",
    "corpus_path",
    "read_corpus",
    "fetch_all",
    "perplexity",
    "token_nlls",
    "collect",
    "magnitude_thresholds",
    "window_activity",
    "train_predictors",
    "measure_activity",
    "summarize",
    "moefy",
    "record_routes",
    "decode_trace",
    "fit_routing_predictor",
    "routing_accuracy",
    "choose_widths",
    "ExpertSwapper",
    "uniform_widths",
    "importance",
    "assign_widths",
    "perplexity_at",
    "expert_rows",
    "write_expert_store",
    "make_synthetic_store",
    "SHAPES",
    "StatisticalActivity",
    "write_synthetic_gguf",
    "replay",
    "OracleUnits",
]
