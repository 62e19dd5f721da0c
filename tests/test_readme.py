"""The README's Python blocks run as written, in order, in one fresh Python process (what a reader
pasting them one after another gets: the memory limits in them hold for a process of their own), so
the guide cannot drift from the API. The only changes are the names a
reader supplies themselves: a GGUF file of theirs (here the default model's), a MoE model directory
(a tiny random Mixtral), the service's directory (a fresh one) and the prompts of a batch job; the
cache starts empty, as on a fresh machine. Each
placeholder must appear in the README, so this table cannot outlive what it replaces."""

import json
import os
import re
import subprocess
import sys

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
    placeholders = {
        '"model.gguf"': repr(default_model_path()),
        '"path/to/moe"': repr(moe_dir),
        '"~/contexts"': repr(str(tmp_path / "contexts")),
    }
    source = "\n".join(python_blocks())
    for name, value in placeholders.items():
        assert name in source, f"the README no longer has {name}: drop it from this test"
        source = source.replace(name, value)
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]
    script = tmp_path / "readme_blocks.py"
    script.write_text(
        f"prompts = {prompts!r}\n" + source + "\nimport json\n"
        "print('RESULT ' + json.dumps({'texts': texts, 'text': text}))\n"
    )
    # an empty cache, as on a fresh machine: nothing converted, trained or profiled before
    env = {**os.environ, "MLX_FLASH_CACHE": str(tmp_path / "cache")}
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Paris" in r.stdout  # the quickstart's completion and the service's answer
    result = json.loads(r.stdout.rsplit("RESULT ", 1)[1])
    assert len(result["texts"]) == len(prompts) and all(isinstance(t, str) for t in result["texts"])
    assert isinstance(result["text"], str)
