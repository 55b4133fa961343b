"""A busy process: one torch thread multiplying small matrices until killed."""
import torch

torch.set_num_threads(1)
a = torch.randn(64, 64)
while True:
    a = torch.tanh(a @ a)
