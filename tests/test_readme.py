"""The README's Python blocks run as written, in order, in one namespace (what a reader pasting them
one after another gets), so the guide cannot drift from the API. The only changes are the names a
reader supplies themselves: a GGUF file of theirs (here the default model's), a MoE model directory
(a tiny random Mixtral), the service's directory (a fresh one) and the prompts of a batch job. Each
placeholder must appear in the README, so this table cannot outlive what it replaces."""

import contextlib
import io
import os
import re

import pytest

from mlx_flash.default_model import default_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        return re.findall(r"^```python\n(.*?)^```", fh.read(), flags=re.S | re.M)


def test_the_readme_has_its_api_blocks():
    blocks = python_blocks()
    assert len(blocks) >= 4 and "mlx_flash.load()" in blocks[0]


def test_the_readme_python_blocks_run_as_written(tmp_path):
    pytest.importorskip("transformers")  # the tiny MoE is written through transformers
    from tiny_models import build

    moe_dir = str(tmp_path / "moe")
    build("mixtral", moe_dir)
    placeholders = {'"model.gguf"': repr(default_model_path()), '"path/to/moe"': repr(moe_dir),
                    '"~/contexts"': repr(str(tmp_path / "contexts"))}
    source = "\n".join(python_blocks())
    for name, value in placeholders.items():
        assert name in source, f"the README no longer has {name}: drop it from this test"
        source = source.replace(name, value)
    namespace = {"prompts": [f"Question {i}: what is {i} plus {i}?" for i in range(8)]}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "README.md", "exec"), namespace)
    printed = out.getvalue()
    assert "Paris" in printed  # the quickstart's completion and the service's answer
    assert len(namespace["texts"]) == len(namespace["prompts"]) and all(isinstance(t, str) for t in namespace["texts"])
    assert isinstance(namespace["text"], str)
