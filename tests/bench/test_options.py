"""The flags of ``packgraph bench``: cells, and how a preset narrows."""

import pytest

from packgraph.bench.methods import METHODS
from packgraph.bench.options import build_parser, resolve


def test_cell_methods_keep_names_with_a_plus(capsys):
    parser = build_parser()
    args = parser.parse_args(["--cell", "medium:8192:corpus:packgraph+compile,packgraph-model+compile"])
    assert args.cell == [["medium", 8192, "corpus", ["packgraph+compile", "packgraph-model+compile"]]]
    with pytest.raises(SystemExit):
        parser.parse_args(["--cell", "small:2048:corpus:eager+padded"])  # the old separator: no such method
    assert "unknown method(s) ['eager+padded']" in capsys.readouterr().err


def test_standard_preset_is_the_issue_cells_and_narrows_by_flags():
    parser = build_parser()
    cfg = resolve(parser.parse_args(["--standard"]))
    cells = {(m, T, mix): methods for m, T, mix, methods in cfg["cells"]}
    # every method where the references are, but compile-ro-raw (--full only: one recompile per new shape)
    assert set(cells["small", 2048, "corpus"]) == set(METHODS) - {"compile-ro-raw"}
    assert {"packgraph-model+compile", "compile-ro"} <= set(cells["medium", 8192, "corpus"])
    assert {"small", "medium"} == set(cfg["models"]) and {"corpus", "short", "long", "buckets"} == set(cfg["mixes"])
    assert {"eager", "packgraph"} <= set(cells["small", 2048, "buckets"])  # the tour of every bucket
    # the cells the targets need run first: a time limit cuts the tail
    assert [c[:3] for c in cfg["cells"][:2]] == [["small", 2048, "corpus"], ["medium", 8192, "corpus"]]
    narrowed = resolve(parser.parse_args(["--standard", "--models", "medium", "--methods", "eager,compile-ro"]))
    assert narrowed["cells"] == [["medium", 8192, "corpus", ["eager", "compile-ro"]]]
    with pytest.raises(SystemExit):
        parser.parse_args(["--cell", "tiny:x:short"])


def test_ladder_flag_picks_the_bucket_policy_of_the_run():
    from packgraph.bench.presets import ladder_policy
    from packgraph.buckets import default_buckets

    parser = build_parser()
    assert resolve(parser.parse_args(["--standard"]))["ladder"] == "default"
    assert resolve(parser.parse_args(["--quick", "--ladder", "capacity-x2"]))["ladder"] == "capacity-x2"
    with pytest.raises(SystemExit):
        parser.parse_args(["--ladder", "x3"])
    assert ladder_policy("default", 2048) == default_buckets(2048)
    x2 = ladder_policy("capacity-x2", 2048)
    assert x2.max_seqlen_ladder == default_buckets(2048).max_seqlen_ladder
    assert x2.capacity_ladder == (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    both = ladder_policy("both-x2", 8192)
    assert both.max_seqlen_ladder == (256, 512, 1024, 2048, 4096, 8192) and both.capacity_ladder[0] == 8
    # every ladder accepts what the default does: at most T documents of at most T tokens
    for name in ("capacity-x2", "both-x2"):
        for T in (1, 7, 128, 2048, 8192):
            policy = ladder_policy(name, T)
            assert policy.max_seqlen == T and policy.max_capacity == T
    with pytest.raises(ValueError, match="unknown ladder"):
        ladder_policy("x3", 2048)
