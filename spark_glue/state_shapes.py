"""The operator's declared state types and dropped states (``state_schema=``,
``drop_state=``).

``state_schema`` maps state names to types (Spark DDL strings or pyarrow types,
:mod:`dstl_ray.state.schema`): their values are encoded by type (timestamps, dates, decimals,
structs, lists and maps too), and each type is in every checkpoint. A later run may add
nullable struct fields, remove fields and widen numbers (old values read in the new shape);
an incompatible change raises :class:`~dstl_ray.errors.SchemaError` when the operator is
made, naming the state and both schemas, before any task runs. ``drop_state`` lists states
to remove with all their entries. Undeclared states stay as they are (untyped, or the type
they were stored with). Each subtask's backend migrates or drops what it restored
(:mod:`dstl_ray.state.evolution`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dstl_ray.checkpoint.reader import operator_states
from dstl_ray.checkpoint.recovery import load_checkpoint
from dstl_ray.errors import ConfigError, SchemaError, StateError
from dstl_ray.state.schema import canonical, check_evolution

from .timers import TIMERS_STATE


def _name(option: str, name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > 200:
        raise ConfigError(f"{option}: bad state name {name!r}")
    if name == TIMERS_STATE:
        raise ConfigError(f"{option}: {TIMERS_STATE!r} is the operator's timers")
    return name


def schema_spec(state_schema: Mapping[str, Any] | None) -> tuple[tuple[str, str], ...]:
    """``state_schema`` (state name -> Spark DDL string or pyarrow type) as tasks carry it:
    (name, canonical DDL) pairs, each type checked here."""
    if state_schema is None:
        return ()
    if not isinstance(state_schema, Mapping):
        raise ConfigError(f"state_schema must map state names to Spark DDL strings or "
                          f"pyarrow types, got {state_schema!r}")
    return tuple((_name("state_schema", n), canonical(t, f"state_schema of state {n!r}"))
                 for n, t in state_schema.items())


def drop_spec(drop_state: Iterable[str] | None, declared: Iterable[str]) -> tuple[str, ...]:
    """``drop_state`` (state names) as tasks carry it; a state both dropped and declared is
    refused (which one is meant?)."""
    if drop_state is None:
        return ()
    if isinstance(drop_state, str):
        raise ConfigError(f"drop_state must be a list of state names, got {drop_state!r}")
    names = tuple(dict.fromkeys(_name("drop_state", n) for n in drop_state))
    both = sorted(set(names) & set(declared))
    if both:
        raise ConfigError(f"drop_state and state_schema both name {both}: a dropped state "
                          f"has no type")
    return names


def check_against(coordinator: Any, operator_id: str, schemas: tuple[tuple[str, str], ...],
                  drops: tuple[str, ...] = ()) -> tuple[tuple[str, str], ...]:
    """The types the job's subtasks declare: ``schemas``, and the stored type of every typed
    state of the checkpoint the job goes on from (its latest, else its pinned restore
    point) that ``schemas`` leaves out and ``drops`` keeps, so a subtask that first uses
    such a state in this run types it as the others hold it (a checkpoint never has a state
    typed in one snapshot and untyped in another). A declared type the stored values cannot
    follow is refused before any task runs: a :class:`~dstl_ray.errors.SchemaError` naming
    the state and both schemas (the coordinator is shut down first). An untyped state that
    gains a type is checked value by value when a subtask restores it."""
    cc = coordinator.latest_checkpoint()
    if cc is None:
        point = coordinator.restore_point.current()
        if point is None:
            return schemas
        cc = load_checkpoint(point.metadata_url)
    try:
        stored = operator_states(cc, operator_id)
    except StateError:
        return schemas  # no snapshot of this operator there: nothing to follow
    try:
        for name, ddl in schemas:
            info = stored.get(name)
            if info is not None and info.schema is not None:
                check_evolution(name, info.schema, ddl)
    except SchemaError:
        coordinator.shutdown()  # the operator is not made: its lease goes with it
        raise
    declared = {n for n, _ in schemas}
    return schemas + tuple(sorted((n, i.schema) for n, i in stored.items()
                                  if i.schema is not None and n not in declared
                                  and n not in drops))
