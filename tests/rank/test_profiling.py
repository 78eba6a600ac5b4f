"""What a rank sends back of its profiled cell's trace (rank/profiling.py): the trace gzipped, or
where it stayed when it is over what is sent back, or why there is none."""

from __future__ import annotations

import gzip

from monarch_nb.rank import profiling


def test_a_trace_goes_back_gzipped_and_its_file_goes(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text('{"traceEvents": []}')
    payload, keep = profiling._payload(str(path), None)
    assert gzip.decompress(payload["trace"]) == b'{"traceEvents": []}'
    assert payload["problem"] is None and not keep


def test_a_trace_over_the_bound_stays_on_its_host_and_says_where(tmp_path, monkeypatch):
    monkeypatch.setattr(profiling, "MAX_TRACE_BYTES", 16)
    path = tmp_path / "trace.json"
    path.write_bytes(bytes(range(256)) * 64)  # gzip cannot squeeze it under 16 bytes
    payload, keep = profiling._payload(str(path), None)
    assert payload["trace"] is None and keep
    assert f"it is on its host at {path}" in payload["problem"]
    assert "--profile active=1" in payload["problem"]


def test_no_trace_says_why(tmp_path):
    payload, keep = profiling._payload(str(tmp_path / "none.json"), None)
    assert payload == {
        "trace": None,
        "problem": "no trace: the cell ended before its first recorded step",
    }
    assert not keep
    payload, _ = profiling._payload(str(tmp_path / "none.json"), "the profiler could not start: x")
    assert payload["problem"] == "the profiler could not start: x"
