"""Quickstart: the public API only. Run: python examples/quickstart.py [--backend torch]"""

import argparse

import mlx_flash

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="mlx", choices=("mlx", "torch"))
parser.add_argument("--model", default=None, help="store, GGUF or HF dir (default: SmolLM2-135M-Instruct)")
args = parser.parse_args()

with mlx_flash.load(args.model, backend=args.backend) as engine:
    # A string prompt is a raw completion.
    print(repr(engine.generate("The capital of France is", max_tokens=8)))

    # A list of messages goes through the model's chat template; tokens stream as they come.
    messages = [{"role": "user", "content": "Name three colors."}]
    for step in engine.stream_generate(messages, max_tokens=40):
        print(step.text, end="", flush=True)
    print()
    s = engine.last
    print(f"prefill {s.prefill_tps:.0f} tok/s, decode {s.decode_tps:.1f} tok/s")
