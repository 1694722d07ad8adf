"""Where bytes go: tiers over pyarrow.fs (``tier``), filesystems from URIs (``filesystems``), local-disk
primitives (``local_files``, ``confined``), the path layout, retention, the run's owner record
(``ownership``); ``checkpoint_io`` (a flattened state <-> its files on a tier, manifests <-> tiers) and
``sharded_io`` (loads of sharded states, with ``shard_header`` and ``target_match``) over
``range_reader`` (ranged, verified reads across tiers): where formats meet storage. Knows nothing of Ray.

May import ``formats`` and the root's ``errors``, ``types`` and ``interfaces``."""
from .layout import validate_name, version_dir
from .retention import RetentionPolicy
from .tier import Tier

__all__ = ["Tier", "RetentionPolicy", "validate_name", "version_dir"]
