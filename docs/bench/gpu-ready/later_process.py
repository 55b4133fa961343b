import time, torch, relaxspec
torch.set_num_threads(1)
t = time.perf_counter()
relaxspec.generate([1], "lantern", seed=0, compile=True)
a = time.perf_counter() - t
t = time.perf_counter()
relaxspec.generate([1], "lantern", seed=1, compile=True)
print(f"first image {a:.1f} s, second {time.perf_counter() - t:.2f} s")
