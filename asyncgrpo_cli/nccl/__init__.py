"""NCCL for weight transfer: a ctypes binding of libnccl and vLLM's packed-broadcast wire format.

A leaf package: the trainer's sender (``sync/nccl.py``) and the embedded server's receiver
(``embedded/weight_transfer.py``) both use it, and it imports nothing else from asyncgrpo_cli.
"""
