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


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=float("inf")), r"lr \(--lr\) must be a finite number > 0, got inf"),  # trained to NaN losses, rc 0
        (dict(lr=float("nan")), r"lr \(--lr\) must be a finite number > 0, got nan"),
        (dict(lr=0.0), r"lr \(--lr\) must be a finite number > 0"),
        (dict(chunk_len=10, min_chunk_len=100), r"min_chunk_len \(--min-chunk-len, default 64\) is 100 but chunk_len"),
    ],
)
def test_config_rejects_an_infinite_lr_and_a_chunk_len_below_min_chunk_len(kwargs, match):
    # Issue #31 item 7: both were accepted without comment.
    with pytest.raises(ValueError, match=match) as e:
        TrainConfig(**kwargs).validate()
    assert "\n" not in str(e.value)
    TrainConfig(chunk_len=100, min_chunk_len=100).validate()  # equal is fine
    TrainConfig(chunk_len=None, min_chunk_len=100).validate()  # no chunk_len: the stream clamps to the top rung


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lr", "inf"], "lr (--lr) must be a finite number > 0, got inf"),
        (["--chunk-len", "10", "--min-chunk-len", "100"], "pass --min-chunk-len <= 10 or --chunk-len >= 100"),
    ],
)
def test_train_cli_reports_the_config_error_in_one_line_and_exits_2(tmp_path, capsys, flags, message):
    # Here rather than in tests/test_cli.py: the CLI passes TrainConfig.validate's ValueError on as its error line.
    from packgraph.cli import main

    out_dir = tmp_path / "run"
    code = main(["train", "--device", "cpu", "--steps", "1", "--out-dir", str(out_dir), *flags])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("packgraph: error: ") and message in err and err.count("\n") == 1, err
    assert "Traceback" not in out + err and not out_dir.exists()


def test_train_cli_caps_the_default_min_chunk_len_at_chunk_len():
    """Only both flags given can contradict each other: --chunk-len 32 alone takes pieces of 32 at most and 32 at
    least, where the default of 64 would be refused."""
    from packgraph.cli import _min_chunk_len, build_parser

    def min_chunk_len(*flags):
        return _min_chunk_len(build_parser().parse_args(["train", *flags]))

    assert min_chunk_len() == 64
    assert min_chunk_len("--chunk-len", "32") == 32
    assert min_chunk_len("--chunk-len", "512") == 64
    assert min_chunk_len("--chunk-len", "512", "--min-chunk-len", "8") == 8


def test_the_attention_backend_is_checked_and_resolved():
    """``flash``, ``doc_mask`` (one bucket, ``document_mask_buckets``) or ``auto`` (the faster on the device: on the
    CPU, flash without measuring); ladders belong to FlashAttention; the document mask cannot train on the CPU."""
    import torch

    from packgraph.buckets import default_buckets, document_mask_buckets

    with pytest.raises(ValueError, match="attention_backend must be one of"):
        TrainConfig(attention_backend="cudnn").validate()
    with pytest.raises(ValueError, match="bucket ladders are FlashAttention's"):
        TrainConfig(attention_backend="doc_mask", capacity_ladder=(8, 32)).validate()
    doc_mask = TrainConfig(T=512, attention_backend="doc_mask").validate()
    assert doc_mask.bucket_policy() == document_mask_buckets(512)
    assert doc_mask.model_config().attention_backend == "doc_mask"
    with pytest.raises(ValueError, match="cannot train on the CPU"):
        doc_mask.resolved(torch.device("cpu"))
    auto = TrainConfig(T=512, attention_backend="auto").validate()
    with pytest.raises(ValueError, match="TrainConfig.resolved"):
        auto.bucket_policy()
    lines = []
    resolved = auto.resolved(torch.device("cpu"), lines.append)
    assert resolved.attention_backend == "flash" and resolved.bucket_policy() == default_buckets(512)
    assert lines == ["attention backend: flash (auto: cpu: the document mask has no backward)"]


def test_train_cli_refuses_the_document_mask_on_the_cpu_in_one_line(tmp_path, capsys):
    from packgraph.cli import main

    out_dir = tmp_path / "run"
    code = main(
        ["train", "--device", "cpu", "--steps", "1", "--attention-backend", "doc_mask", "--out-dir", str(out_dir)]
    )
    _, err = capsys.readouterr()
    assert code == 2 and "cannot train on the CPU" in err and err.count("\n") == 1, err
    assert not out_dir.exists()
