"""Device diagnostic: deterministic tiny training, eager vs graphed-layer, repeated; prints first difference."""
import dataclasses, math, sys, tempfile, time
import torch
from packgraph.train.trainer import TrainConfig, train, Trainer
from packgraph.train.step import deterministic_kernels

reps = int(sys.argv[1]); tag = sys.argv[2]; every = int(sys.argv[3])
def cfg(d, **kw):
    return TrainConfig(preset="tiny", steps=25, T=1024, lr=3e-3, warmup_steps=3, max_docs=40, device="cuda",
                       out_dir=d, progress=False, plot=False, save_checkpoint=False, deterministic=True, **kw)
import os
def poison():
    if os.environ.get("POISON"):
        free, _ = torch.cuda.mem_get_info()
        x = torch.empty(int(free * 0.9) // 4, dtype=torch.float32, device="cuda").fill_(float("nan"))
        torch.cuda.synchronize(); del x; torch.cuda.empty_cache()
with tempfile.TemporaryDirectory() as d:
    eager = train(cfg(d + "/e", graphs=False), echo=None).losses
    for r in range(reps):
        poison()
        t = Trainer(cfg(d + f"/g{r}", graphs=True, scope="layer", log_every=every), echo=None)
        caps = []
        try:
            with deterministic_kernels(True):
                while not t.done:
                    t.step()
                res = t.finish()
            caps = [(row["step"], row.get("captures"), row.get("graphs")) for row in t.rows]
        finally:
            t.close()
        g = res.losses
        bad = [i for i, (a, b) in enumerate(zip(eager, g)) if a != b or math.isnan(b)]
        print(f"[{tag}] rep {r}: equal={g == eager} first_diff={bad[:1]} "
              f"nan_steps={[i for i, b in enumerate(g) if math.isnan(b)][:3]} sets={res.num_graph_sets}", flush=True)
        if bad:
            i = bad[0]
            print(f"[{tag}]   eager[{i-1}:{i+2}]={eager[max(i-1,0):i+2]} graphed={g[max(i-1,0):i+2]}")
            print(f"[{tag}]   capture rows={[c for c in caps if c[0] >= i - 3][:6]}")
    print(f"[{tag}] capture rows (last rep): {caps}")
