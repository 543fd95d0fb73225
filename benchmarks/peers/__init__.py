"""Helpers of benchmarks/pull_push.py: the workload, subprocess handling and one module per peer.

Each peer module runs as its own script (``python benchmarks/peers/<peer>.py ...``) in
subprocesses that benchmarks/pull_push.py starts and always stops.
"""
