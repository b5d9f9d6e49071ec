"""Observability: what a run records about itself, and how it is read back.

| module | holds |
|---|---|
| `tracking.py` | `MetricsSink` (the step-record seam), `JsonlSink` (metrics.jsonl) and the tracker sinks |
| `clock.py` | `Clock`: busy and idle seconds per side over wall time; `BusyClock`: busy while any work runs |
| `spans.py` | `SpanLog`: per-process spans (decode passes, steps, publishes) written to `spans/` |
| `timeline.py` | `Timeline`: spans put back together across processes, group lives, idle intervals |
| `flops.py` | `FlopModel` (FLOPs of a forward pass), `matmul_peak` (the machine's probed peak), `FlopTally` |
| `doctor.py` | `Doctor`: the run doctor, fed each step record, reports each pattern of a stalled run once |
| `patterns.py` | the doctor's patterns: pure checks over summaries of the step records, with cause and fix |
| `report.py` | `nonstop report`: the HTML report and figures of a run folder |
| `consumed.py` | what the trainer trained and the buffer dropped, kept in checkpoints; `nonstop verify` reads it |
"""
