"""Long waits say what they are doing: named steps with their duration, silent when disabled."""

import pytest

from mlx_flash.progress import step


def test_step_names_start_and_duration(capsys):
    with step("measuring", detail="9 points"):
        pass
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "measuring (9 points) ..."
    assert err[1].startswith("measuring: done in ") and err[1].endswith(" s")


def test_step_reports_failure_and_reraises(capsys):
    with pytest.raises(ValueError):
        with step("reading x"):
            raise ValueError("bad")
    assert "reading x: failed after" in capsys.readouterr().err


def test_disabled_step_is_silent(capsys):
    with step("quiet", enabled=False):
        pass
    assert capsys.readouterr().err == ""


def test_conversion_announces_its_steps(capsys, tmp_path):
    import tiny_models

    from mlx_flash.convert import convert

    tiny_models.build("llama", str(tmp_path / "hf"))
    capsys.readouterr()
    convert(str(tmp_path / "hf"), str(tmp_path / "store"), progress=True)
    err = capsys.readouterr().err
    for what in ("reading hf", "writing the resident tensors", "building the tokenizer", "checksums"):
        assert what in err, what
