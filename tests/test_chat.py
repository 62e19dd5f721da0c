"""The chat CLI: one-shot answers on both backends, the REPL over piped stdin, and one-line errors
with a non-zero exit for bad input (no traceback)."""

import os
import subprocess
import sys

import pytest

import tiny_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def chat(*args, stdin=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "mlx_flash.chat", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_one_shot_raw_paris(store_dir, backend):
    r = chat(
        "--model",
        store_dir,
        "--prompt",
        "The capital of France is",
        "--temp",
        "0",
        "--max-tokens",
        "8",
        "--raw",
        "--backend",
        backend,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" Paris"), r.stdout


def test_repl_over_piped_stdin(store_dir):
    r = chat(
        "--model",
        store_dir,
        "--backend",
        "torch",
        "--max-tokens",
        "30",
        stdin="What is the capital of France?\n/stats\n/reset\n/bogus\n/quit\nnever read\n",
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stdout and "per token" in r.stdout
    assert "(conversation cleared)" in r.stdout
    assert "unknown command /bogus" in r.stdout


def assert_one_line_error(r, *needles):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_cli_missing_path(tmp_path):
    assert_one_line_error(chat("--model", str(tmp_path / "nope")), "nope", "no such file")


def test_cli_truncated_gguf(default_gguf, tmp_path):
    bad = tmp_path / "cut.gguf"
    with open(default_gguf, "rb") as fh:
        bad.write_bytes(fh.read(20_000_000))
    r = chat("--model", str(bad), "--prompt", "x", "--raw")
    assert_one_line_error(r, "cut.gguf", "past the end of the file")


def test_cli_unsupported_model_type(tiny_store, tmp_path):
    tiny_store("llama")
    src = tmp_path / "llama-hf"
    tiny_models.edit_config(src, model_type="gpt_neox")
    assert_one_line_error(chat("--model", str(src), "--prompt", "x", "--raw"), "config.json", "'gpt_neox'")


def test_cli_truncated_store_and_edited_manifest(tiny_store):
    store, _ = tiny_store("llama")
    bundles = os.path.join(store, "ffn_bundles.bin")
    size = os.path.getsize(bundles)
    with open(bundles, "r+b") as fh:
        fh.truncate(size - 100)
    assert_one_line_error(chat("--model", store, "--prompt", "x", "--raw"), "ffn_bundles.bin", "truncated")
    with open(bundles, "r+b") as fh:
        fh.truncate(size)
    tiny_models.edit_manifest(
        store,
        lambda m: m["tensors"]["model.embed_tokens.weight"].__setitem__(
            "offset", m["tensors"]["model.embed_tokens.weight"]["offset"] + 10**9
        ),
    )
    assert_one_line_error(
        chat("--model", store, "--prompt", "x", "--raw"),
        "resident.safetensors",
        "model.embed_tokens.weight",
        "past the end",
    )


def test_cli_usage_error():
    r = chat("--raw")
    assert r.returncode == 2 and "--raw needs --prompt" in r.stderr


def test_repl_survives_a_line_that_is_not_utf8(store_dir):
    """Case 5 of the hardening probe: one undecodable line ended the session."""
    r = subprocess.run(
        [sys.executable, "-m", "mlx_flash.chat", "--model", store_dir, "--backend", "torch", "--max-tokens", "20"],
        input=b"caf\xe9 \xff\xfe?\nWhat is the capital of France?\n",
        capture_output=True,
        timeout=300,
        cwd=ROOT,
    )
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr.decode()
    assert "error: that line is not valid UTF-8; nothing was sent" in out
    assert "Paris" in out.split("not valid UTF-8")[1]  # the next turn is answered


def test_repl_drops_the_oldest_turns_when_the_conversation_outgrows_the_context(store_dir):
    turns = [f"Tell me one fact about the number {n}, in a long sentence about mathematics." for n in range(7)]
    r = chat(
        "--model",
        store_dir,
        "--backend",
        "torch",
        "--max-tokens",
        "24",
        "--context",
        "160",
        stdin="\n".join(turns + ["What is the capital of France?"]) + "\n",
    )
    assert r.returncode == 0, r.stderr
    assert "outgrew the context: its oldest" in r.stdout
    assert "Paris" in r.stdout.split("outgrew the context")[-1]
    assert "Traceback" not in r.stderr


def test_a_flipped_block_in_the_bundles_is_refused_before_any_answer(tiny_store):
    """Case 1: 64 KiB flipped in the middle of ffn_bundles.bin, size unchanged, answered garbage."""
    store, _ = tiny_store("llama")
    assert chat("--model", store, "--prompt", "x", "--raw", "--max-tokens", "2").returncode == 0  # stamped
    bundles = os.path.join(store, "ffn_bundles.bin")
    size = os.path.getsize(bundles)
    n = min(64 << 10, size // 2)
    with open(bundles, "r+b") as fh:
        fh.seek(size // 2 - n // 2)
        block = fh.read(n)
        fh.seek(size // 2 - n // 2)
        fh.write(bytes(b ^ 0x5A for b in block))
    assert os.path.getsize(bundles) == size
    assert_one_line_error(chat("--model", store, "--prompt", "x", "--raw"), "ffn_bundles.bin", "sha256 mismatch")


def test_the_repl_holds_a_conversation_longer_than_the_kv_share(store_dir, wiki_text):
    """MLX under 420 MB keeps about 900 tokens resident: a first turn of about 1,300 tokens and a
    question on it are answered in one conversation of the model's whole context (its older KV on
    flash), with the answers a run without a limit gives (greedy), and /stats says what was read back."""
    turns = wiki_text[:6000].replace("\n", " ") + " Summarize the text above in one sentence.\nWho is named in it?\n"
    base = ["--model", store_dir, "--backend", "mlx", "--max-tokens", "16", "--temp", "0"]
    tight = chat(*base, "--memory-budget", "420MB", stdin=turns + "/stats\n", timeout=600)
    free = chat(*base, stdin=turns, timeout=600)
    assert tight.returncode == 0 and free.returncode == 0, tight.stderr[-2000:] + free.stderr[-2000:]
    answers, stats = tight.stdout.split("\nprompt ")[0], tight.stdout.split("KV:")[-1]  # (/stats begins "prompt")
    assert answers.strip() and answers.rstrip() == free.stdout.rstrip(), (tight.stdout, free.stdout)
    assert "outgrew" not in tight.stdout
    assert "tokens resident of a 8192-token context, the older ones on flash" in stats
    assert int(stats.split("flash (")[1].split(" MB")[0]) > 0  # MB read back since load
