"""A store is a trust boundary: an edited manifest is refused by its schema with one line naming the
field, its value and what is wrong, before any arithmetic; file names never leave the store."""

import json
import os
import shutil

import pytest

from mlx_flash.errors import StoreError
from mlx_flash.store import open_store
from mlx_flash.store.schema import MANIFEST, SchemaError, check
from tiny_models import edit_manifest


@pytest.fixture
def tiny(tiny_store):
    store_dir, _ = tiny_store("llama")
    return store_dir


def edit(store_dir, fn):
    edit_manifest(store_dir, fn)  # sealed again: the schema is what refuses it


def refused(store_dir, *words):
    with pytest.raises(StoreError) as e:
        open_store(store_dir)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


def first_tensor(m):
    return m["tensors"][sorted(m["tensors"])[0]]


def set_path(m, path, value):
    *head, last = path
    for k in head:
        m = m[k]
    m[last] = value


# (where, value, words the line must hold): the probe's cases 7, 8 and 10, and more of their kind
CASES = [
    (("ffn", "n_neurons"), 0, ["ffn.n_neurons = 0", "must be in 1.."]),  # was SIGFPE
    (("config", "num_attention_heads"), 1e9, ["config.num_attention_heads = 1000000000.0", "integer"]),  # was SIGABRT
    (("config", "num_attention_heads"), 1 << 30, ["config.num_attention_heads", "must be in 1..65536"]),
    (("config", "num_attention_heads"), 7, ["num_key_value_heads = 2", "must divide num_attention_heads 7"]),
    (("config", "num_hidden_layers"), "30", ["config.num_hidden_layers = '30'", "must be an integer"]),
    (("config", "rms_norm_eps"), -1.0, ["config.rms_norm_eps = -1.0", "above 0"]),
    (("ffn", "bundle_bytes"), "4096", ["ffn.bundle_bytes = '4096'", "integer"]),
    (("ffn", "d_model"), -64, ["ffn.d_model = -64"]),
    (("ffn", "block"), 0, ["ffn.block = 0"]),
    (("ffn", "layer_offsets"), None, ["ffn.layer_offsets = None", "must be a list"]),
    (("ffn", "fields"), [], ["ffn.fields", "1.."]),
    (("files",), None, ["files = None", "must be an object"]),
    (("quant",), {"x": {"bits": 7, "group_size": 64}}, ["quant['x'].bits = 7", "one of"]),
    (("quant",), {"x": {"bits": 4, "group_size": 0}}, ["quant['x'].group_size = 0"]),
    (("format_version",), "1", ["format_version = '1'", "must be an integer"]),
    (("config",), None, ["config = None"]),
]


@pytest.mark.parametrize("where,value,words", CASES, ids=[".".join(c[0]) + "=" + repr(c[1])[:20] for c in CASES])
def test_a_bad_field_is_one_line_naming_it(tiny, where, value, words):
    edit(tiny, lambda m: set_path(m, where, value))
    refused(tiny, *words)


@pytest.mark.parametrize(
    "mutate,words",
    [
        (lambda m: first_tensor(m).__setitem__("offset", "0"), ["offset = '0'", "must be an integer"]),
        (lambda m: first_tensor(m).__setitem__("shape", [-1, 8]), ["shape[0] = -1"]),
        (lambda m: m["ffn"]["fields"][0].__setitem__("dtype", "float64"), ["fields[0].dtype = 'float64'"]),
        (lambda m: m["ffn"]["quant"].__setitem__("gate", {"bits": 4}), ["group_size", "is missing"]),
        (lambda m: m.__setitem__("extra", 1), ["extra = 1", "is not a field"]),
    ],
)
def test_nested_fields_are_named_by_their_path(tiny, mutate, words):
    edit(tiny, mutate)
    refused(tiny, *words)


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "../../../etc/passwd", "a/b", "..", ""])
def test_file_names_are_plain_names_inside_the_store(tiny, name):
    """Case 2: a manifest naming a file outside the store is refused before anything is opened."""

    def rename_file(m):
        old = m["ffn"]["file"]
        m["files"][name] = m["files"].pop(old)
        m["ffn"]["file"] = name

    edit(tiny, rename_file)
    refused(tiny, "must be a plain file name inside the store")
    edit(tiny, lambda m: first_tensor(m).__setitem__("file", name))
    refused(tiny, "must be a plain file name")


def test_a_link_leaving_the_store_is_refused(tiny, tmp_path):
    outside = tmp_path / "elsewhere.bin"
    bundles = os.path.join(tiny, "ffn_bundles.bin")
    shutil.copy(bundles, outside)
    os.unlink(bundles)
    os.symlink(outside, bundles)
    refused(tiny, "ffn_bundles.bin", "link to a file outside the store")


def test_the_version_message_says_what_was_found(tiny):
    edit(tiny, lambda m: m.__setitem__("format_version", 2))
    msg = refused(tiny, "version 2 is not supported", "reads version 1")
    assert "version 1 is not supported" not in msg


def test_deep_nesting_is_refused(tiny):
    with open(os.path.join(tiny, "manifest.json"), "w") as fh:
        fh.write('{"format": "mlx_flash.store", "source": ' + "[" * 100000 + "]" * 100000 + "}")
    refused(tiny, "manifest")


def test_an_edit_that_does_not_fix_the_seal_is_refused(tiny):
    path = os.path.join(tiny, "manifest.json")
    text = open(path).read()
    open(path, "w").write(text.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 2e-05', 1))
    refused(tiny, "manifest.json", "seal does not match")


def test_the_schema_accepts_what_the_converter_writes(tiny):
    with open(os.path.join(tiny, "manifest.json")) as fh:
        d = json.load(fh)
    assert "seal" in d
    d.pop("seal")
    check(MANIFEST, d)
    with pytest.raises(SchemaError):
        check(MANIFEST, [])


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("rope_scaling", {"rope_type": "llama3", "factor": 0}, ["rope_scaling.factor = 0"]),
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, ["rope_scaling.low_freq_factor", "is missing"]),
        (
            "rope_scaling",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            ["high_freq_factor = 4.0", "above low_freq_factor"],
        ),
        ("rope_scaling", {"rope_type": "dynamic"}, ["rope_scaling.rope_type = 'dynamic'"]),
        ("layer_types", ["sliding_attention"], ["layer_types", "each of the 2 layers"]),
        ("layer_types", ["full_attention", "local"], ["layer_types[1] = 'local'"]),
        ("window", 0, ["config.window = 0"]),
    ],
)
def test_scaling_and_layer_kinds_are_checked(tiny, field, value, words):
    """Fields models/rope.py and models/gemma3_text.py compute with (a zero factor would divide by zero)."""
    edit(tiny, lambda m: m["config"].__setitem__(field, value))
    refused(tiny, *words)
