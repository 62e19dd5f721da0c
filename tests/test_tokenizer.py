"""The run-time tokenizer: tokenizers + jinja2 only, never transformers or torch on the MLX path."""

import json
import os
import subprocess
import sys

import pytest

from mlx_flash.errors import ModelFileError
from mlx_flash.tokenizer import Tokenizer, compile_template

TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] | tojson }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _store_with(tmp_path, template=None, files=None):
    import tiny_models

    tmp_path.mkdir(exist_ok=True)
    tiny_models.write_tokenizer(str(tmp_path))
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if template is not None:
        cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text)
    return str(tmp_path)


def test_chat_template_rendered_with_special_tokens_and_json(tmp_path):
    tok = Tokenizer(_store_with(tmp_path, TEMPLATE))
    text = tok.render_chat([{"role": "user", "content": 'é "q" <b>'}])
    assert text == 'user: "é \\"q\\" <b>"\nassistant:'.replace("user", "<s>user", 1)


def test_template_from_jinja_file_and_missing_template(tmp_path):
    store = _store_with(tmp_path / "a", files={"chat_template.jinja": "{{ messages[0]['content'] }}!"})
    assert Tokenizer(store).render_chat([{"role": "user", "content": "hi"}]) == "hi!"
    plain = Tokenizer(_store_with(tmp_path / "b"))
    assert not plain.has_chat_template
    with pytest.raises(ModelFileError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_errors_are_one_line(tmp_path):
    with pytest.raises(ModelFileError, match="chat template"):
        compile_template("{% for %}")
    tok = Tokenizer(_store_with(tmp_path, "{{ raise_exception('roles must alternate') }}"))
    with pytest.raises(ModelFileError, match="roles must alternate"):
        tok.render_chat([{"role": "user", "content": "x"}])


def test_missing_or_corrupt_tokenizer_is_named(tmp_path):
    with pytest.raises(ModelFileError, match="no tokenizer.json"):
        Tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="tokenizer.json: cannot load"):
        Tokenizer(str(tmp_path))


PROBE = """
import sys, mlx_flash
e = mlx_flash.load(sys.argv[1], backend="mlx", progress=False)
out = e.generate("The capital of France is", max_tokens=16, temperature=0)
chat = "".join(s.text for s in e.stream_generate([{"role": "user", "content": "Hi"}], max_tokens=4))
print(repr(out), sorted(m for m in ("torch", "transformers", "mlx_lm") if m in sys.modules))
"""


@pytest.mark.slow
def test_mlx_path_imports_neither_torch_nor_transformers(store_dir):
    r = subprocess.run(
        [sys.executable, "-c", PROBE, store_dir],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("' Paris")
    assert r.stdout.strip().endswith("[]"), r.stdout
