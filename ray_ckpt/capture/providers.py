"""What ``engine.register`` accepts as a provider, resolved once into one of two shapes.

- an actor (``ActorProvider``): the state is captured and restored inside the actor — its
  ``ckpt_get_state`` / ``ckpt_set_state`` methods, other names through ``rc.actor_provider``, or
  one of its attributes that follows torch's ``Stateful`` / RLlib's ``Checkpointable`` protocol
  through ``rc.actor_method(handle, "opt")``;
- an in-process callable (``CallableProvider``): a function returning the state with an optional
  ``loader``, or an object of this process with ``state_dict()`` / ``load_state_dict()`` (a module,
  an optimizer, an LR scheduler, a ``StatefulDataLoader``) or ``get_state()`` / ``set_state()``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Union

import ray

from ..errors import InvalidArgumentError
from .snapshot import ActorProvider, CallableProvider, stateful_methods
from ..types import Strategy

Provider = Union[ActorProvider, CallableProvider]


@dataclass
class Registration:
    name: str
    provider: Optional[Provider]
    strategy: Strategy
    allow_pickle: bool = False
    world_size: Optional[int] = None  # set: a state pushed by ranks with submit()
    rank_providers: Optional[List[ActorProvider]] = None  # pushed state: rank r restores into [r]
    replicated: bool = False
    overlap: bool = False  # the snapshot's copy overlaps the provider's next step (see overlap.py)
    append_only: bool = False  # a buffer that only grows: each version writes its new rows (formats.segments)


def resolve(name: str, provider: Any, strategy: Strategy, loader: Optional[Callable[..., Any]]) -> Provider:
    """The provider ``register(name, provider, loader=...)`` was given, in one of the two shapes."""
    if loader is not None and not callable(loader):
        raise InvalidArgumentError(f"state {name!r}: loader must be callable")
    if isinstance(provider, ActorProvider):
        return provider
    if isinstance(provider, ray.actor.ActorHandle):
        return ActorProvider(provider)
    if provider is None:
        if not (strategy is Strategy.RELOADABLE and callable(loader)):
            raise InvalidArgumentError(f"state {name!r}: a provider (actor handle, callable or an object with "
                                       f"state_dict()/load_state_dict()) is required, except for a RELOADABLE "
                                       f"state rebuilt by a loader")
        return CallableProvider(None, loader)
    methods = stateful_methods(provider)
    if methods is not None:  # a module, optimizer, scheduler, StatefulDataLoader, RLlib Checkpointable
        get, set_ = methods
        return CallableProvider(getattr(provider, get), loader or getattr(provider, set_))
    if callable(provider):
        return CallableProvider(provider, loader)
    raise InvalidArgumentError(f"state {name!r}: provider must be a Ray actor handle, rc.actor_provider(...), "
                               f"rc.actor_method(...), a callable, or an object with state_dict() / "
                               f"load_state_dict(), not {type(provider).__name__}")


def rank_provider(name: str, h: Any) -> ActorProvider:
    if isinstance(h, ActorProvider):
        return h
    if isinstance(h, ray.actor.ActorHandle):
        return ActorProvider(h)
    raise InvalidArgumentError(f"state {name!r}: rank providers must be actor handles")
