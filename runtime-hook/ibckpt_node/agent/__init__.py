"""The node agent daemon `ibckpt-agent`: installs the node pieces, hosts the container registry, serves the
agent API (ibckpt.agentapi) to the operator and runs this node's part of each session with the driver."""
