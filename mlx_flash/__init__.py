"""mlx_flash: run language models larger than memory by streaming weights from flash."""

from .api import load
from .errors import (ConfigError, FlashError, ModelFileError, ModelNotFoundError, StoreError,
                     UnsupportedModelError)

__version__ = "0.1.0"
__all__ = ["load", "FlashError", "ConfigError", "ModelFileError", "ModelNotFoundError", "StoreError",
           "UnsupportedModelError"]
