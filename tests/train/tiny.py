"""What the train tests share: the tiny CPU training config, and the numbers of a JSON document."""

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


def numbers(value, path=""):
    """Every (path, number) in a JSON document."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from numbers(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from numbers(v, f"{path}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value
