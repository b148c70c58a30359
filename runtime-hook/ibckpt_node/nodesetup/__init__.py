"""nodesetup: what the node agent changes on its node (containerd's runtime handler, the Node's
label) after checking the node's prerequisites, and how it undoes it (docs/install.md)."""
