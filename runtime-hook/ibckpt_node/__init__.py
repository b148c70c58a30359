"""ibckpt_node."""
