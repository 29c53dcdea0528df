"""The fleet's timeline: samples read back as written, junk read as nothing, and workers'
samples added into one point a minute (histogram buckets, so percentiles add up)."""

from __future__ import annotations

from client.timeline import TTFT_BOUNDS_MS, Sample, percentile, points, rates, ttft_bucket


def _sample(consumer: str, queue: str, at: float, **counts) -> Sample:
    ttft = [0] * (len(TTFT_BOUNDS_MS) + 1)
    for ms in counts.pop("ttfts", []):
        ttft[ttft_bucket(ms)] += 1
    return Sample(consumer, queue, at, ttft=ttft, **counts)


def test_a_sample_reads_back_as_written_and_junk_reads_as_none():
    written = _sample("w1", "q", 0, tokens=5, finished=2, errors=1, depth=3, added=40, ttfts=[30, 700])
    read = Sample.from_wire(b"1700000000123-0", {k.encode(): str(v).encode() for k, v in written.to_wire().items()})
    assert read is not None and read.at == 1700000000.123
    assert (read.tokens, read.finished, read.errors, read.depth, read.added, read.ttft) == \
        (5, 2, 1, 3, 40, written.ttft)
    assert Sample.from_wire(b"1-0", {b"tokens": b"many"}) is None
    assert Sample.from_wire(b"1-0", {b"ttft": b"[1, 2]"}) is None  # not one count a bucket
    assert Sample.from_wire(b"1-0", {b"tokens": b"-4"}) is None


def test_workers_add_up_into_one_point_a_minute():
    now = 10_000.0 * 60
    samples = [_sample("w1", "q", now - 30, tokens=600, finished=3, depth=4, ttfts=[20, 40, 90]),
               _sample("w2", "q", now - 20, tokens=600, finished=1, depth=6, errors=2, ttfts=[4000]),
               _sample("w1", "other", now - 10, depth=1),
               _sample("w1", "q", now - 7200, tokens=10**6)]  # older than the hour: not shown
    found = points(samples, now)
    assert len(found) == 60 and found[-1].at == now
    last = found[-2]  # the minute before `now` began
    assert last.tok_s == 20.0 and last.finished == 4 and last.errors == 2
    assert last.depth == 6 + 1  # the deepest of each queue, summed over queues
    assert last.ttft_p50_ms == 50 and last.ttft_p99_ms == 5000
    assert all(p.tok_s == 0 and p.ttft_p50_ms is None for p in found[:-2])
    assert rates(samples, "w2", now)[-2] == 10.0


def test_percentiles_are_their_buckets_upper_bounds():
    assert percentile([0] * (len(TTFT_BOUNDS_MS) + 1), 0.5) is None
    counts = [0] * (len(TTFT_BOUNDS_MS) + 1)
    counts[0], counts[-1] = 99, 1
    assert percentile(counts, 0.5) == TTFT_BOUNDS_MS[0]
    assert percentile(counts, 0.999) == 2 * TTFT_BOUNDS_MS[-1]  # above the last bound
