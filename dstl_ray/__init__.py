"""dstl-ray: FLIP-158's Durable Short-Term Log as a tree of Ray actors.

Writers append state changes in memory; on a checkpoint each node actor batches the requests it
gets and either forwards them to its parent or writes ONE changelog file to DFS.
"""

from .checkpoint.change_feed import Change, read_change_feed
from .checkpoint.coordinator import (
    CheckpointCoordinator,
    CheckpointRetention,
    PendingCheckpoint,
    RestoreMode,
)
from .checkpoint.hub import CheckpointHub
from .checkpoint.hub_participant import HubParticipant
from .checkpoint.hub_wire import HubAddress
from .checkpoint.metadata import CheckpointMetadata
from .checkpoint.reader import read_state
from .checkpoint.recovery import CompletedCheckpoint, cleanup_orphans, load_checkpoint
from .config import ChangelogConfig
from .deploy import ChangelogTree, attach, deploy
from .errors import (
    CheckpointDeclinedError,
    CheckpointError,
    ConfigError,
    DeadlineError,
    DstlError,
    FencedError,
    FormatError,
    HandleError,
    HubError,
    InvalidValueError,
    JobLeaseError,
    KeyGroupError,
    LocalStateError,
    MissingDependencyError,
    MissingStateError,
    NamespaceError,
    NodeUnavailableError,
    PersistError,
    RestoreError,
    SchemaError,
    SqnError,
    StaleIncarnationError,
    StateError,
    StorageError,
    WriterClosedError,
)
from .format.materialized import MaterializedHandle
from .format.segment import Segment
from .keygroups import KeyGroupRange, assign_key_group, key_group_range_for_subtask, stable_hash
from .log.client import StateChangelogClient
from .log.handle import StateChangelogHandle
from .log.writer import StateChangelogWriter
from .merging.pool import FileMergingOptions
from .observability import tracing
from .state.backend import (
    ChangelogKeyedStateBackend,
    ListState,
    MapState,
    RestoreSource,
    ValueState,
)
from .state.records import (
    ListStateDescriptor,
    MapStateDescriptor,
    Serializer,
    StateDescriptor,
    StateKind,
    TaggedSerializer,
    ValueStateDescriptor,
)
from .state.registry import SharedStateRegistry
from .state.snapshot import ChangelogComponent, KeyedStateSnapshot
from .state.ttl import StateTtlConfig
from .transport.direct import DirectTransport
from .upload.hedging import HedgePolicy
from .upload.uploader import Uploader

__version__ = "0.1.0"

__all__ = [
    "Change",
    "ChangelogComponent",
    "ChangelogConfig",
    "ChangelogKeyedStateBackend",
    "ChangelogTree",
    "CheckpointCoordinator",
    "CheckpointDeclinedError",
    "CheckpointError",
    "CheckpointHub",
    "CheckpointMetadata",
    "CheckpointRetention",
    "CompletedCheckpoint",
    "ConfigError",
    "DeadlineError",
    "DirectTransport",
    "DstlError",
    "FencedError",
    "FileMergingOptions",
    "FormatError",
    "HandleError",
    "HedgePolicy",
    "HubAddress",
    "HubError",
    "HubParticipant",
    "InvalidValueError",
    "JobLeaseError",
    "KeyGroupError",
    "KeyGroupRange",
    "KeyedStateSnapshot",
    "ListState",
    "ListStateDescriptor",
    "LocalStateError",
    "MapState",
    "MapStateDescriptor",
    "MaterializedHandle",
    "MissingDependencyError",
    "MissingStateError",
    "NamespaceError",
    "NodeUnavailableError",
    "PendingCheckpoint",
    "PersistError",
    "RestoreError",
    "RestoreMode",
    "RestoreSource",
    "SchemaError",
    "Segment",
    "Serializer",
    "SharedStateRegistry",
    "SqnError",
    "StaleIncarnationError",
    "StateChangelogClient",
    "StateChangelogHandle",
    "StateChangelogWriter",
    "StateDescriptor",
    "StateError",
    "StateKind",
    "StateTtlConfig",
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
    "read_change_feed",
    "read_state",
    "stable_hash",
    "tracing",
]
