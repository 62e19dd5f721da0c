"""`python -m mlx_flash.serve --long-context` under a memory budget whose KV share holds fewer tokens
than a conversation: each conversation holds the model's whole context, its older KV on flash (KV
tiers, service/sequences.TieredConversations), one request at a time. A stateless client's two turns
over a ~1,300-token text get the answers an unconstrained engine gives, the second turn reusing the
first's KV."""

from __future__ import annotations

import pytest

from live_server import CHAT, chat_body, start, stop

pytestmark = pytest.mark.slow


def test_a_conversation_longer_than_the_kv_share_through_the_server(store_dir, tmp_path, engines, wiki_text):
    engine = engines(store_dir, "mlx")
    srv = start(store_dir, str(tmp_path), "--long-context", "--backend", "mlx", "--memory-budget", "420MB")
    try:
        assert "the older tokens on flash" in srv.log_text()
        history = [{"role": "user", "content": wiki_text[:6000] + "\nSummarize the text above in one sentence."}]
        for k, follow_up in enumerate(["Who is named in it?", None]):
            status, _, out = srv.request("POST", CHAT, chat_body(history, max_tokens=12), timeout=600)
            assert status == 200, out
            text = out["choices"][0]["message"]["content"]
            assert text == engine.generate(history, max_tokens=12), (k, text)
            assert out["usage"]["prompt_tokens"] > 1000
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached > 1000 if k else cached == 0, (k, cached)
            if follow_up is None:
                break
            history += [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]
        assert srv.stats()["contexts"]["total"] == 1
    finally:
        assert stop(srv) == 0, srv.log_text()[-4000:]
