"""The registry of fixed schemes: name -> scheme class. ``zen.all_reduce(scheme=name)``, ``zen.predict``,
the calibration and ``auto``'s candidates all read it, so a scheme registered here is one of them."""
import inspect
from typing import Dict, Tuple

from ..cost import Statistic
from .base import Scheme, opens

_REGISTRY: Dict[str, type] = {}  # in registration order: the order of zen.SCHEMES and of predictions
RESERVED = ("auto",)  # the policy's name (zen.auto), not a fixed scheme


def _overrides(cls: type, method: str) -> bool:
    return inspect.getattr_static(cls, method) is not inspect.getattr_static(Scheme, method)


def register_scheme(name: str, scheme_class: type) -> type:
    """Make ``scheme_class`` available as ``scheme=name`` everywhere (all_reduce, the hook, predict, auto's
    candidates). Every rank must register the same schemes. The class must derive from
    :class:`zen.schemes.base.Scheme`, implement ``reduce_coo`` (or ``open`` and ``finish``), declare its
    formulas (``phases`` or ``time``, and ``memory``), take no required constructor argument, and carry
    ``name`` (set here when the class leaves the default). Its ``statistics`` must be a tuple of
    :class:`zen.cost.Statistic` instances, each named by an identifier, and a name declared by several schemes
    must be the same statistic (:func:`registered_statistics`). Registering the same class again is a no-op.
    Returns the class.

    Example::

        class GatherAll(zen.Scheme):
            def reduce_coo(self, call, indices, values, numel): ...
            @staticmethod
            def phases(w, p): ...
            @staticmethod
            def memory(w): ...

        zen.register_scheme("gatherall", GatherAll)
        zen.all_reduce(grad, scheme="gatherall")
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_scheme: name must be an identifier string; got {name!r}")
    if name in RESERVED:
        raise ValueError(f"register_scheme: {name!r} is reserved")
    if not (inspect.isclass(scheme_class) and issubclass(scheme_class, Scheme)):
        raise TypeError(f"register_scheme: {name!r} must be a subclass of zen.Scheme; got {scheme_class!r}")
    missing = [what for what, ok in (
        ("reduce_coo, or open and finish", _overrides(scheme_class, "reduce_coo")
         or (opens(scheme_class) and _overrides(scheme_class, "finish"))),
        ("phases or time (its time formula)", _overrides(scheme_class, "phases") or _overrides(scheme_class, "time")),
        ("memory (its memory formula)", _overrides(scheme_class, "memory"))) if not ok]
    if missing:
        raise TypeError(f"register_scheme: {scheme_class.__name__} does not implement {', '.join(missing)}")
    if scheme_class.name not in (Scheme.name, name):
        raise ValueError(f"register_scheme: {scheme_class.__name__}.name is {scheme_class.name!r}, not {name!r}")
    if name in _REGISTRY and _REGISTRY[name] is not scheme_class:
        raise ValueError(f"register_scheme: {name!r} is already registered ({_REGISTRY[name].__name__})")
    _check_statistics(name, scheme_class)
    scheme_class.name = name
    _REGISTRY[name] = scheme_class
    return scheme_class


def _check_statistics(name: str, scheme_class: type) -> None:
    """A TypeError where ``scheme_class.statistics`` is not a tuple of Statistic instances, a ValueError where
    one's name is no identifier or another statistic of that name is declared (by a registered scheme, or
    twice by this one)."""
    declared = scheme_class.statistics
    if not (isinstance(declared, tuple) and all(isinstance(s, Statistic) for s in declared)):
        raise TypeError(f"register_scheme: {scheme_class.__name__}.statistics must be a tuple of zen.cost.Statistic "
                        f"instances; got {declared!r}")
    known = {s.name: (s, other) for other, cls in _REGISTRY.items() if other != name for s in cls.statistics}
    for statistic in declared:
        if not (isinstance(statistic.name, str) and statistic.name.isidentifier()):
            raise ValueError(f"register_scheme: {scheme_class.__name__} declares a statistic whose name "
                             f"{statistic.name!r} is not an identifier ({statistic!r})")
        first, declarer = known.setdefault(statistic.name, (statistic, name))
        if first != statistic:
            raise ValueError(f"register_scheme: {name!r} declares statistic {statistic.name!r} as {statistic!r}, "
                             f"but {declarer!r} declares it as {first!r}; one name, one statistic")


def registered_statistics() -> Tuple[Statistic, ...]:
    """Every registered scheme's declared statistics, each once, in registration order: what ``zen.measure``
    measures and ``zen.planner`` computes (:mod:`zen.cost.statistics`)."""
    by_name = {}
    for cls in _REGISTRY.values():
        for statistic in cls.statistics:
            by_name.setdefault(statistic.name, statistic)
    return tuple(by_name.values())


def registered() -> Dict[str, type]:
    """{name: scheme class} of every registered scheme, in registration order (a copy)."""
    return dict(_REGISTRY)


def scheme_class(name: str) -> type:
    """The class registered as ``name``; ValueError naming the allowed names otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown scheme {name!r}; allowed: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]
