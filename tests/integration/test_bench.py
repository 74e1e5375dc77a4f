"""The benchmarks run as ``bench/README.md`` says: ``python -m bench.<name>`` from the repository root.

Every module of ``bench/`` is at least imported (a script: its ``--help`` printed), so a renamed or
removed name the benchmarks use fails here, not on the day someone measures. The benchmarks that need no
HTTP load run once at a tiny size and must pass their own checks, and the servers the goals load answer one
call each. Nothing here is timed: the figures of a run this small mean nothing, and the load generator and
the goals themselves are not run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

BENCH = REPO / "bench"
MODULES = sorted(path.stem for path in BENCH.glob("*.py") if path.stem != "__init__")
SCRIPTS = [name for name in MODULES if 'if __name__ == "__main__":' in (BENCH / f"{name}.py").read_text()]
BOUND = 300  # seconds: a bound on a hang, not a timing assertion


def run_module(name: str, *argv: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", f"bench.{name}", *argv]
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=BOUND, stdin=subprocess.DEVNULL
    )


def test_the_benchmarks_the_readme_names_are_there() -> None:
    readme = (BENCH / "README.md").read_text()
    for name in SCRIPTS:
        if name.startswith("bench_"):
            assert f"python -m bench.{name}" in readme, f"{name} is not in bench/README.md"
    assert {"bench_goals", "run_all", "_harness", "_servers", "_loadgen", "_gym_baseline"} <= set(MODULES)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_runs_from_the_repository_root(name: str) -> None:
    result = run_module(name, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: "), result.stdout


@pytest.mark.parametrize("name", sorted(set(MODULES) - set(SCRIPTS)))
def test_every_helper_imports(name: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", f"import bench.{name}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    assert result.returncode == 0, result.stderr


TINY_RUNS = {
    "bench_reader": (["--lines", "200", "--repeat", "1"], "same aggregate: True"),
    "bench_writers": (
        ["--processes", "2", "--records", "24", "--inflight", "4"],
        "all checks passed: True",
    ),
    "bench_lifecycle": (["--rollouts", "20", "--rounds", "1"], "ours + freeing the space"),
    "bench_memory": (
        ["--rollouts", "20", "--lines", "100", "--only", "freeze,show,markers"],
        "otel-capture show DIR ID: peak RSS per line",
    ),
    "bench_hotpath": (["--calls", "20"], "JSONL exporter alone"),
    "bench_marker": (["--calls", "3", "--rounds", "1"], "lines on disk equal the calls: True"),
    "bench_stream_memory": (["--mb", "0.2"], "records written by the captured server: 1"),
    "bench_busy": (
        ["--seconds", "1", "--loads", "0,2", "--events", "16"],
        "every probe call answered and recorded: True",
    ),
}


@pytest.mark.parametrize("name", sorted(TINY_RUNS))
def test_a_tiny_run_passes_its_own_checks(name: str) -> None:
    argv, expected = TINY_RUNS[name]
    result = run_module(name, *argv)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert expected in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize(
    ("variant", "answer", "recorded", "tokens", "spans"),
    [
        ("alone", "plain", 0, 0, 0),
        ("floor", "plain", 205, 0, 0),
        ("capture", "plain", 205, 0, 0),
        ("capture", "rl", 205, 205, 0),
        ("traced", "plain", 205, 0, 205),
        ("alone", "stream", 0, 0, 0),
        ("capture", "stream", 10, 0, 0),
        ("capture", "rl-stream", 10, 10, 0),
    ],
)
def test_hotpath_drives_each_variant_for_callgrind(
    variant: str, answer: str, recorded: int, tokens: int, spans: int
) -> None:
    """Each variant's instructions per call are only what they say if the floor and the capture record every
    call they are driven through (the warm-up's 200 too), and the app alone none; an RL call's only if its
    tokens are read and written too (a tokens line for every call); the traced variant's only if each call's
    span is built and exported (no span anywhere else); a streamed call's only if each 512-event stream is
    recorded (an RL stream's with its tokens line), after 5 calls to warm up."""
    result = run_module("bench_hotpath", "--drive", variant, "--answer", answer, "--calls", "5")
    assert result.returncode == 0, result.stderr[-3000:]
    warm = 5 if answer.endswith("stream") else 200
    assert result.stdout == (
        f"drove 5 {answer} calls through {variant} (after {warm}), {recorded} recorded, {tokens} with a tokens "
        f"line, {spans} spans exported\n"
    ), result.stdout


def test_the_goal_servers_answer_and_count_what_they_wrote(tmp_path: Path) -> None:
    """The servers ``bench_goals`` loads, each in its own process as it starts them: one call each, and the
    stats route reports the record its writer acknowledged (what fsyncs per record are computed from)."""
    import httpx

    from bench import _harness as H
    from bench._servers import REQUEST_BODY

    path = "/ng-rollout/bench-0/v1/chat/completions"
    with H.ServerProcess(H.server_argv("bare"), name="upstream") as upstream:
        for variant, extra in (
            ("capture", []),
            ("gym", []),
            ("proxy", ["--upstream", upstream.url]),
        ):
            directory = tmp_path / variant
            argv = H.server_argv(variant, *extra, "--capture-dir", str(directory))
            with H.ServerProcess(argv, name=variant) as server:
                answer = httpx.post(server.url + path, content=REQUEST_BODY, timeout=BOUND)
                assert answer.status_code == 200 and answer.json()["object"] == "chat.completion", variant
                assert server.stats()["records"] == 1, (variant, server.log_tail())
            assert H.count_lines(directory) == 1, variant


def test_a_measured_run_gives_the_event_loop_thread_s_share_of_the_server_s_cpu(tmp_path: Path) -> None:
    """``bench_goals``' ``loop us/call`` column: the server's main thread (its event loop) alone, so a row
    says how much of a call's CPU the loop spent and how much the capture's writer thread did beside it."""
    from bench import _harness as H
    from bench import _rounds as R

    spec = R.Spec("capture", H.server_argv("capture", "--capture-dir", str(tmp_path)), capture_dir=tmp_path)
    with R.Servers() as servers:
        servers.start(spec)
        run = R.measure(servers, "capture", 1, force_python=True)
    assert run.requests > 0 and run.errors == 0, run
    assert run.loop_us is not None and run.cpu_us is not None, run
    assert 0 < run.loop_us < run.cpu_us, run  # the writer thread's CPU is the rest, never the loop's


def test_the_traced_zero_code_server_sends_its_spans_over_otlp_and_writes_its_records(tmp_path: Path) -> None:
    """Goal 1c's server is the README's Jaeger set-up: a call through it is a record on disk and two spans
    (the HTTP server span and the model call's) at the receiver, decoded from OTLP protobuf; a bench whose
    spans went nowhere would measure records only."""
    import time

    import httpx

    from bench import _harness as H
    from bench import _rounds as R
    from bench._servers import REQUEST_BODY

    path = "/ng-rollout/bench-0/v1/chat/completions"
    with H.OtlpReceiver() as receiver:
        env = {**R.zero_code_otlp_env(tmp_path, receiver), "OTEL_BSP_SCHEDULE_DELAY": "50"}
        argv = [R.INSTRUMENT, *H.server_argv("bare", "--app", "starlette")]
        with H.ServerProcess(argv, env=env, name="zero-code-otlp") as server:
            answer = httpx.post(server.url + path, content=REQUEST_BODY, timeout=BOUND)
            assert answer.status_code == 200 and answer.json()["object"] == "chat.completion"
            deadline = time.monotonic() + 60
            while receiver.received()["spans"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            received = receiver.received()
            assert received["spans"] == 2 and received["bytes"] > 0, (received, server.log_tail())
            assert receiver.model_call_spans() == 1, received
        assert H.count_lines(tmp_path) == 1


@pytest.mark.parametrize("variant", ["server-span", "lean-server-span"])
def test_the_server_span_rows_run_without_the_capture_s_instrumentor(variant: str) -> None:
    """Goal 1's diagnostic rows "server span alone" run under ``opentelemetry-instrument`` with the
    capture's instrumentor off: a model call on the plain path is not seen by a capture middleware (which
    would warn that it has no rollout id and count it), so the row measures the span alone."""
    import time

    import httpx

    from bench import _harness as H
    from bench import _rounds as R
    from bench._servers import REQUEST_BODY

    argv = [R.INSTRUMENT, *H.server_argv(variant, "--app", "starlette")]
    for env, seen in ((R.server_span_only_env(), False), (R.zero_code_env(None), True)):
        with H.ServerProcess(argv, env=env, name=variant) as server:
            answer = httpx.post(server.url + "/v1/chat/completions", content=REQUEST_BODY, timeout=BOUND)
            assert answer.status_code == 200
            time.sleep(0.2)
            assert ("has no rollout id" in server.log_tail()) is seen, (env, server.log_tail())


def test_the_floor_servers_answer_and_the_durable_ones_write_a_line_per_call(tmp_path: Path) -> None:
    """The floors ``bench_goals`` sets beside goals 1-3 do the work they stand for: the captures keep one
    line per call in the call's rollout file (the durable one acknowledges only what it synced), and the
    forwarders hand back the upstream's answer whole."""
    import httpx
    import orjson

    from bench import _harness as H
    from bench._servers import REQUEST_BODY, RESPONSE_BODY

    paths = [f"/ng-rollout/bench-{i}/v1/chat/completions" for i in (0, 1, 1)]
    with H.ServerProcess(H.server_argv("bare"), name="upstream") as upstream:
        for variant, extra in (
            ("floor", []),
            ("floor-onloop", []),
            ("floor", ["--app", "starlette"]),
            ("floor-forward", ["--upstream", upstream.url]),
            ("floor-raw", ["--upstream", upstream.url]),
        ):
            directory = tmp_path / f"{variant}{len(extra)}"
            captures = not variant.startswith(("floor-forward", "floor-raw"))
            argv = H.server_argv(variant, *extra, *(["--capture-dir", str(directory)] if captures else []))
            with H.ServerProcess(argv, name=variant) as server:
                for path in paths:
                    answer = httpx.post(server.url + path, content=REQUEST_BODY, timeout=BOUND)
                    assert answer.status_code == 200 and answer.content == RESPONSE_BODY, (variant, extra)
                if captures:
                    assert server.stats()["records"] == len(paths), (variant, extra, server.log_tail())
            if captures:
                lines = (directory / "bench-1.capture.jsonl").read_bytes().splitlines()
                assert len(lines) == 2 and H.count_lines(directory) == 3, (variant, extra)
                record = orjson.loads(lines[0])
                assert record["request"] == orjson.loads(REQUEST_BODY), (variant, extra)
                assert record["response"] == orjson.loads(RESPONSE_BODY), (variant, extra)


def test_the_floors_table_prints_a_floor_row_beside_each_goal_s_server(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench import _goal_floors as G
    from bench import _rounds as R

    names = [name for floors in G.FLOORS.values() for name in (floors.server, floors.baseline, *floors.names)]
    runs = {
        name: R.Run(name, 1000.0, 1000, 1.0, 2.0, 0, 50.0, 1.0, None, 0.0, 0.5, user_us=40.0)
        for name in names
    }
    G.floors_table(runs)
    out = capsys.readouterr().out
    for goal, floors in G.FLOORS.items():
        for name in floors.names:
            assert any(
                line.split()[0] == goal and G.FLOOR_LABELS[name] in line
                for line in out.splitlines()
                if line.strip()
            ), (goal, name, out)


def test_bench_where_gives_each_sample_to_the_innermost_code_outside_the_standard_library() -> None:
    """py-spy's raw lines (``--threads --full-filenames``, as ``bench_where`` records them): a sample goes to
    the innermost frame that is not the standard library's (an ``otel_capture`` module by its path, the
    exporter, uvicorn, the bench's app), to the event loop when every frame is the standard library's, and a
    writer thread's samples are kept apart; a frame without a path (``<string>``, a dataclass' ``__init__``)
    passes its sample to its caller."""
    from bench.bench_where import LOOP, by_owner

    venv = "/home/u/otel-capture/.venv/lib/python3.11/site-packages"
    stdlib = "/usr/lib/python3.11"
    main = "thread (101): MainThread"
    raw = "\n".join(
        [
            f"{main};run (/usr/lib/python3.11/asyncio/runners.py:118) 7",
            f"{main};run (/usr/lib/python3.11/asyncio/runners.py:118);run_asgi ({venv}/uvicorn/protocols/"
            "http/httptools_impl.py:420);send (/home/u/otel-capture/otel_capture/_capture/exchange.py:296) 3",
            f"{main};run_asgi ({venv}/uvicorn/protocols/http/httptools_impl.py:420);send ({venv}/uvicorn/"
            f"protocols/http/httptools_impl.py:522);write ({stdlib}/asyncio/transports.py:30) 5",
            f"{main};write_call (/home/u/otel-capture/exporters/model_call_jsonl.py:99);__init__ (<string>:7) 2",
            f"{main};app (/home/u/otel-capture/bench/_servers.py:176) 1",
            "thread (102): otel-capture-writer;_run (/home/u/otel-capture/otel_capture/_store/writer.py:386);"
            "still_named (/home/u/otel-capture/otel_capture/_store/fs.py:163) 4",
            "thread (103): floor-writer;run (/usr/lib/python3.11/threading.py:982) 6",
            "",
        ]
    )
    assert by_owner(raw) == {
        LOOP: 7,
        "otel_capture/_capture/exchange.py": 3,
        "uvicorn": 5,
        "exporters/model_call_jsonl.py": 2,
        "bench (the app, the floor)": 1,
        "writer: otel_capture/_store/fs.py": 4,
        f"writer: {LOOP}": 6,
    }


def test_a_kept_vllm_run_is_read_again_from_its_json(tmp_path: Path) -> None:
    """``python -m bench._vllm_figures RUN`` prints ``bench_vllm``'s tables from the JSON a run left, without
    vLLM: groups whose captured calls cost exactly 1.25x the passed ones come out at 1.25x, missed; a
    ``--floor`` run's floor groups (ABCCBA, the passed groups shared) at their own 1.10x beside them; the
    goal the run kept (a ``--spans`` run's +8 %) is the one they are judged against."""
    import orjson

    groups = []
    abccba = (
        ("captured", 1.25),
        ("passed", 1.0),
        ("floor", 1.1),
        ("floor", 1.1),
        ("passed", 1.0),
        ("captured", 1.25),
    )
    for round_ in range(4):
        for shape, ms in (("chat16", 2.0), ("stream8", 3.0), ("stream72", 10.0)):
            for mode, factor in abccba:
                cpu = ms * factor * 8
                groups.append(
                    {"start": "zero-code", "concurrency": 8, "round": round_, "mode": mode, "shape": shape,
                     "calls": 8, "cpu_ms": cpu, "main_ms": cpu * 0.9, "writer_ms": 0.0, "wall_s": 1.0}
                )  # fmt: skip
    run = tmp_path / "run.txt"
    run.write_bytes(
        b"some other output\n" + orjson.dumps({"groups": groups, "idle": {"zero-code": 2.0}}) + b"\n"
    )
    result = run_module("_vllm_figures", str(run))
    assert result.returncode == 0, result.stderr
    chat = next(line for line in result.stdout.splitlines() if "captured  chat call" in line)
    assert "1.2500x" in chat and "+0.500 ms" in chat, result.stdout
    floor = next(line for line in result.stdout.splitlines() if "floor     chat call" in line)
    assert "1.1000x" in floor and "+0.200 ms" in floor, result.stdout
    assert "c=8 captured chat call missed (+25.0 %)" in result.stdout, result.stdout
    assert "c=8 floor chat call missed (+10.0 %)" in result.stdout, result.stdout
    # a --spans run keeps its own goal (+8 %) in its JSON, and is judged against it when read again
    run.write_bytes(orjson.dumps({"groups": groups, "idle": {"zero-code": 2.0}, "goal": 1.3}) + b"\n")
    result = run_module("_vllm_figures", str(run))
    assert "goal mode/passed <= 1.30" in result.stdout, result.stdout
    assert "c=8 captured chat call met (+25.0 %)" in result.stdout, result.stdout


def test_the_capture_s_idle_close_is_counted_in_the_captured_group_it_follows() -> None:
    """The capture's writer closes a rollout's files ``IDLE_CLOSE`` after its last batch, in whatever group
    runs then: ``bench_vllm``'s figures move that CPU back to the captured group before it, from a passed
    group and from a floor group whose own writer was counted apart, never from one of a run that summed
    the two writers (it cannot be told apart there)."""
    from bench._vllm_figures import Group, attributed

    def group(mode: str, cpu: float, writer: float, floor: float | None = None) -> Group:
        return Group("zero-code", 8, 0, mode, "chat16", 8, cpu, cpu / 2, writer, 1.0, None, floor)

    found, moved = attributed(
        [
            group("passed", 40.0, 0.0),
            group("captured", 50.0, 3.0),
            group("passed", 41.0, 2.0),
            group("floor", 45.0, 1.0, 0.5),
            group("floor", 46.0, 4.0, None),
        ]
    )
    assert [(g.mode, g.cpu_ms, g.writer_ms) for g in found] == [
        ("passed", 40.0, 0.0),
        ("captured", 53.0, 6.0),
        ("passed", 39.0, 0.0),
        ("floor", 44.0, 0.0),
        ("floor", 46.0, 4.0),
    ]
    assert moved == 3.0


def test_bench_vllm_spans_send_the_zero_code_server_s_spans_over_otlp(tmp_path: Path) -> None:
    """``bench_vllm --spans`` gives the zero-code vLLM server the README's Jaeger set-up, records and spans
    (the run itself fails when fewer model-call spans than records arrive); without it, records only."""
    from bench import _harness as H
    from bench.bench_vllm import zero_code_env

    records_only = zero_code_env(tmp_path, None)
    assert records_only["OTEL_TRACES_EXPORTER"] == "model_call_jsonl"
    assert not any(name.startswith("OTEL_EXPORTER_OTLP") for name in records_only)
    with H.OtlpReceiver() as receiver:
        traced = zero_code_env(tmp_path, receiver)
    assert traced["OTEL_TRACES_EXPORTER"] == "otlp,model_call_jsonl"
    assert traced["OTEL_EXPORTER_MODEL_CALL_JSONL_DIR"] == str(tmp_path)
    assert traced["OTEL_EXPORTER_OTLP_ENDPOINT"] == receiver.url
    assert traced["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"


def test_bench_vllm_rl_calls_ask_for_what_an_rl_run_asks_for() -> None:
    """``bench_vllm --rl``'s calls ask vLLM for the prompt's and the generated tokens' ids and the log-probs
    (streamed too, with the usage); without it they ask for the answer alone."""
    from bench.bench_vllm import RL_ASKS, request_body

    chat, stream = request_body(16, False, RL_ASKS), request_body(72, True, RL_ASKS)
    for body in (chat, stream):
        assert body["return_token_ids"] is True and body["logprobs"] is True and body["top_logprobs"] == 1
    assert stream["stream"] is True and stream["stream_options"] == {"include_usage": True}
    plain = request_body(16, False, {})
    assert not {"return_token_ids", "logprobs", "top_logprobs", "stream_options"} & plain.keys()
    assert plain["max_tokens"] == 16 and plain["ignore_eos"] is True


def test_bench_vllm_rl_counts_the_tokens_lines_a_trainer_can_use(tmp_path: Path) -> None:
    """``bench_vllm --rl`` fails a run unless every captured call wrote a tokens line with the prompt's and
    each generation's ids and log-probs: an empty list or an odd (``null``) entry is counted apart, and the
    start's warm-up call is not counted."""
    from bench.bench_vllm import tokens_lines
    from otel_capture._records.codec import encode_tokens_line

    def line(prompt: list[int], ids: list[int], log_probs: list[float | None]) -> bytes:
        found = {
            "prompt_token_ids": prompt,
            "generations": [{"index": 0, "token_ids": ids, "log_probs": log_probs}],
        }
        return encode_tokens_line(found, {"model": "m"}, rollout_id="bench-0", model_call_id="c")

    (tmp_path / "bench-0.tokens.jsonl").write_bytes(line([2, 9], [5, 6], [-0.1, -0.2]) + line([2, 9], [], []))
    (tmp_path / "bench-1.tokens.jsonl").write_bytes(line([2, 9], [5], [None]) + line([2], [7], [-1.5]))
    (tmp_path / "warm-up.tokens.jsonl").write_bytes(line([2], [7], [-1.5]))
    assert tokens_lines(tmp_path) == (4, 2)


@pytest.mark.parametrize("rl", [True, False])
def test_bench_vllm_sends_the_rl_asks_on_the_wire(rl: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``bench_vllm``'s calls send, chat and streamed, is what ``--rl`` set (``main`` puts
    :data:`RL_ASKS` in the asks every call reads): a call that dropped them would measure plain calls."""
    import json

    import httpx

    from bench import bench_vllm

    monkeypatch.setattr(bench_vllm, "_asks", dict(bench_vllm.RL_ASKS) if rl else {})
    sent: list[dict[str, object]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, text="data: [DONE]\n\n")

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        bench_vllm._call(client, "http://vllm/v1/chat/completions", 16, False, {})
        bench_vllm._call(client, "http://vllm/v1/chat/completions", 72, True, {})
    assert [body["stream"] for body in sent] == [False, True]
    for body in sent:
        asked = {key: body.get(key) for key in bench_vllm.RL_ASKS}
        assert asked == (bench_vllm.RL_ASKS if rl else dict.fromkeys(bench_vllm.RL_ASKS))


def test_a_round_pairs_the_chat_call_chat_quads_times_and_each_stream_once() -> None:
    """``bench_vllm --chat-quads 3``: a round makes the chat call's groups in three quads, ABBA then BAAB
    then ABBA (the next round starts the other way), each stream's in one; the figures pair each quad on its
    own (three per round for the chat call, one for each stream and for the per-token figure)."""
    from bench._vllm_figures import Group, _paired_calls, _paired_tokens
    from bench.bench_vllm import Caller

    made: list[tuple[int, str, str, int]] = []
    cost = {"chat16": 2.0, "stream8": 3.0, "stream72": 10.0}

    class Recording(Caller):
        def group(self, mode: str, shape: str, round_: int, quad: int = 0) -> Group:
            made.append((round_, shape, mode, quad))
            cpu = cost[shape] * 8 * (1.25 if mode == "captured" else 1.0) * (1 + quad / 10)
            return Group("zero-code", 8, round_, mode, shape, 8, cpu, cpu, 0.0, 1.0, None, None, quad)

    caller = Recording(0, "http://unused", "zero-code", 8)
    try:
        groups = [*caller.round(0, ("captured", "passed", "passed", "captured"), 3)]
        groups += caller.round(1, ("captured", "passed", "passed", "captured"), 3)
    finally:
        caller.close()
    abba, baab = ["captured", "passed", "passed", "captured"], ["passed", "captured", "captured", "passed"]
    assert [mode for r, shape, mode, _ in made if (r, shape) == (0, "chat16")] == [*abba, *baab, *abba]
    assert [mode for r, shape, mode, _ in made if (r, shape) == (1, "chat16")] == [*baab, *abba, *baab]
    assert [mode for r, shape, mode, _ in made if (r, shape) == (1, "stream72")] == baab
    chat = _paired_calls(groups, 8, "chat16")  # each quad paired on its own
    assert len(chat) == 6 and all(c == pytest.approx(p * 1.25) for c, p in chat), chat
    assert len(_paired_calls(groups, 8, "stream72")) == 2
    assert len(_paired_tokens(groups, 8)) == 2
