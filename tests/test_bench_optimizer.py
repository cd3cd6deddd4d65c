"""``asyncgrpo bench optimizer`` on CPU: both ways run on the tiny shape, agree bit for bit, and are reported side
by side; bad keys are refused with the key named."""

from __future__ import annotations

import re

import pytest

from asyncgrpo_cli.bench import optimizer as bench
from asyncgrpo_cli.errors import UserError


def test_bench_optimizer_reports_both_ways_exact_and_their_ratio(capsys):
    bench.main(["shapes=tiny", "rounds=2", "device=cpu"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny |")]
    assert [r.split("|")[3].strip() for r in rows] == list(bench.WAYS)
    for r in rows:
        host, dev, exact = (c.strip() for c in r.split("|")[4:7])
        assert float(host) > 0 and float(dev) == float(host) and exact == "yes"  # on CPU device = host time
    assert re.search(r"tiny: local shards vs torch: host \d+\.\d\dx less", out)


@pytest.mark.parametrize(
    ("args", "match"),
    [(["shapes=7b"], "bench.shapes: 7b unknown"), (["rounds=1"], "bench.rounds=1"), (["round=3"], "round")],
)
def test_bench_optimizer_refuses_bad_keys(args, match):
    with pytest.raises(UserError, match=match):
        bench.main(args)
