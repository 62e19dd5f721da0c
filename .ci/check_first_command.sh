#!/usr/bin/env bash
# The README's first set-up command exactly as written, in a fresh clone with no venv, an empty
# home (so an empty ~/.cache/mlx_flash and pip cache) and no MLX_FLASH_CACHE: a question piped in,
# then /quit. It must answer "Paris" within 120 s; on Linux the venv it made holds torch (the chat's
# backend there), and the MLX processes of the checks never import it.
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
first="$(awk '/^## Set up/{on=1} on && /^    [a-z]/{sub(/^    /, ""); print; exit}' "$src/README.md")"
[ -n "$first" ] || { echo "first-command check: no set-up command found in README.md"; exit 1; }
git clone -q "$src" "$work/clone"
mkdir "$work/home"
cd "$work/clone"
start=$(date +%s)
printf 'What is the capital of France?\n/quit\n' \
  | env -u MLX_FLASH_CACHE -u VIRTUAL_ENV HOME="$work/home" bash -c "$first" >"$work/out" 2>"$work/err" \
  || { echo "first-command check: '$first' failed"; tail -20 "$work/err"; exit 1; }
took=$(( $(date +%s) - start ))
echo "first command '$first' answered in ${took}s: $(tail -n 3 "$work/out" | tr '\n' ' ')"
grep -q "Paris" "$work/out" || { echo "first-command check: no 'Paris' in the answer"; tail -20 "$work/err"; exit 1; }
[ "$took" -le 120 ] || { echo "first-command check: took ${took}s (over 120 s)"; exit 1; }
if [ "$(uname -s)" = Linux ]; then
  .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" \
    || { echo "first-command check: no torch in the venv on Linux"; exit 1; }
  grep -q "backend: torch" "$work/err" || { echo "first-command check: the chat did not say it runs on torch"; tail -5 "$work/err"; exit 1; }
fi
# An MLX process never imports torch, even where torch is installed.
env -u MLX_FLASH_CACHE HOME="$work/home" .venv/bin/python -c "
import sys, mlx_flash
e = mlx_flash.load(backend='mlx', progress=False)
assert ' Paris' in e.generate('The capital of France is', max_tokens=4), 'mlx answer'
assert 'torch' not in sys.modules, 'an MLX process imported torch'
" || { echo "first-command check: the MLX backend failed or imported torch"; exit 1; }
echo "first-command check: ok"
