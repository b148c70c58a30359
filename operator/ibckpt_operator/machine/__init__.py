"""The operator's pure state machines: a CheckpointJob's and a RestoreJob's.

(state, event, now) -> Transition(new state, actions, wake_at). Events are what the operator observed,
actions what it must do (actions.py), both plain data; the drivers write the new state to status
(status.py), then run the actions, and call again at wake_at. No Kubernetes, kopf or boto3 import here
(import-linter).
"""

from ibckpt_operator.machine.checkpoint import CheckpointMachine, JobConfig, JobState, JobStep
from ibckpt_operator.machine.claims import PodClaims
from ibckpt_operator.machine.core import Action, Event, Member, PodRef, StepAction, Transition, Unknown
from ibckpt_operator.machine.restore import RestoreConfig, RestoreMachine, RestoreState, RestoreStep

__all__ = [
    "Action",
    "CheckpointMachine",
    "Event",
    "JobConfig",
    "JobState",
    "JobStep",
    "Member",
    "PodClaims",
    "PodRef",
    "RestoreConfig",
    "RestoreMachine",
    "RestoreState",
    "RestoreStep",
    "StepAction",
    "Transition",
    "Unknown",
]
