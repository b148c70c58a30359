"""ibckpt: transparent checkpoint/restart of RDMA (verbs) jobs on Kubernetes.

This package is the shared core (models, image store, CLI). The components
that use it live in ibckpt_operator (operator/), ibckpt_node (runtime-hook/)
and ibckpt_native (native/).
"""

__version__ = "0.1.0"
