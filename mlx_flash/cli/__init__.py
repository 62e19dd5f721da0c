"""The commands: argument parsing, messages and exit status over the package's API. Each runs as
`python -m mlx_flash.<name>` (a two-line entry module beside the package) and as a console script.

  chat.py          interactive chat, or one answer (--prompt); a model split across ranks (--pipeline)
  serve.py         the OpenAI-compatible HTTP server
  batch.py         the throughput mode over a JSON-lines file, resumable
  convert.py       GGUF, HF or mlx-community checkpoint -> store
  verify.py        a store's manifest and checksums
  profile_disk.py  random-read throughput by chunk size x threads
  models.py        the converted stores in the cache: list, remove, prune (python -m mlx_flash.stores)
"""
