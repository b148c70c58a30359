"""ibckpt_native: the Python side of libibckpt the product uses: the control client (control.py).

The test side (paths of the build, harness, local coordinator, cffi core) is native/shimtest.
"""
