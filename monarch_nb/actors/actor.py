"""What an actor sees of itself: ``Actor``, ``@endpoint``, ``context()``, ``current_rank()``.

These follow torchmonarch's names: ``current_rank()`` is the ``Point`` of the message being
handled within the mesh (or slice) it was sent to; ``context().actor_instance.rank`` is the
actor's own place in the mesh it was spawned on.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Iterator, Mapping

from monarch_nb.actors.extent import Extent


class Point(Mapping):
    """A coordinate in a mesh: ``point["gpus"]``, ``point.rank`` (row-major position) and
    ``point.extent`` (the mesh's sizes, an ``Extent``: ``{hosts: 1, gpus: 2}``)."""

    __slots__ = ("extent", "rank")

    def __init__(self, rank: int, extent: Mapping[str, int]):
        self.rank = rank
        self.extent = extent if isinstance(extent, Extent) else Extent(extent, extent.values())

    def _coords(self) -> dict[str, int]:
        coords, rest = {}, self.rank
        for name, size in reversed(list(self.extent.items())):
            coords[name] = rest % size
            rest //= size
        return {name: coords[name] for name in self.extent}

    def __getitem__(self, name: str) -> int:
        if name not in self.extent:
            raise KeyError(f"{name!r} is not a dimension of this mesh ({', '.join(self.extent)})")
        return self._coords()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.extent)

    def __len__(self) -> int:
        return len(self.extent)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Point):
            return (self.rank, self.extent) == (other.rank, other.extent)
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def size(self, label: str) -> int:
        """The size of dimension ``label`` of the mesh."""
        return self.extent[label]

    def __repr__(self) -> str:
        # torchmonarch's form, coordinate/size: {'hosts': 0/1, 'gpus': 1/2}
        coords = self._coords()
        return "{" + ", ".join(f"'{k}': {coords[k]}/{n}" for k, n in self.extent.items()) + "}"

    def __reduce__(self):
        return Point, (self.rank, self.extent)


class Instance:
    """The running actor: its mesh name, its place in that mesh (``rank``) and its rank in the
    cluster (``cluster_rank``, the ``rank`` of ``%%monarch`` cells on the same worker)."""

    def __init__(self, name: str, rank: Point, cluster_rank: int | None):
        self.name = name
        self.rank = rank
        self.cluster_rank = cluster_rank
        self._children: dict = {}  # mesh id -> actor mesh it spawned, stopped when it stops

    @property
    def actor_id(self) -> str:
        return f"{self.name}[{self.rank.rank}]"

    def __repr__(self) -> str:
        return f"<actor {self.actor_id} on rank {self.cluster_rank}>"


class Context:
    """``actor_instance`` (who is running) and ``message_rank`` (where the current message
    landed in the mesh or slice it was sent to)."""

    def __init__(self, actor_instance: Instance, message_rank: Point):
        self.actor_instance = actor_instance
        self.message_rank = message_rank

    def __repr__(self) -> str:
        return f"<Context {self.actor_instance.actor_id} message_rank={self.message_rank}>"


_CLIENT = Context(Instance("client", Point(0, {}), None), Point(0, {}))
_context: contextvars.ContextVar[Context] = contextvars.ContextVar(
    "monarch_nb.actor_context", default=_CLIENT
)


def context() -> Context:
    """The running actor's Context; outside an actor, the client's (a point with no dims)."""
    return _context.get()


def current_rank() -> Point:
    """Where the message being handled landed in the mesh it was sent to."""
    return _context.get().message_rank


def current_size() -> dict[str, int]:
    """The sizes of the mesh (or slice) the current message was sent to."""
    return dict(_context.get().message_rank.extent)


class EndpointProperty:
    """What ``@endpoint`` leaves on the class. On an actor instance it is the plain method
    (``self.step()`` inside the actor); on a mesh, ``mesh.step`` gives the adverbs."""

    def __init__(self, method, explicit_response_port: bool = False):
        if not callable(method):
            raise TypeError(f"@endpoint decorates a method, not {type(method).__name__}")
        self.method = method
        self.name = method.__name__
        self.is_async = inspect.iscoroutinefunction(method)
        # The endpoint is handed a Port (after self) and answers through it, when it likes
        self.explicit_port = explicit_response_port
        functools.update_wrapper(self, method)

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return self.method.__get__(instance, owner)


_PROPAGATORS = ("cached", "inspect", "mocked")  # torchmonarch's named propagators


def endpoint(
    method=None,
    *,
    propagate=None,
    explicit_response_port: bool = False,
    instrument: bool = True,
):
    """Mark an Actor method (sync or ``async def``) as callable through a mesh.

    ``explicit_response_port=True``: the method takes a ``Port`` after ``self`` and answers by
    ``port.send(value)`` (or ``port.exception(error)``) whenever it likes, from any thread; its
    return value is not the answer. ``propagate`` (the shape function of torchmonarch's tensor
    engine, which this package does not have) and ``instrument`` (its tracing) are accepted so
    that Monarch code runs, and change nothing here.
    """
    if not isinstance(explicit_response_port, bool):
        raise TypeError(
            f"explicit_response_port takes True or False, not {explicit_response_port!r}"
        )
    if propagate is not None and not callable(propagate) and propagate not in _PROPAGATORS:
        raise TypeError(f"propagate takes a function, not {type(propagate).__name__}")
    if method is None:
        return functools.partial(EndpointProperty, explicit_response_port=explicit_response_port)
    return EndpointProperty(method, explicit_response_port)


# The public attributes of an actor mesh (``ActorMesh`` in actors.py; a test keeps the two in
# step): ``mesh.stop`` is the mesh's own, so an endpoint of one of these names could never be
# reached through the mesh.
MESH_ATTRIBUTES = frozenset({"extent", "name", "size", "sizes", "slice", "stacks", "stop"})


class Actor:
    """Base class of everything ``mesh.spawn`` makes; endpoints are marked with ``@endpoint``."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        names = {name for klass in cls.__mro__ for name in vars(klass)}
        cls._monarch_endpoints = frozenset(
            name
            for name in names
            if isinstance(inspect.getattr_static(cls, name), EndpointProperty)
        )
        clash = ", ".join(repr(n) for n in sorted(cls._monarch_endpoints & MESH_ATTRIBUTES))
        if clash:
            raise TypeError(
                f"{cls.__name__}: endpoints cannot be named {clash}, which actor meshes use for "
                "their own attributes (mesh.stop() stops the mesh); rename the endpoint"
            )


def endpoints_of(cls: type) -> dict[str, EndpointProperty]:
    return {name: inspect.getattr_static(cls, name) for name in cls._monarch_endpoints}


def plain_methods_of(cls: type) -> frozenset[str]:
    """Callables that are not endpoints (to say so when someone calls one through a mesh)."""
    names = set()
    for klass in cls.__mro__:
        if klass in (Actor, object):
            continue
        for name, value in vars(klass).items():
            if not name.startswith("__") and callable(value) and name not in cls._monarch_endpoints:
                names.add(name)
    return frozenset(names)
