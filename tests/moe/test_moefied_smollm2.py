"""The MoE-fied default model (derived, real weights and real routing): streamed experts give the
resident model's 64 greedy tokens and every step's logits bit for bit at 10%, 50% and 100% of the
expert bytes, with the preloader on."""

import os

import numpy as np
import pytest

import mlx_flash
from greedy import greedy
from mlx_flash.calibrate.derive_moe import moefy
from mlx_flash.calibrate.routes import fit_routing_predictor, record_routes
from mlx_flash.moe.routing import PREDICTOR_FILE, model_id


@pytest.fixture(scope="module")
def moefied(tmp_path_factory, default_gguf, wiki_text):
    root = tmp_path_factory.mktemp("moefied")
    out = str(root / "smollm2-moefied")
    # A small calibration (the tool uses 16k tokens): the routing is real either way.
    moefy(
        default_gguf,
        out,
        wiki_text[:40000],
        n_experts=16,
        top_k=8,
        calib_tokens=1024,
        epochs=3,
        cache_dir=str(root / "cache"),
        progress=False,
        log=None,
    )
    return out, str(root / "cache")


@pytest.mark.full  # about 100 s: a MoE-fied model calibrated, then decoded at every budget
def test_moefied_smollm2_streams_exactly_at_every_budget(moefied, wiki_text):
    path, cache = moefied
    kw = dict(backend="torch", cache_dir=cache, progress=False)
    with mlx_flash.load(path, **kw) as e:
        prompt = e.tokenizer.encode(wiki_text[50000:50400])[:24]
        want = greedy(e, prompt, 64)
        routes = record_routes(e, e.tokenizer.encode(wiki_text[60000:70000])[:1024])
        fit_routing_predictor(routes, model_id(e.store), 16).save(os.path.join(e.store.path, PREDICTOR_FILE))
    with mlx_flash.load(path, ffn="stream", weights_budget="100%", io=mlx_flash.IOOptions(mode="buffered"), **kw) as e:
        a = mlx_flash.memory_plan(e)
    fixed = a["resident_weights"]
    for share in (0.1, 0.5, 1.0):
        budget = fixed + max(a["slot_bytes"], int(share * a["all_experts_bytes"]))
        with mlx_flash.load(
            path,
            ffn="stream",
            weights_budget=budget,
            io=mlx_flash.IOOptions(mode="buffered"),
            experts=mlx_flash.ExpertOptions(preload=-1),
            **kw,
        ) as e:
            got = greedy(e, prompt, 64)
            assert e.ffn.preload == 8 and e.ffn.predicted > 0
        assert got[0] == want[0], f"tokens differ at {share:.0%} of expert bytes"
        assert np.array_equal(got[1], want[1])
