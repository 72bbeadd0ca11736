"""The CPU dry run that several bench tests read: run once for the package."""

import pytest

from packgraph.bench import main


@pytest.fixture(scope="package")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--dry-run", "--out", str(out), "--methods", "eager,padded,packgraph", "--steps", "2"]
    status = main(argv)
    return out, argv, status
