"""On-flash store: the format (manifest, row-column bundles, safetensors layout) and its readers
(reader pool, FFN reader, read planning, disk profile). Deals in files, offsets and numpy buffers
only; framework arrays are made at the compute edge. Writing a store from a model is convert/."""

from .manifest import Manifest
from .store import Store, is_store, open_store

__all__ = ["open_store", "is_store", "Store", "Manifest"]
