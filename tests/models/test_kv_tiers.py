"""KV tiers (models/kv_tiers.py): a sequence whose older tokens are on flash answers bit for bit what
the all-resident cache answers, on both backends: the logits of a prefill in chunks and of each
decoded token, across the window's moves to flash, after a trim that reaches into the tokens on
flash, and the held state. Then through the public path: the default model under a memory budget
whose KV share holds fewer tokens than a long prompt plans the tiers, says so, and answers that
prompt with the tokens an unconstrained run gives."""

import subprocess
import sys

import numpy as np
import pytest

import mlx_flash
import tiny_models
from mlx_flash.errors import ConfigError
from mlx_flash.memory import ModelShape
from mlx_flash.models.kv_coded_blocks import BlockFormat
from mlx_flash.models.kv_tiers import EVICT_STEP, CodedTieredKV, TierPlan, TieredKV
from mlx_flash.store.kv_tier_file import KVBlockFile, KVTierFile

CHUNK = 16


def _plan(e, tmp_path, window: int) -> TierPlan:
    """Tiers of `window` tokens beside a chunk, a context of 400, the file under tmp_path/kv."""
    s = ModelShape.from_config(e.store.config)
    folder = str(tmp_path / "kv")
    return TierPlan(
        window,
        CHUNK,
        400,
        s.layers,
        s.kv_heads,
        s.head_dim,
        lambda: KVTierFile(folder, s.layers, s.kv_heads, s.head_dim, 400),
    )


def _run(e, ids, steps, trim):
    """Logits of: a prefill of ids, `steps` greedy tokens, a trim of `trim` tokens, `steps` more;
    with the caches' held state at the end."""
    caches = e.new_caches()
    out = [e.prefill(ids, caches, all_logits=True)]
    tok = int(np.argmax(out[-1][-1]))
    for i in range(2 * steps):
        if i == steps:
            e.runner.trim(caches, caches[0].offset - trim)
        out.append(e.forward([tok], caches))
        tok = int(np.argmax(out[-1][-1]))
    return np.concatenate(out), caches


@pytest.mark.parametrize("backend,layers", [("mlx", 3), ("torch", 3), ("torch", 2)])
def test_tiers_answer_what_the_resident_cache_answers_bit_for_bit(tiny_store, tmp_path, backend, layers):
    """(torch reads the next layer ahead, round to the next token's first layer with an even count)"""
    store, _ = tiny_store("llama", max_position_embeddings=512, num_hidden_layers=layers)
    ids = tiny_models.random_ids(150, seed=7)
    with mlx_flash.load(store, backend=backend, progress=False, prefill_chunk=CHUNK) as e:
        e.kv_tiers = None
        want, resident = _run(e, ids, 40, 120)
        # a window longer than a move to flash (EVICT_STEP): moves keep some tokens resident and shift them
        e.kv_tiers = _plan(e, tmp_path, window=EVICT_STEP + 26)
        got, tiered = _run(e, ids, 40, 120)
    assert isinstance(tiered[0], TieredKV)
    assert tiered[0].flushed > 0 and tiered[0].resident <= EVICT_STEP + 26 + CHUNK  # the older tokens were on flash
    assert np.array_equal(got, want)
    for a, b in zip(tiered, resident):
        for x, y in zip(a.state(None), b.state(e.ops)):
            assert np.array_equal(x, y)
    assert list((tmp_path / "kv").iterdir()) == []  # the file has no name: nothing to clean up after a kill


def test_a_forward_longer_than_the_window_is_refused_naming_both(tiny_store, tmp_path):
    store, _ = tiny_store("llama", max_position_embeddings=512)
    with mlx_flash.load(store, backend="torch", progress=False, prefill_chunk=64) as e:
        e.kv_tiers = _plan(e, tmp_path, window=24)
        with pytest.raises(ValueError, match="64 new tokens at once exceed the KV window of 40"):
            e.prefill(tiny_models.random_ids(100), e.new_caches())


@pytest.mark.slow
def test_a_prompt_longer_than_the_kv_share_is_answered_as_without_a_limit(store_dir, wiki_text):
    """MLX under 420 MB: the KV share holds about 900 tokens; a 1,500-token prompt is answered with the
    tokens of a run without a limit (greedy), the plan line naming the tiers."""
    prompt = wiki_text[:6000] + "\nSummarize the text above in one sentence."
    base = [sys.executable, "-m", "mlx_flash.chat", "--model", store_dir, "--backend", "mlx"]
    base += ["--prompt", prompt, "--max-tokens", "12", "--temp", "0"]
    tight = subprocess.run(base + ["--memory-budget", "420MB"], capture_output=True, text=True, timeout=600)
    free = subprocess.run(base, capture_output=True, text=True, timeout=600)
    assert tight.returncode == 0, tight.stderr[-2000:]
    assert "of read buffers for a 8192-token context, the older tokens on flash" in tight.stderr, tight.stderr[-2000:]
    assert free.returncode == 0 and tight.stdout == free.stdout and tight.stdout.strip(), (tight.stdout, free.stdout)


def _coded_plan(e, tmp_path, window: int, bits: int) -> TierPlan:
    """As _plan, the tokens on flash compressed to `bits` in blocks of EVICT_STEP tokens."""
    s = ModelShape.from_config(e.store.config)
    folder, fmt = str(tmp_path / "kv"), BlockFormat(bits, s.kv_heads, s.head_dim, EVICT_STEP)
    return TierPlan(
        window, CHUNK, 400, s.layers, s.kv_heads, s.head_dim,
        lambda: KVBlockFile(folder, s.layers, EVICT_STEP, fmt.nbytes, 400), coded=fmt,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_compressed_tiers_attend_over_the_codes_as_over_their_decoded_values(tiny_store, tmp_path, backend):
    """Attention over the blocks where the read put them equals the float kernel over the decoded
    tokens and the window bit for bit; the answers stay near the exact ones (4 bits), not equal to
    them; a trim into the blocks keeps the decoded prefix."""
    store, _ = tiny_store("llama", max_position_embeddings=512, num_hidden_layers=2)
    ids = tiny_models.random_ids(150, seed=7)
    with mlx_flash.load(store, backend=backend, progress=False, prefill_chunk=CHUNK) as e:
        e.kv_tiers = None
        want, _ = _run(e, ids, 10, 0)
        e.kv_tiers = _coded_plan(e, tmp_path, EVICT_STEP, bits=4)
        got, tiered = _run(e, ids, 10, 0)
        ops, layer = e.ops, tiered[1]
        assert isinstance(layer, CodedTieredKV) and layer.flushed >= 2 * EVICT_STEP
        rng = np.random.default_rng(0)
        H, D = layer.seq.shape
        k, v = (ops.array(rng.standard_normal((1, H, 1, D)).astype(np.float32)) for _ in range(2))
        q = ops.array(rng.standard_normal((1, 2 * H, 1, D)).astype(np.float32))
        keys, values = layer.update(ops, k, v)
        y = ops.to_numpy(layer.attention(ops, q, keys, values, D**-0.5, "causal"))
        K, V = layer.state(ops)
        assert K.shape[2] == layer.offset and keys.shape[2] == layer.resident
        want_y = ops.to_numpy(ops.sdpa(q, ops.array(K), ops.array(V), D**-0.5, "causal"))
        assert np.array_equal(y, want_y)
        before, held = layer.state(ops), layer.offset
        cut = layer.resident + 40
        layer.trim(cut)  # into the last block on flash: its kept part comes back resident
        assert layer.offset == held - cut and 0 < layer.resident < EVICT_STEP and layer.flushed % EVICT_STEP == 0
        for a, b in zip(layer.state(ops), before):
            assert np.array_equal(a, b[:, :, : layer.offset])
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < err < 0.05, err


def test_compressed_tiers_are_refused_for_sliding_window_layers(tiny_store):
    store, _ = tiny_store("gemma3_text")
    with pytest.raises(ConfigError, match="kv_flash_bits 4: gemma3_text's sliding-window layers"):
        mlx_flash.load(store, backend="torch", progress=False, kv_flash_bits=4)
