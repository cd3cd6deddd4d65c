"""``asyncgrpo bench prefix-reuse`` runs on the tiny shape and its tail prefill agrees with the full one."""

from __future__ import annotations

from asyncgrpo_cli.bench.prefix_reuse import main


def test_prefix_reuse_bench_prints_both_prefills_and_they_agree(capsys):
    main(["--shape", "tiny", "--prompt", "64", "--cached", "48", "--batch", "1,3", "--repeats", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["1", "3"]
    for _, full_s, tail_s, speedup, diff in rows:
        assert float(full_s) > 0 and float(tail_s) > 0 and speedup.endswith("x")
        assert float(diff) < 1e-4  # the same logits: reuse is exact
