"""The kopf handlers: thin. Each loads an object, hands it to its driver, and lets the machine decide.

`kopf run -m ibckpt_operator.handlers` (or `ibckpt-operator`) registers all of them.
"""

from ibckpt_operator.handlers import (
    checkpoint,
    checkpointjob,
    drain,
    lifecycle,
    recovery,
    restorejob,
    schedule,
    storage,
)

__all__ = [
    "checkpoint",
    "checkpointjob",
    "drain",
    "lifecycle",
    "recovery",
    "restorejob",
    "schedule",
    "storage",
]
