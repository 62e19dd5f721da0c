#!/usr/bin/env bash
# The README's first set-up command exactly as written, in a fresh clone with no venv, an empty
# home (so an empty ~/.cache/mlx_flash and pip cache) and no MLX_FLASH_CACHE: a question piped in,
# then /quit. It must answer "Paris" and leave no torch in the venv it made.
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
if .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
  echo "first-command check: torch got installed by the first command"; exit 1
fi
echo "first-command check: ok"
