"""TrainConfig validation."""

import pytest

from packgraph.train import TrainConfig, train


def test_config_validation():
    with pytest.raises(ValueError, match="unknown preset"):
        TrainConfig(preset="nope").validate()
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0).validate()
    with pytest.raises(ValueError, match="above T"):
        TrainConfig(T=256, max_seqlen_ladder=(128, 512)).validate()
    with pytest.raises(ValueError, match="strictly increasing"):
        TrainConfig(capacity_ladder=(8, 8)).validate()
    with pytest.raises(ValueError, match="CUDA"):
        train(TrainConfig(graphs=True, device="cpu", steps=1))
