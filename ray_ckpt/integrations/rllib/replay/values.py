"""Moved to :mod:`..journal.values` (the replay journal owns it); the names this package's modules import."""
from ..journal.values import (Spaces as _Spaces, kind_of as _kind_of, pack_one as _pack_one, pack_scalars,  # noqa: F401
                             scalar_state as _scalar_state, space_tree_from_storable as _space_tree_from_storable,
                             space_tree_to_storable as _space_tree_to_storable, type_name as _type_name,
                             unpack_one as _unpack_one, unpack_scalars)
