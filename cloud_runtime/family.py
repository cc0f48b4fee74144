"""What a protocol family's handlers hold (cloud_runtime.token_handlers, cloud_runtime.split_handlers): the config,
the model's facts, the work runner, the cloud's tables, admission, and the request being handled. Plain Python."""
from __future__ import annotations

from cloud_runtime.config import CloudConfig
from cloud_runtime.quotas import Admission
from cloud_runtime.sessions import Arrival
from cloud_runtime.state import CloudTables
from cloud_runtime.work import ModelFacts, ModelWork
from hat_split.wire import messages as P


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

    @property
    def tree_nodes(self) -> int:
        """The largest draft tree a Verify may carry here (the Welcome's max_tree_nodes)."""
        return self.model.tree_nodes(self.config.tree_nodes)

    def check_trees_taken(self) -> None:
        """ProtocolError, with the reason, when this cloud takes no draft trees (its model, or max_tree_nodes 0)."""
        if not self.tree_nodes:
            raise P.ProtocolError("invalid", self.model.tree_refusal or "this cloud takes no draft trees "
                                                                      "(max_tree_nodes = 0): send chains")
