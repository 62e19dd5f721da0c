"""What backend="auto" means: MLX on Apple silicon, else torch when it is installed, else MLX on the
CPU with a line saying what torch would give; a device or a backend asked for decides it."""

import importlib.util

from mlx_flash.backends import choice


def test_a_backend_asked_for_is_taken():
    assert choice.choose_backend("mlx") == ("mlx", "asked for")
    assert choice.choose_backend("torch", "cpu") == ("torch", "asked for")


def test_a_device_names_its_framework():
    assert choice.choose_backend("auto", "gpu")[0] == "mlx"
    assert choice.choose_backend("auto", "cuda:0")[0] == "torch"


def test_apple_silicon_runs_mlx(monkeypatch):
    monkeypatch.setattr(choice.sys, "platform", "darwin")
    monkeypatch.setattr(choice.platform, "machine", lambda: "arm64")
    assert choice.choose_backend("auto")[0] == "mlx"


def test_elsewhere_torch_when_installed_else_mlx_saying_what_torch_gives(monkeypatch):
    monkeypatch.setattr(choice.sys, "platform", "linux")
    real = importlib.util.find_spec
    monkeypatch.setattr(choice.importlib.util, "find_spec", lambda name: object() if name == "torch" else real(name))
    assert choice.choose_backend("auto")[0] == "torch"
    monkeypatch.setattr(choice.importlib.util, "find_spec", lambda name: None if name == "torch" else real(name))
    name, why = choice.choose_backend("auto")
    assert name == "mlx" and "torch is not installed" in why and choice.TORCH_CPU_WHEEL in why
