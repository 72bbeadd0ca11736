"""The tiny CPU training config the train tests share."""

from packgraph.train import TrainConfig


def tiny_cfg(tmp_path, name="run", **kw) -> TrainConfig:
    base = dict(
        preset="tiny",
        steps=30,
        T=256,
        lr=3e-3,
        warmup_steps=3,
        max_docs=20,
        device="cpu",
        out_dir=str(tmp_path / name),
        progress=False,
        plot=False,
    )
    base.update(kw)
    return TrainConfig(**base)
