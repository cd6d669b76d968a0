"""The run's Chrome trace file, as pure file writing (the PPO runs check it end to end)."""

from __future__ import annotations

import json

from rayhf.metrics.trace import TraceSpan, TraceWriter, read_trace


def _span(name: str, track: str, start: float) -> TraceSpan:
    role, layout = track.split(".", 1)
    return TraceSpan(name, "call", role, layout, track, start, start + 0.5)


def test_a_resumed_run_appends_to_the_same_tracks(tmp_path):
    path = tmp_path / "trace.json"
    first = TraceWriter(path)
    first.write(1, [_span("actor_gen", "actor.d0-1.dp2", 10.0), _span("ref_inf", "ref.d0", 11.0)])
    first.close()
    again = TraceWriter(path)  # --resume: the file is there
    again.write(2, [_span("actor_gen", "actor.d0-1.dp2", 20.0)])
    again.close()
    events = read_trace(path)
    complete = [e for e in events if e["ph"] == "X"]
    assert [(e["args"]["step"], e["name"]) for e in complete] == [
        (1, "actor_gen"), (1, "ref_inf"), (2, "actor_gen")
    ]  # fmt: skip
    assert complete[0]["tid"] == complete[2]["tid"] != complete[1]["tid"]
    names = [e["args"]["name"] for e in events if e["name"] == "thread_name"]
    assert names == ["actor.d0-1.dp2", "ref.d0"], "each track is named once"
    assert complete[1]["ts"] == 11.0e6 and complete[1]["dur"] == 0.5e6  # microseconds
    # Chrome's and Perfetto's array form: valid JSON once the optional ']' is added.
    text = path.read_text().rstrip()
    assert text.startswith("[") and text.endswith(",")
    assert json.loads(text[:-1] + "]") == events


def test_ray_task_events_join_the_trace_as_their_own_process(tmp_path):
    path = tmp_path / "trace.json"
    trace = TraceWriter(path)
    trace.write(1, [_span("actor_gen", "actor.d0", 10.0)])
    ray_events = [  # the shape ray.timeline() returns
        {"cat": "task::RoleWorker.dag_call", "name": "dag_call", "pid": "10.0.0.1",
         "tid": "worker:ab", "ts": 10.1e6, "dur": 4e5, "ph": "X", "args": {"task_id": "t1"}},
        {"cat": "task::RoleWorker.setup", "name": "setup", "pid": "10.0.0.1",
         "tid": "worker:ab", "ts": 5.0e6, "dur": 1e5, "ph": "X", "args": {}},  # before the run
    ]  # fmt: skip
    assert trace.write_ray_events(ray_events, since=9.0) == 1
    trace.close()
    events = read_trace(path)
    ray_side = [e for e in events if e["pid"] != 0]
    assert [(e["name"], e["pid"]) for e in ray_side] == [("dag_call", "ray 10.0.0.1")]
