"""Hub names (mlx_flash/locate/hub.py): a local path wins; then the Hugging Face cache, laid out on
disk here as huggingface_hub lays it out (HF_HUB_CACHE, offline); then a download from a loopback
hub (HF_ENDPOINT): the file lands in the cache with a progress bar, and a transfer that breaks off
is resumed with a Range request, not started again."""

import hashlib
import os

import pytest

from fake_hub import COMMIT, FakeHub
from mlx_flash.errors import ConfigError, ModelNotFoundError
from mlx_flash.locate.hub import resolve


def lay_out(cache: str, repo: str, files: dict, commit: str = COMMIT) -> str:
    """A repository in the Hugging Face cache layout: blobs named by hash, a snapshot of links to them,
    refs/main naming the snapshot. `files`: name -> bytes, or a path whose file the blob links to."""
    base = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snap = os.path.join(base, "snapshots", commit)
    os.makedirs(os.path.join(base, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(base, "refs"), exist_ok=True)
    for name, data in files.items():
        blob = os.path.join(base, "blobs", hashlib.sha256(name.encode()).hexdigest())
        if isinstance(data, bytes):
            with open(blob, "wb") as f:
                f.write(data)
        else:
            os.symlink(os.path.abspath(data), blob)
        link = os.path.join(snap, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    with open(os.path.join(base, "refs", "main"), "w") as f:
        f.write(commit)
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    cache = str(tmp_path / "hf" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    return cache


QUANTS = {f"m-{q}.gguf": q.encode() for q in ("Q8_0", "Q4_K_M", "Q5_K_S")}


def test_a_cached_gguf_repository_by_quant_and_by_the_default_rule(hf_cache, capsys):
    snap = lay_out(hf_cache, "org/m-GGUF", QUANTS)
    assert resolve("org/m-GGUF:Q8_0") == os.path.join(snap, "m-Q8_0.gguf")
    assert resolve("org/m-GGUF:q5_k_s") == os.path.join(snap, "m-Q5_K_S.gguf")  # (any case)
    assert resolve("org/m-GGUF") == os.path.join(snap, "m-Q4_K_M.gguf")
    assert "org/m-GGUF: Q4_K_M (the first of Q4_K_M" in capsys.readouterr().err


def test_a_missing_quant_names_those_there(hf_cache):
    lay_out(hf_cache, "org/m-GGUF", QUANTS)
    with pytest.raises(
        ModelNotFoundError,
        match="org/m-GGUF:IQ2_XS: the repository has no IQ2_XS GGUF \\(its quants: Q4_K_M, Q5_K_S, Q8_0\\)",
    ):
        resolve("org/m-GGUF:IQ2_XS")


def test_no_default_quant_among_several_asks_for_one(hf_cache):
    lay_out(hf_cache, "org/m-GGUF", {"m-Q5_K_S.gguf": b"a", "m-Q6_K.gguf": b"b"})
    with pytest.raises(ConfigError, match="several GGUF quants \\(Q5_K_S, Q6_K\\); name one, as org/m-GGUF:QUANT"):
        resolve("org/m-GGUF")


def test_a_split_gguf_gives_its_first_part_with_every_part_there(hf_cache):
    parts = {f"big-Q4_K_M-0000{i}-of-00003.gguf": bytes([i]) for i in (2, 1, 3)}
    snap = lay_out(hf_cache, "org/big", parts)
    assert resolve("org/big:Q4_K_M") == os.path.join(snap, "big-Q4_K_M-00001-of-00003.gguf")


def test_an_hf_folder_repository(hf_cache):
    files = {"config.json": b"{}", "model.safetensors": b"x", "tokenizer.json": b"{}", "README.md": b"r"}
    snap = lay_out(hf_cache, "org/plain", files)
    assert resolve("org/plain") == snap
    with pytest.raises(ConfigError, match="holds no GGUF files, and a :Q4_0 names a GGUF quant"):
        resolve("org/plain:Q4_0")


def test_a_local_path_wins_over_a_hub_name(hf_cache, tmp_path, monkeypatch):
    lay_out(hf_cache, "org/m-GGUF", QUANTS)
    monkeypatch.chdir(tmp_path)
    os.makedirs("org/m-GGUF")
    assert resolve("org/m-GGUF") == str(tmp_path / "org" / "m-GGUF")


def test_offline_and_not_cached_is_one_line(hf_cache):
    with pytest.raises(ModelNotFoundError) as e:
        resolve("org/absent")
    assert str(e.value) == f"org/absent: not in the Hugging Face cache ({hf_cache}), and HF_HUB_OFFLINE is set"
    with pytest.raises(ModelNotFoundError, match="no such file or directory$"):
        resolve("not a/hub name/at all")


@pytest.mark.slow
@pytest.mark.full
def test_load_answers_offline_from_a_cached_repository(hf_cache, default_gguf, tmp_path):
    """The default model's GGUF in the cache as org/name: load() by that name and by name:Q4_1 give the
    same greedy tokens as the file itself. Full tier: it converts the model three times, and CI's
    wheel check has the installed chat answer by that hub name offline in every run."""
    from mlx_flash import load

    lay_out(hf_cache, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", {"smollm2-135m-instruct-Q4_1.gguf": default_gguf})
    cache = str(tmp_path / "stores")
    want = load(default_gguf, cache_dir=cache, progress=False).generate("The capital of France is", max_tokens=8)
    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"):
        engine = load(name, cache_dir=cache, progress=False)
        assert engine.generate("The capital of France is", max_tokens=8) == want


@pytest.fixture
def hub(tmp_path, monkeypatch):
    made = []

    def start(repos, cut_after=0, **listing):
        h = FakeHub(repos, cut_after, **listing)
        made.append(h)
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        return h

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    yield start
    for h in made:
        h.close()


DATA = os.urandom(3 << 20)


def test_download_into_the_cache_with_a_progress_bar(hub, capfd):
    h = hub({"org/m-GGUF": {"m-Q4_0.gguf": DATA, "m-Q8_0.gguf": b"other"}})
    path = resolve("org/m-GGUF:Q4_0")
    with open(path, "rb") as f:
        assert f.read() == DATA
    assert path.startswith(os.environ["HF_HUB_CACHE"]) and COMMIT in path
    err = capfd.readouterr().err
    assert "downloading org/m-GGUF/m-Q4_0.gguf into" in err and "100%" in err
    assert not any("m-Q8_0" in p for _, p, _ in h.requests)  # only the quant asked for
    n = len(h.requests)
    assert resolve("org/m-GGUF:Q4_0") == path and len(h.requests) == n  # cached now: no request at all


def test_a_transfer_that_breaks_off_is_resumed(hub):
    """The connection drops after 3 MB of 6: the retry asks for the rest only (from the last whole
    piece written), and the file is whole."""
    data = os.urandom(6 << 20)
    h = hub({"org/m-GGUF": {"m-Q4_0.gguf": data}}, cut_after=3 << 20)
    path = resolve("org/m-GGUF:Q4_0", progress=False)
    with open(path, "rb") as f:
        assert f.read() == data
    gets = [r for m, p, r in h.requests if m == "GET" and p.endswith("m-Q4_0.gguf")]
    assert len(gets) == 2 and gets[0] is None
    assert 2 << 20 <= int(gets[1].removeprefix("bytes=").rstrip("-")) <= 3 << 20


def test_a_partial_file_an_earlier_run_left_is_resumed(hub):
    """A download stopped half-way (Ctrl-C, a dropped network) leaves its bytes in the cache; the next
    run asks only for the rest."""
    h = hub({"org/m-GGUF": {"m-Q4_0.gguf": DATA}})
    blobs = os.path.join(os.environ["HF_HUB_CACHE"], "models--org--m-GGUF", "blobs")
    os.makedirs(blobs)
    with open(os.path.join(blobs, hashlib.sha256(DATA).hexdigest() + ".incomplete"), "wb") as f:
        f.write(DATA[: 1 << 20])
    path = resolve("org/m-GGUF:Q4_0", progress=False)
    with open(path, "rb") as f:
        assert f.read() == DATA
    assert [r for m, p, r in h.requests if m == "GET" and p.endswith("m-Q4_0.gguf")] == [f"bytes={1 << 20}-"]


def test_a_repository_the_hub_does_not_have(hub):
    hub({})
    with pytest.raises(
        ModelNotFoundError, match="org/absent: not in the Hugging Face cache .*, and the hub was not found"
    ):
        resolve("org/absent")


def test_an_unreachable_hub_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(
        ModelNotFoundError, match="org/m: not in the Hugging Face cache .*, and the hub cannot be reached"
    ):
        resolve("org/m")


def test_an_unreachable_hub_leaves_the_cached_repository_answering(hf_cache, monkeypatch):
    lay_out(hf_cache, "org/m-GGUF", {"m-Q4_0.gguf": b"q4"})
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert resolve("org/m-GGUF").endswith("m-Q4_0.gguf")


def test_a_listing_in_several_pages_is_read_to_its_end(hub):
    """The hub pages a large repository's list (Link: rel="next"); the quant on the last page is found."""
    h = hub({"org/m-GGUF": {"README.md": b"r", "m-Q8_0.gguf": b"q8", "m-Q4_K_M.gguf": b"q4"}}, page=1)
    with open(resolve("org/m-GGUF", progress=False), "rb") as f:
        assert f.read() == b"q4"
    assert sum(1 for m, p, _ in h.requests if p.endswith("/tree/main")) == 3


def test_a_gated_repository_says_to_log_in(hub):
    hub({"org/g": {"m-Q4_0.gguf": b"q4"}}, gated=("org/g",))
    with pytest.raises(ModelNotFoundError, match="org/g: .*the hub is gated \\(log in with `hf auth login`\\)$"):
        resolve("org/g")


def _lose_blob(snap: str, name: str) -> str:
    """Delete the blob the snapshot link `name` points to, as a cache cleaned by hand leaves it; the blob's path."""
    link = os.path.join(snap, name)
    blob = os.path.normpath(os.path.join(os.path.dirname(link), os.readlink(link)))
    os.remove(blob)
    return blob


def test_a_link_to_a_missing_blob_is_named_offline(hf_cache):
    snap = lay_out(hf_cache, "org/m-GGUF", {"m-Q4_0.gguf": b"q4"})
    blob = _lose_blob(snap, "m-Q4_0.gguf")
    for name in ("org/m-GGUF", "org/m-GGUF:Q4_0"):
        with pytest.raises(ModelNotFoundError) as e:
            resolve(name, progress=False)
        assert str(e.value) == (
            f"org/m-GGUF/m-Q4_0.gguf: the cached link {os.path.join(snap, 'm-Q4_0.gguf')} points to the blob "
            f"{blob}, which is missing, and HF_HUB_OFFLINE is set; unset it to download the file again, "
            f"or remove the snapshot {snap}"
        )
    folder = lay_out(hf_cache, "org/plain", {"config.json": b"{}", "model.safetensors": b"x"})
    blob = _lose_blob(folder, "model.safetensors")
    with pytest.raises(ModelNotFoundError, match=f"org/plain/model.safetensors: .* the blob {blob}, which is missing"):
        resolve("org/plain")


def test_a_link_to_a_missing_blob_is_named_when_the_hub_cannot_be_reached(hf_cache, monkeypatch):
    snap = lay_out(hf_cache, "org/m-GGUF", {"m-Q4_0.gguf": b"q4"})
    blob = _lose_blob(snap, "m-Q4_0.gguf")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(ModelNotFoundError) as e:
        resolve("org/m-GGUF", progress=False)
    said = str(e.value)
    assert said.startswith(f"org/m-GGUF/m-Q4_0.gguf: the cached link {os.path.join(snap, 'm-Q4_0.gguf')} points")
    assert f"the blob {blob}, which is missing, and downloading it again failed (" in said
    assert said.endswith(f"run again when the hub answers, or remove the snapshot {snap}") and "\n" not in said


def test_a_link_to_a_missing_blob_is_downloaded_again(hub):
    """The blob a link names is the file's version (its ETag): fetching that version fills the link."""
    data = b"q4 bytes"
    hub({"org/m-GGUF": {"m-Q4_0.gguf": data}})
    base = os.path.join(os.environ["HF_HUB_CACHE"], "models--org--m-GGUF")
    link = os.path.join(base, "snapshots", COMMIT, "m-Q4_0.gguf")
    os.makedirs(os.path.dirname(link))
    os.symlink(os.path.join("..", "..", "blobs", hashlib.sha256(data).hexdigest()), link)  # its blob gone
    assert resolve("org/m-GGUF", progress=False) == link
    with open(link, "rb") as f:
        assert f.read() == data
