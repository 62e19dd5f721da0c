"""Where models come from and where their stores go: hub names resolved through the Hugging Face
cache or a download (hub.py), and the converted stores in this package's cache that a user lists,
removes and prunes (cached_stores.py; `python -m mlx_flash.stores`)."""
