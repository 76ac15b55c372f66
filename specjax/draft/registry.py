"""Method names -> proposer builders: the one place that knows which methods exist.

``SpecConfig.method``, the command line's ``--method`` choices and the bench's variants all come
from here. A builder takes ``(spec, draft, target_config)``: the parsed SpecConfig, whatever the
user passed as ``draft=`` (a draft model, heads, or None) and the target's ModelConfig; it checks
them (ValueError naming the bad value) and returns a proposer (see ``specjax.draft.base``).
Adding a method is one new file with its proposer and builder, plus one ``register`` line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def _identity(draft):
    return draft


@dataclasses.dataclass(frozen=True)
class Method:
    """One registered draft method."""

    name: str
    build: Callable[[Any, Any, Any], Any]  # (spec, draft, target_config) -> proposer
    # what draft= must be: "model", "heads", "corpus" (a SuffixCache, optional), or None
    draft: str | None = None
    tree: bool = False  # whether SpecConfig.tree is accepted
    adaptive: bool = False  # whether SpecConfig.survival_threshold is accepted (chains)
    # draft= -> the proposer's params (a pytree passed into the compiled program)
    params: Callable[[Any], Any] = _identity
    # after each generate call: (draft, prompts [token id lists], Generation) -> None, for a
    # draft= that learns from calls (suffix decoding's corpus)
    after_call: Callable[[Any, Any, Any], None] | None = None


_METHODS: dict[str, Method] = {}


def register(name: str, build: Callable[[Any, Any, Any], Any], *, draft: str | None = None,
             tree: bool = False, params: Callable[[Any], Any] = _identity,
             adaptive: bool = False,
             after_call: Callable[[Any, Any, Any], None] | None = None) -> Method:
    """Make ``SpecConfig(method=name)`` build its proposer with ``build``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a method name must be an identifier-like string, got {name!r}")
    if draft not in (None, "model", "heads", "corpus"):
        raise ValueError(f"draft must be None, 'model', 'heads' or 'corpus', got {draft!r}")
    method = Method(name, build, draft, tree, adaptive, params, after_call)
    _METHODS[name] = method
    return method


def unregister(name: str) -> None:
    """Forget a registered method (KeyError if there is none of that name)."""
    del _METHODS[name]


def get(name: str) -> Method:
    """The registered method ``name``; ValueError listing the known ones otherwise."""
    try:
        return _METHODS[name]
    except (KeyError, TypeError):
        raise ValueError(f"method {name!r} is unknown; known methods: "
                         f"{', '.join(names())}") from None


def names() -> tuple[str, ...]:
    """Every registered method, in registration order."""
    return tuple(_METHODS)
