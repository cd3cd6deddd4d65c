"""Host-to-GPU copies that do not wait for the GPU.

``tensor.to("cuda", non_blocking=True)`` from ordinary (pageable) host memory returns only once the stream has
reached the copy: measured on an H200, moving a 2.6 MB packed row took 0.4 ms with the GPU idle and 80 ms with
83 ms of work queued ahead, so the host waited for the previous row's backward before it could launch the next
row's forward, and the GPU then idled while it did. From page-locked (pinned) memory the same copy returns at once
(0.25 ms with the same queue). So the copy goes through a pinned block of torch's caching host allocator: the one
extra host memcpy is small, and the allocator reuses the block only after the copy that read it has completed, so
the source may be dropped right away.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``; from the CPU to a GPU through pinned memory, without waiting for queued work."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
