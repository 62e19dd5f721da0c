"""Conversations held on every rank (distributed/conversations.py): room for a call's KV under the
ranks' plans, made by dropping idle conversations' KV, else refused. On a pipeline of one rank."""

import pytest
from one_rank import OneRank

from mlx_flash.distributed.conversations import PipelineConversations
from mlx_flash.distributed.pipeline import Pipeline
from mlx_flash.errors import MemoryBudgetError


@pytest.fixture
def conversations(store_dir):
    import mlx_flash

    local = mlx_flash.load(store_dir, backend="torch")
    e = local.with_runner(Pipeline(local, OneRank(), [range(local.args.num_hidden_layers)], kv_tokens=[600]))
    try:
        with PipelineConversations(e) as svc:
            yield svc
    finally:
        local.close()  # (the pipeline of one rank has no other rank to stop)


def answer(svc, ctx, prompt, max_tokens):
    return "".join(step.text for step in svc.call(ctx, prompt, max_tokens=max_tokens))


# ~20 s (a 260-token answer); the refusal below keeps the room-making code in the default tier
@pytest.mark.full
def test_an_idle_conversations_kv_makes_room_and_is_prefilled_again(conversations):
    svc = conversations
    e = svc.engine
    a, b = svc.new_context(), svc.new_context()
    first = answer(svc, a, "The capital of France is", 8)
    assert first == e.generate("The capital of France is", max_tokens=8)
    assert svc.get(a).caches[0].keys.shape[2] == 256  # its buffers: one 256-token step
    answer(svc, b, "Once upon a time", 260)  # room for 264 tokens: 256 + 512 > 600, so a's KV goes
    assert svc.evicted == 1 and svc.get(a).held == [] and svc.get(a).caches[0].offset == 0
    assert svc.get(a).sequence  # its text stays: the next call prefills it again
    more = answer(svc, a, " Its largest river is", 8)
    assert more == e.generate("The capital of France is" + first + " Its largest river is", max_tokens=8)


def test_a_call_the_ranks_cannot_hold_beside_running_ones_is_refused(conversations):
    svc = conversations
    a, b = svc.new_context(), svc.new_context()
    running = svc.get(b)
    running.busy, running.reserved = True, 400  # a call in flight that may fill 400 tokens (512 of buffers)
    with pytest.raises(MemoryBudgetError, match=r"need 1024 tokens; the ranks' memory plans hold 600"):
        svc.call(a, "Hello", max_tokens=300)
    running.busy = False
    assert answer(svc, a, "Hello", 4)  # once it is idle, it is dropped to make room
