"""Decision cores with no I/O and no clock of their own: the scheduler core and the engine cores (prefill and decode batchers).

``SchedulerCore`` (``scheduler``) takes the events of ``scheduler_events`` and returns its
commands; ``scheduler_members`` holds membership and the report/charge ledger.
"""

from dualpath.core.gc_tuning import GC_THRESHOLDS, tune_gc
from dualpath.core.scheduler import CoreConfig, SchedulerCore
from dualpath.core.scheduler_events import (
    BUFFER_FULL,
    Command,
    Decision,
    Dispatch,
    DispatchAnswered,
    DispatchFailed,
    EngineReported,
    Event,
    ExpelEngine,
    FailRequest,
    FreeSlot,
    NodeReported,
    Prefetch,
    RejectRequest,
    RequestFinished,
    RequestSubmitted,
    Requeued,
    ReserveSlot,
    SlotReserved,
    Stage,
    TaskFailed,
    TimeAdvanced,
)

__all__ = [
    "BUFFER_FULL",
    "GC_THRESHOLDS",
    "Command",
    "CoreConfig",
    "Decision",
    "Dispatch",
    "DispatchAnswered",
    "DispatchFailed",
    "EngineReported",
    "Event",
    "ExpelEngine",
    "FailRequest",
    "FreeSlot",
    "NodeReported",
    "Prefetch",
    "RejectRequest",
    "RequestFinished",
    "RequestSubmitted",
    "Requeued",
    "ReserveSlot",
    "SchedulerCore",
    "SlotReserved",
    "Stage",
    "TaskFailed",
    "TimeAdvanced",
    "tune_gc",
]
