"""Device tensors: how a collective's cpu, cuda, mps (Metal or unified) and fake-device tensors
become the host bytes and tickets the engine takes. ``plan`` is the one entry the backend calls
(``prepare``, then ``launch``); below it ``device_tensors`` (the torch side of an op's ordering),
then ``device_order`` the ticket protocol every device kind implements; one module per
kind (``cuda_ops``, ``metal_ops``/``metal_tensors``, ``unified``, ``fake_device``); the CUDA
emulator and ``device_check`` let the CUDA path run without a GPU (scripts/cuda_check.py --emulated).
"""
