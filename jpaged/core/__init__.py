"""The host core: requests and their sequences, the scheduler, the KV block pool and its tables, beam selection,
KV sizing arithmetic. Plain Python with no JAX (tests/test_layers.py keeps it so): it decides, the runner computes.
"""
