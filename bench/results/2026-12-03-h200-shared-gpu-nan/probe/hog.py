"""Keeps the GPU busy from another process (large bf16 matmuls), so that a process sharing it runs its kernels late."""
import time
import torch

a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.time() + 400
while time.time() < end:
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
