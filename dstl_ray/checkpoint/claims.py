"""Directory claims of a coordinated job: which directories' files are deleted by their
owners rather than by the shared state registry's reference counts (FLIP-306 "Ownership" 4.3-4.5;
docs/architecture.md "File merging").

The coordinator names three kinds of owners in its :class:`SharedStateRegistry`:

* ``nodes``: the merged changelog files of this incarnation (and of writers that carry none:
  ``UNMANAGED_DIR``, and ``_`` of earlier versions) belong to the node actors that append to
  them; those of earlier runs go by reference count, like any shared file.
* ``backend-{id}``: a live backend's own directory of merged files is its own to delete.
* ``checkpoint``: the newest checkpoint's subtask directories (FLIP-306
  "DirectoryStateHandle") stay with their subtasks; others go back to reference counting.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..merging.segments import SEGMENTS_DIR, UNMANAGED_DIR
from ..state.backend import ChangelogKeyedStateBackend
from ..state.registry import SharedStateRegistry
from ..state.snapshot import KeyedStateSnapshot
from ..storage.base import join
from ..transport.sender import Incarnation


def claim_node_dirs(registry: SharedStateRegistry, job_path: str, inc: Incarnation) -> None:
    """The node actors own the merged changelog files of incarnation ``inc``."""
    registry.set_claims("nodes", [join(job_path, SEGMENTS_DIR, d)
                                  for d in (str(inc), UNMANAGED_DIR, "_")])


def claim_backend_dir(registry: SharedStateRegistry, backend: ChangelogKeyedStateBackend
                      ) -> None:
    """A registered backend owns its directory of merged files, if it has one."""
    if backend.owned_dir is not None:
        registry.set_claims(f"backend-{id(backend)}",
                            [join(backend.job_path, backend.owned_dir)])


def release_backend_dir(registry: SharedStateRegistry, backend: ChangelogKeyedStateBackend
                        ) -> None:
    """An unregistered backend's directory goes back to reference counting."""
    registry.set_claims(f"backend-{id(backend)}", ())


def claim_checkpoint_dirs(registry: SharedStateRegistry, job_path: str,
                          snaps: Iterable[KeyedStateSnapshot]) -> None:
    """The subtask directories of ``snaps`` (the newest checkpoint's) replace the ones the
    previous newest checkpoint claimed."""
    registry.set_claims("checkpoint", [join(job_path, s.owned_dir)
                                       for s in snaps if s.owned_dir])
