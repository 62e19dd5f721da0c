"""A model's plan at load (memory/load_plan.py) where a long context keeps its older KV on flash: the
disk under the KV tier folder (<cache_dir>/kv) cuts the context to what it holds and the plan says so,
naming the folder; a prompt longer than that context is refused naming the disk, not the model's
context; a folder that is a plain file is refused at load, in one line (and so by the chat CLI)."""

import os

import pytest

import mlx_flash
import tiny_models
from mlx_flash.batching.prompts import encode_all
from mlx_flash.config import Backend, EngineConfig
from mlx_flash.errors import ContextLengthError
from mlx_flash.memory import ModelShape, load_plan
from mlx_flash.memory.limit import MemoryLimit
from mlx_flash.store import open_store
from mlx_flash.store.kv_tier_file import KVTierError

MB = 10**6
CONTEXT = 8192
# a tiny llama whose KV is large beside its attention (8 layers of 4 KV heads of 64: 16 KiB a token), so
# that under LIMIT its KV share holds about 1,800 tokens and the tiers the model's 8192
MODEL = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=8, max_position_embeddings=CONTEXT
)
LIMIT, FLOOR = MemoryLimit(300 * MB, "given"), 50 * MB


@pytest.fixture
def store(tiny_store) -> str:
    return tiny_store("llama", **MODEL)[0]


@pytest.fixture
def tiered(store, tmp_path, monkeypatch):
    """Factory: the plan of MODEL under `limit`, the process's RSS taken as FLOOR and the disk of the
    tier folder as having `free` bytes -> (plan, the tier folder)."""
    opened = open_store(store, False, False)
    monkeypatch.setattr(load_plan, "process_rss", lambda: FLOOR)  # a plan that does not move with this process

    def plan(free: int, limit: MemoryLimit = LIMIT, **options):
        monkeypatch.setattr(load_plan, "_disk_free", lambda folder: free)
        cfg = EngineConfig(backend=Backend.TORCH, cache_dir=str(tmp_path / "cache"), **options)
        shape = ModelShape.from_config(opened.config)
        return load_plan.plan_load(cfg, opened, limit, shape, CONTEXT, True), os.path.join(cfg.cache_dir, "kv")

    return plan


def test_room_on_the_disk_holds_the_models_context_and_says_nothing_of_it(tiered):
    planned, _ = tiered(10**12)
    assert planned.tiers is not None and planned.tiers.context == CONTEXT
    assert planned.process.disk_short == "" and "not 8192" not in planned.process.line("x")


def test_a_disk_that_holds_part_of_the_context_cuts_it_and_the_plan_says_so(tiered):
    """40 MB hold 2441 tokens of 16 KiB: a context of 2432 (whole moves to flash), the load line and the
    account naming the folder, what is free, the context held and what 8192 would need."""
    planned, folder = tiered(40 * MB)
    plan = planned.process
    assert planned.tiers is not None and planned.tiers.context == plan.context == 2432 > plan.kv_tokens
    words = f"the KV tier folder {folder} has 40.0 MB free, enough for 2432 tokens (a context of 8192 needs 134.2 MB)"
    assert plan.account()["kv_disk_short"] == words
    assert f"; context 2432 tokens, not 8192: {words}" in plan.line("x")


def test_a_full_disk_leaves_what_memory_holds_and_the_plan_says_so(tiered):
    planned, folder = tiered(0)
    plan = planned.process
    assert planned.tiers is None and 0 < plan.context < CONTEXT
    assert plan.disk_short == (
        f"the KV tier folder {folder} has 0.0 MB free, enough for {plan.context} tokens "
        "(a context of 8192 needs 134.2 MB)"
    )


def test_a_context_asked_for_that_the_disk_cannot_hold_is_refused_naming_the_folder(tiered):
    """(under 220 MB the model's context, asked for, is held with tiers only)"""
    planned, _ = tiered(10**12, MemoryLimit(220 * MB, "given"), context=CONTEXT)
    assert planned.tiers is not None and planned.tiers.context == CONTEXT
    with pytest.raises(mlx_flash.ConfigError) as e:
        tiered(40 * MB, MemoryLimit(220 * MB, "given"), context=CONTEXT)
    folder = e.value.args[0].split("the KV tier folder ")[1].split(" has ")[0]
    assert folder.endswith(os.path.join("cache", "kv"))
    assert str(e.value).endswith(
        "enough for 2432 tokens (a context of 8192 needs 134.2 MB); free some, or lower --context"
    )


def test_a_tier_folder_that_is_a_file_is_refused_at_load(tiered, tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kv").write_text("not a folder")
    with pytest.raises(KVTierError) as e:
        tiered(10**12)
    folder = str(tmp_path / "cache" / "kv")
    assert str(e.value) == f"KV on flash: {folder}: {folder} is a file, not a folder"
    planned, _ = tiered(10**12, kv_on_flash=False)  # a plan without tiers never uses the folder
    assert planned.tiers is None


def test_a_prompt_longer_than_the_context_the_disk_left_is_refused_naming_the_disk(store, tiered):
    """The engine as api.load assembles it from the plan (its KV plan and account): the refusal says
    the disk is what holds the context short, and a prompt within it is answered."""
    planned, folder = tiered(0)
    plan = planned.process
    with mlx_flash.load(store, backend="torch", progress=False) as e:
        e.kv_tokens, e.kv_tiers = plan.kv_tokens, planned.tiers
        e.memory_plan.update(plan.account())
        n = plan.kv_tokens + 10
        with pytest.raises(ContextLengthError) as refused:
            next(e.stream_tokens(tiny_models.random_ids(n), max_tokens=1))
        assert str(refused.value) == f"the prompt has {n} tokens; {plan.disk_short}"
        assert f"the KV tier folder {folder} has 0.0 MB free, enough for {plan.kv_tokens} tokens" in str(refused.value)
        with pytest.raises(ContextLengthError) as refused:  # a batch's prompts say the same
            encode_all(e, [e.tokenizer.decode(tiny_models.random_ids(2 * n))], 1)
        assert str(refused.value).startswith("prompt 0 has ") and str(refused.value).endswith(
            f"tokens; {plan.disk_short}"
        )
        e.kv_tokens = None  # the plan without the cut: the old refusal
        e.memory_plan["kv_disk_short"] = ""
        with pytest.raises(
            ContextLengthError, match=f"the prompt has {CONTEXT} tokens; the model's context is {CONTEXT}"
        ):
            next(e.stream_tokens([3] * CONTEXT, max_tokens=1))


def test_the_chat_names_the_tier_folder_in_its_help_and_refuses_a_file_there_in_one_line(
    store, tmp_path, monkeypatch, capsys
):
    """--cache-dir is where the KV tier folder is (its help says so); a plain file there stops the chat
    at load: one `error:` line naming it, a non-zero exit, no traceback."""
    from mlx_flash.cli import chat

    with pytest.raises(SystemExit):
        chat.parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--cache-dir" in shown and "older KV (KV tiers, in its kv folder)" in shown
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kv").write_text("not a folder")
    for where in (load_plan, mlx_flash.api):  # the plan under LIMIT as above, whatever this process holds
        monkeypatch.setattr(where, "process_rss", lambda: FLOOR)
    argv = ["--model", store, "--backend", "torch", "--memory-budget", "300MB", "--cache-dir", str(tmp_path / "cache")]
    assert chat.main(argv + ["--prompt", "x", "--raw"]) != 0
    err = capsys.readouterr().err
    folder = str(tmp_path / "cache" / "kv")
    assert f"error: KV on flash: {folder}: {folder} is a file, not a folder\n" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1
