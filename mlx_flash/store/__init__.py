"""On-flash store: manifest, row-column bundles, converter, readers. Deals in files, offsets and
numpy buffers only; framework arrays are made at the compute edge."""

from .converter import PRECISIONS, convert
from .manifest import Manifest
from .store import Store, is_store, open_store

__all__ = ["convert", "open_store", "is_store", "Store", "Manifest", "PRECISIONS"]
