"""Where bytes go: tiers over pyarrow.fs (``tier``), filesystems from URIs (``filesystems``), local-disk
primitives (``local_files``, ``confined``), the path layout, retention. Knows nothing of Ray."""
from .layout import validate_name, version_dir
from .retention import RetentionPolicy
from .tier import Tier

__all__ = ["Tier", "RetentionPolicy", "validate_name", "version_dir"]
