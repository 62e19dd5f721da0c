"""LLM in a flash for dense models: sparsity predictors, per-layer neuron caches with a sliding
window, and the FFN source that streams only the rows each token needs."""
