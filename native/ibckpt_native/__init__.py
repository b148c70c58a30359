"""ibckpt_native."""
