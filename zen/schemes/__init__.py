"""The all-reduce schemes, by name. ``SCHEMES`` lists what ``zen.all_reduce(scheme=...)`` accepts."""
from .balanced import BalancedParallelism
from .dense import Dense

_FACTORIES = {
    "dense": Dense,
    "zen": BalancedParallelism,
}
SCHEMES = tuple(_FACTORIES)


def make_scheme(name: str, **settings):
    """A scheme instance; ``settings`` go to its constructor. Raises ValueError on an unknown name."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown scheme {name!r}; allowed: {', '.join(SCHEMES)}")
    return _FACTORIES[name](**settings)
