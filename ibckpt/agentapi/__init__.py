"""The operator <-> node agent wire format (models.py) and the one client the operator uses (client.py).

Both components import this package and nothing of each other; docs/node-agent.md describes the API.
"""

from ibckpt.agentapi.client import AgentClient, AgentError
from ibckpt.agentapi.models import (
    API_PREFIX,
    DEFAULT_PORT,
    AbortRequest,
    AgentInfo,
    CheckpointRequest,
    ContainerList,
    ErrorReply,
    ImageDestination,
    ImageSource,
    PhaseTimeouts,
    RankPhase,
    RankProgress,
    RankRef,
    RegisteredContainer,
    RestoreRank,
    RestoreRequest,
    SecretRef,
    SessionKind,
    SessionReport,
    SessionState,
)
from ibckpt.vocabulary import CHECKPOINT_MILESTONES, RESTORE_MILESTONES, Milestone, Mode, position

__all__ = [
    "API_PREFIX",
    "CHECKPOINT_MILESTONES",
    "DEFAULT_PORT",
    "RESTORE_MILESTONES",
    "AbortRequest",
    "AgentClient",
    "AgentError",
    "AgentInfo",
    "CheckpointRequest",
    "ContainerList",
    "ErrorReply",
    "ImageDestination",
    "ImageSource",
    "Milestone",
    "Mode",
    "PhaseTimeouts",
    "RankPhase",
    "RankProgress",
    "RankRef",
    "RegisteredContainer",
    "RestoreRank",
    "RestoreRequest",
    "SecretRef",
    "SessionKind",
    "SessionReport",
    "SessionState",
    "position",
]
