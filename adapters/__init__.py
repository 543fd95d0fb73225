"""Framework adapters: kvsparse.adapters.torch, .tensorflow, .mxnet, .jax.

Each adapter is plain Python; tensors cross into and out of the framework
through DLPack (kvsparse._core.from_dlpack / to_dlpack), without copies.
Import the one you need; none is imported here, so no framework is loaded
that you did not ask for.
"""
