"""What a protocol family's handlers hold (cloud_runtime.token_handlers, cloud_runtime.split_handlers): the config,
the model's facts, the work runner, the cloud's tables, admission, and the request being handled. Plain Python."""
from __future__ import annotations

from cloud_runtime.config import CloudConfig
from cloud_runtime.quotas import Admission
from cloud_runtime.sessions import Arrival
from cloud_runtime.state import CloudTables
from cloud_runtime.work import ModelFacts, ModelWork


class FamilyHandlers:
    def __init__(self, config: CloudConfig, model: ModelFacts, work: ModelWork, tables: CloudTables,
                 admission: Admission, arrival: Arrival):
        """arrival: the request being handled, set by the dispatcher (cloud_runtime.handlers)."""
        self.config = config
        self.model = model
        self.work = work
        self.tables = tables
        self.sessions = tables.sessions
        self.admission = admission
        self.arrival = arrival
