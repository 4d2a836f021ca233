"""dstl-ray: FLIP-158's Durable Short-Term Log as a tree of Ray actors.

Writers append state changes in memory; on a checkpoint each node actor batches the requests it
gets and either forwards them to its parent or writes ONE changelog file to DFS.
"""

from . import tracing
from .backend import (
    ChangelogKeyedStateBackend,
    ListState,
    MapState,
    RestoreSource,
    ValueState,
)
from .client import DirectTransport, StateChangelogClient
from .config import ChangelogConfig
from .coordinator import (
    CheckpointCoordinator,
    CheckpointRetention,
    PendingCheckpoint,
    RestoreMode,
)
from .deploy import ChangelogTree, attach, deploy
from .errors import (
    CheckpointDeclinedError,
    CheckpointError,
    ConfigError,
    DstlError,
    FormatError,
    HandleError,
    InvalidValueError,
    KeyGroupError,
    MissingDependencyError,
    NamespaceError,
    NodeUnavailableError,
    PersistError,
    RestoreError,
    SqnError,
    StateError,
    StorageError,
    WriterClosedError,
)
from .handle import Segment, StateChangelogHandle
from .hedging import HedgePolicy
from .keygroups import KeyGroupRange, assign_key_group, key_group_range_for_subtask, stable_hash
from .materialization import MaterializedHandle
from .recovery import CompletedCheckpoint, cleanup_orphans, load_checkpoint
from .registry import SharedStateRegistry
from .snapshot import ChangelogComponent, CheckpointMetadata, KeyedStateSnapshot
from .state import (
    ListStateDescriptor,
    MapStateDescriptor,
    Serializer,
    StateDescriptor,
    StateKind,
    TaggedSerializer,
    ValueStateDescriptor,
)
from .upload import Uploader
from .writer import StateChangelogWriter

__version__ = "0.1.0"

__all__ = [
    "ChangelogComponent",
    "ChangelogConfig",
    "ChangelogKeyedStateBackend",
    "ChangelogTree",
    "CheckpointCoordinator",
    "CheckpointDeclinedError",
    "CheckpointError",
    "CheckpointMetadata",
    "CheckpointRetention",
    "CompletedCheckpoint",
    "ConfigError",
    "DirectTransport",
    "DstlError",
    "FormatError",
    "HandleError",
    "HedgePolicy",
    "InvalidValueError",
    "KeyGroupError",
    "KeyGroupRange",
    "KeyedStateSnapshot",
    "ListState",
    "ListStateDescriptor",
    "MapState",
    "MapStateDescriptor",
    "MaterializedHandle",
    "MissingDependencyError",
    "NamespaceError",
    "NodeUnavailableError",
    "PendingCheckpoint",
    "PersistError",
    "RestoreError",
    "RestoreMode",
    "RestoreSource",
    "Segment",
    "Serializer",
    "SharedStateRegistry",
    "SqnError",
    "StateChangelogClient",
    "StateChangelogHandle",
    "StateChangelogWriter",
    "StateDescriptor",
    "StateError",
    "StateKind",
    "StorageError",
    "TaggedSerializer",
    "Uploader",
    "ValueState",
    "ValueStateDescriptor",
    "WriterClosedError",
    "assign_key_group",
    "attach",
    "cleanup_orphans",
    "deploy",
    "key_group_range_for_subtask",
    "load_checkpoint",
    "stable_hash",
    "tracing",
]
