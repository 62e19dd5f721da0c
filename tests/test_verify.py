"""`python -m mlx_flash.verify STORE`: exit 0 and a description for a sound store; exit 1 and one
`error: ...` line (no traceback) for a missing, corrupt, truncated or malformed one."""

import os

import pytest

import tiny_models

from mlx_flash.verify import main


def run(capsys, *argv):
    capsys.readouterr()  # drop what building the tiny model printed
    rc = main(["--no-progress", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_sound_store_is_described(tiny_store, capsys):
    store, _ = tiny_store("llama")
    rc, out, err = run(capsys, store)
    assert rc == 0, err
    assert out.startswith(f"store {os.path.abspath(store)}: llama, ")
    assert "ffn_bundles.bin" in out and "tokenizer.json" in out
    assert out.rstrip().endswith("ok: every file matches its manifest")


def corrupt(store):
    with open(os.path.join(store, "ffn_bundles.bin"), "r+b") as fh:
        fh.seek(100)
        b = fh.read(1)
        fh.seek(100)
        fh.write(bytes([b[0] ^ 1]))


def truncate(store):
    path = os.path.join(store, "resident.safetensors")
    os.truncate(path, os.path.getsize(path) - 8)


def drop_layer_count(store):
    tiny_models.edit_manifest(store, lambda m: m["config"].pop("num_hidden_layers"))


@pytest.mark.parametrize(
    "damage, says",
    [
        (corrupt, "sha256 mismatch"),
        (truncate, "truncated or replaced"),
        (drop_layer_count, "config.num_hidden_layers = None: is missing"),
    ],
)
def test_a_bad_store_fails_with_one_line(tiny_store, capsys, damage, says):
    store, _ = tiny_store("llama")
    damage(store)
    rc, out, err = run(capsys, store)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err


def test_not_a_store(tmp_path, capsys):
    rc, _, err = run(capsys, str(tmp_path / "nothing"))
    assert rc == 1 and err == f"error: {tmp_path / 'nothing'}: no such store directory\n"
    rc, _, err = run(capsys, str(tmp_path))
    assert rc == 1 and "not a store" in err and err.count("\n") == 1
