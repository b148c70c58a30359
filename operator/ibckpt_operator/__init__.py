"""ibckpt_operator."""
