"""dstl-ray: FLIP-158's Durable Short-Term Log as a tree of Ray actors.

Writers append state changes in memory; on a checkpoint each node actor batches the requests it
gets and either forwards them to its parent or writes ONE changelog file to DFS.
"""

from . import tracing
from .client import DirectTransport, StateChangelogClient
from .config import ChangelogConfig
from .deploy import ChangelogTree, attach, deploy
from .errors import (
    CheckpointError,
    ConfigError,
    DstlError,
    FormatError,
    HandleError,
    InvalidValueError,
    KeyGroupError,
    NodeUnavailableError,
    PersistError,
    SqnError,
    StorageError,
    WriterClosedError,
)
from .faults import FaultSpec, FaultyStorage, InjectedFault, LatencyDistribution
from .handle import Segment, StateChangelogHandle
from .hedging import HedgePolicy
from .keygroups import KeyGroupRange, assign_key_group, key_group_range_for_subtask, stable_hash
from .upload import Uploader
from .writer import StateChangelogWriter

__version__ = "0.1.0"

__all__ = [
    "ChangelogConfig",
    "ChangelogTree",
    "CheckpointError",
    "ConfigError",
    "DirectTransport",
    "DstlError",
    "FaultSpec",
    "FaultyStorage",
    "FormatError",
    "HandleError",
    "HedgePolicy",
    "InjectedFault",
    "InvalidValueError",
    "KeyGroupError",
    "KeyGroupRange",
    "LatencyDistribution",
    "NodeUnavailableError",
    "PersistError",
    "Segment",
    "Uploader",
    "SqnError",
    "StateChangelogClient",
    "StateChangelogHandle",
    "StateChangelogWriter",
    "StorageError",
    "WriterClosedError",
    "assign_key_group",
    "attach",
    "deploy",
    "key_group_range_for_subtask",
    "stable_hash",
    "tracing",
]
