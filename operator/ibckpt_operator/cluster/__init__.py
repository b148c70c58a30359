"""The cluster adapters: the Kubernetes client (kube.py), the node agents, the image store, and the
objects the operator reads and writes for its drivers (protection, leases, sources, bindings)."""
