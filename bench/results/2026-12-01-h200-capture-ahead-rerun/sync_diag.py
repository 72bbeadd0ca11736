"""Device diagnostic: where the eager sync-test's extra sync at step 4 comes from (stack of each sync warning)."""
import tempfile, traceback, warnings
import torch
from packgraph.train.trainer import TrainConfig, Trainer

def show(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" in str(message):
        print("SYNC:", str(message)[:90])
        print("".join(traceback.format_stack(limit=14)[:-1]))

with tempfile.TemporaryDirectory() as d:
    cfg = TrainConfig(preset="tiny", steps=12, T=1024, lr=3e-3, warmup_steps=3, max_docs=40, device="cuda",
                      out_dir=d, progress=False, plot=False, save_checkpoint=False, graphs=False, log_every=4,
                      max_seqlen_ladder=(1024,), capacity_ladder=(64,))
    t = Trainer(cfg, echo=None)
    for _ in range(3):
        t.step()
    torch.cuda.synchronize()
    warnings.showwarning = show
    for s in range(4, 6):
        print(f"--- step {s}")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                t.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    t.close()
