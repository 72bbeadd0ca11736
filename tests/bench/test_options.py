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
