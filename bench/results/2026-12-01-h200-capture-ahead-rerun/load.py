"""A concurrent GPU load for a given number of seconds (matmuls and copies on two streams)."""
import sys, time
import torch
end = time.time() + float(sys.argv[1])
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
big = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
s = torch.cuda.Stream()
while time.time() < end:
    for _ in range(20):
        c = a @ b
    with torch.cuda.stream(s):
        big.add_(1)
    torch.cuda.synchronize()
print("load done")
