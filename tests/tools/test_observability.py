"""Observability: /metrics scraped from a live server, the Grafana dashboard, the compose
monitoring profile, structured logs, the endpoints' access rules and the live dashboard in a
real headless Chromium."""

from __future__ import annotations

import base64
import colorsys
import contextlib
import json
import logging
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import RunningServer, start_server, wait_until
from prometheus_client.parser import text_string_to_metric_families
from tensord_server.observability import HttpEndpoints
from tensord_server.observability.logs import JsonFormatter

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def fetch(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def scrape(
    url: str, token: str | None = None
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    status, body = fetch(url, token)
    assert status == 200, body
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def exported_names(body: str) -> set[str]:
    """The series names a /metrics text makes queryable (a histogram's _bucket/_sum/_count)."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", body, re.M):
        if kind == "histogram":
            names.update(name + s for s in ("_bucket", "_sum", "_count"))
        else:  # a counter's TYPE line names it with its _total
            names.add(name)
    return names


@pytest.fixture
def observed() -> Iterator[tuple[RunningServer, HttpEndpoints]]:
    running = start_server(devices=("cpu=64MiB",))
    endpoints = HttpEndpoints(running.daemon, "127.0.0.1", 0).start()
    yield running, endpoints
    endpoints.close()
    running.stop()


def connect(address: str) -> Any:
    import tensord

    return tensord.connect(address, local=False)  # bytes over gRPC, not shared memory


def test_metrics_match_memory_stats_after_a_short_workload(
    observed: tuple[RunningServer, HttpEndpoints],
) -> None:
    from tensord.errors import OutOfMemoryError

    running, endpoints = observed
    client = connect(running.address)
    try:
        kept = [client.from_numpy(np.full((n, 1024), n, np.float32)) for n in (1, 300, 3000)]
        dropped = client.from_numpy(np.ones(5 * MiB // 4, np.float32))
        assert float(kept[1].numpy()[0, 0]) == 300.0
        del dropped
        client.flush()
        with pytest.raises(OutOfMemoryError):
            client.empty(100 * MiB // 4)
        stats = client.memory_stats()
        samples = scrape(f"http://127.0.0.1:{endpoints.port}/metrics")
        session_id = client.session_id
    finally:
        client.close()
    cpu = (("device", "cpu"),)
    for name, key in (
        ("tensord_pool_allocated_bytes", "allocated_bytes.all.current"),
        ("tensord_pool_reserved_bytes", "reserved_bytes.all.current"),
        ("tensord_pool_decommitted_bytes", "decommitted_bytes.all.current"),
        ("tensord_pool_decommits_total", "num_decommits"),
        ("tensord_pool_active_bytes", "active_bytes.all.current"),
        ("tensord_pool_inactive_split_bytes", "inactive_split_bytes.all.current"),
        ("tensord_pool_segments", "segment.all.current"),
        ("tensord_pool_largest_free_block_bytes", "largest_free_block_bytes.all"),
        ("tensord_pool_releasable_bytes", "releasable_bytes.all"),
        ("tensord_pool_external_fragmentation_ratio", "external_fragmentation.all"),
        ("tensord_pool_ooms_total", "num_ooms"),
        ("tensord_pool_alloc_retries_total", "num_alloc_retries"),
        ("tensord_pool_compactions_total", "num_compactions"),
        ("tensord_pool_compaction_moved_bytes_total", "compaction_moved_bytes"),
        ("tensord_exported_bytes", "exports.bytes.current"),
    ):
        assert samples[(name, cpu)] == pytest.approx(stats[key]), name
    assert stats["allocated_bytes.all.current"] > 0 and stats["num_ooms"] == 1
    tenant = (("device", "cpu"), ("tenant", ""))
    assert (
        samples[("tensord_tenant_allocated_bytes", tenant)]
        == stats["tenant.allocated_bytes.current"]
    )
    assert samples[("tensord_tenant_storages", tenant)] == stats["tenant.storages.live"] == 3
    assert samples[("tensord_tenant_sessions", (("tenant", ""),))] == 1
    assert samples[("tensord_tenant_handles", (("tenant", ""),))] == 3
    assert samples[("tensord_sessions", (("state", "live"),))] == stats["sessions.live"] == 1
    # the RPCs: counted by method and code, timed, and the bytes they carried
    uploaded = 4 * 1024 * (1 + 300 + 3000) + 5 * MiB
    assert samples[("tensord_uploaded_bytes_total", ())] == uploaded
    assert samples[("tensord_downloaded_bytes_total", ())] == 4 * 300 * 1024
    upload_ok = (("code", "OK"), ("method", "Upload"))
    assert samples[("tensord_rpc_requests_total", upload_ok)] == 4
    assert samples[("tensord_rpc_duration_seconds_count", upload_ok)] == 4
    oom = (("code", "RESOURCE_EXHAUSTED"), ("method", "Empty"))
    assert samples[("tensord_rpc_requests_total", oom)] == 1
    # bounded labels: never a session or handle id
    assert all(session_id not in value for _, labels in samples for _, value in labels)


def test_an_idle_cache_reads_idle_in_the_metrics(
    observed: tuple[RunningServer, HttpEndpoints],
) -> None:
    # every tensor freed, its segments still cached: the scrape said fragmentation 0.524
    running, endpoints = observed
    client = connect(running.address)
    try:
        held = [client.from_numpy(np.ones(n, np.float32)) for n in (1000, 2 * MiB, 5 * MiB)]
        del held
        client.flush()
        assert wait_until(lambda: client.memory_allocated() == 0)
    finally:
        client.close()
    samples = scrape(f"http://127.0.0.1:{endpoints.port}/metrics")
    cpu = (("device", "cpu"),)
    assert samples[("tensord_pool_allocated_bytes", cpu)] == 0
    assert samples[("tensord_pool_segments", cpu)] == 3  # cached, not given back
    reserved = samples[("tensord_pool_reserved_bytes", cpu)]
    assert samples[("tensord_pool_releasable_bytes", cpu)] == reserved > 0
    assert samples[("tensord_pool_external_fragmentation_ratio", cpu)] == 0.0


def test_sessions_closed_and_lost_are_counted(
    observed: tuple[RunningServer, HttpEndpoints],
) -> None:
    running, endpoints = observed
    url = f"http://127.0.0.1:{endpoints.port}/metrics"
    connect(running.address).close()
    samples = scrape(url)
    assert samples[("tensord_sessions_ended_total", (("reason", "closed"),))] == 1
    assert samples[("tensord_sessions", (("state", "live"),))] == 0


def test_call_channel_calls_are_counted_as_any_call(
    observed: tuple[RunningServer, HttpEndpoints],
) -> None:
    """Calls on a session's call channel pass no gRPC interceptor: they are observed as gRPC
    calls are (by method and code), and counted apart too, so an operator sees both."""
    import tensord

    running, endpoints = observed
    url = f"http://127.0.0.1:{endpoints.port}/metrics"
    with tensord.connect(running.address, pipelining=False) as client:  # same host
        x = client.zeros(4)
        before = scrape(url)
        views = (("code", "OK"), ("method", "View"))
        for _ in range(3):
            x.view(2, 2)
        with pytest.raises(tensord.errors.NotFoundError):
            client.get("no-such-name")
        samples = scrape(url)
        assert client._conn.call_channel.calls >= 4
        key = ("tensord_rpc_requests_total", views)
        assert samples[key] - before.get(key, 0) == 3
        # a same-host get is one GetNameExport
        missing = (
            "tensord_rpc_requests_total",
            (("code", "NOT_FOUND"), ("method", "GetNameExport")),
        )
        assert samples[missing] - before.get(missing, 0) == 1
        calls = samples[("tensord_channel_calls_total", ())]
        assert calls - before.get(("tensord_channel_calls_total", ()), 0) >= 4
        assert samples[("tensord_call_channels", ())] == 1


def test_every_grafana_query_names_a_metric_the_server_exports(
    observed: tuple[RunningServer, HttpEndpoints],
) -> None:
    _, endpoints = observed
    status, body = fetch(f"http://127.0.0.1:{endpoints.port}/metrics")
    assert status == 200
    exported = exported_names(body.decode())
    dashboard = json.loads(
        (REPO / "deploy" / "grafana" / "dashboards" / "tensord.json").read_text()
    )
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"]]
    assert len(queries) > 10
    for query in queries:
        named = set(re.findall(r"\btensord_[a-z_]+\b", query))
        assert named, f"a query names no tensord metric: {query}"
        assert named <= exported, f"{query}: {named - exported} not exported"
    every_panel_has_a_datasource = all(
        t["datasource"]["uid"] == "prometheus" for p in dashboard["panels"] for t in p["targets"]
    )
    assert every_panel_has_a_datasource


def test_compose_monitoring_profile_follows_the_spec_and_provisions_the_dashboard() -> None:
    yaml = pytest.importorskip("yaml")
    jsonschema = pytest.importorskip("jsonschema")
    from test_loadtest import interpolate

    config = yaml.safe_load(interpolate((REPO / "docker-compose.yml").read_text()))
    schema = json.loads((REPO / "tests" / "compose-spec.json").read_text())
    jsonschema.Draft201909Validator(schema).validate(config)
    services = config["services"]
    assert services["prometheus"]["profiles"] == ["monitoring"]
    assert services["grafana"]["profiles"] == ["monitoring"]
    assert "profiles" not in services["server"]  # the server runs in every profile
    assert "--metrics-address=0.0.0.0:9464" in services["server"]["command"]
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["server:9464"]
    # every mounted path exists in the repository
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            source = volume.split(":", 1)[0]
            assert (REPO / source).exists(), volume
    datasource = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert datasource["datasources"][0]["uid"] == "prometheus"


def test_json_log_lines_carry_the_structured_fields() -> None:
    record = logging.LogRecord("tensord.events", logging.INFO, __file__, 1, "oom: %s", ("x",), None)
    record.fields = {"event": "oom", "method": "Empty", "tenant": "alice"}
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "oom: x" and entry["level"] == "info"
    assert entry["event"] == "oom" and entry["method"] == "Empty" and entry["tenant"] == "alice"


def read_lines_until(stream: Any, prefix: str, into: list[str], timeout: float = 30) -> str:
    """Read a subprocess's lines (bounded in time) until one starts with ``prefix``."""
    found: list[str] = []

    def reader() -> None:
        for line in stream:
            into.append(line)
            if line.startswith(prefix):
                found.append(line)
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(timeout)
    assert found, into
    return found[0]


@pytest.mark.slow
def test_serve_with_auth_shows_metrics_to_operators_only_and_logs_json(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("op-token ops\nalice-token alice\n")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensord_server",
            "serve",
            "--address=127.0.0.1:0",
            "--device=cpu=64MiB",
            f"--auth-tokens={tokens}",
            "--operator-tenant=ops",
            "--metrics-address=127.0.0.1:0",
            "--log-format=json",
            "--log-level=debug",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out: list[str] = []
        address = read_lines_until(process.stdout, "tensord listening on ", out).split()[-1]
        url = read_lines_until(process.stdout, "tensord http on ", out).split()[-1]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        assert fetch(url)[0] == 401
        assert fetch(url, "alice-token")[0] == 401  # a tenant sees no other tenant's figures
        import tensord

        client = tensord.connect(address, token="alice-token", local=False)
        client.from_numpy(np.ones(1000, np.float32))
        samples = scrape(url, "op-token")
        client.close()
        cpu_alice = (("device", "cpu"), ("tenant", "alice"))
        assert samples[("tensord_tenant_allocated_bytes", cpu_alice)] == 4096
        assert samples[("tensord_tenant_sessions", (("tenant", "ops"),))] == 0
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    entries = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    events = {e.get("event") for e in entries}
    assert {"session_opened", "session_closed"} <= events, err
    access = [e for e in entries if e["logger"] == "tensord.access"]
    assert any(e["method"] == "Upload" and e["tenant"] == "alice" for e in access), err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--metrics-address=9999", "--auth-tokens=TOKENS"], "--operator-tenant"),
        (["--dashboard-address=0.0.0.0:9999"], "refusing to serve metrics or the dashboard"),
        (["--operator-tenant=ops"], "--operator-tenant needs --auth-tokens"),
    ],
)
def test_serve_refuses_endpoints_that_would_expose_figures(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    from conftest import run_serve

    tokens = tmp_path / "tokens"
    tokens.write_text("op-token ops\n")
    args = [f.replace("TOKENS", str(tokens)) for f in flags]
    result = run_serve("--address=127.0.0.1:0", "--device=cpu=8MiB", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


# -- the dashboard in a real browser ------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no chromium/chromedriver installed (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000"):
        options.add_argument(argument)
    options.add_argument("--disable-dev-shm-usage")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def query_all(driver: Any, selector: str, attribute: str) -> list[str]:
    """An attribute of every element matching ``selector``, read in one script (the page
    redraws every second: elements found one call earlier may be gone)."""
    return list(
        driver.execute_script(
            "return [...document.querySelectorAll(arguments[0])]"
            ".map(e => e.getAttribute(arguments[1]))",
            selector,
            attribute,
        )
    )


def shown_segments(driver: Any) -> set[int]:
    return {int(a) for a in query_all(driver, ".segment", "data-address")}


def computed_colours(driver: Any, selector: str, prop: str) -> list[str]:
    """A computed style property of every element matching ``selector``, in one script."""
    return list(
        driver.execute_script(
            "return [...document.querySelectorAll(arguments[0])]"
            ".map(e => getComputedStyle(e)[arguments[1]])",
            selector,
            prop,
        )
    )


def hue(css_colour: str) -> float:
    """The hue in degrees of a computed ``rgb(r, g, b)``."""
    r, g, b = (int(v) / 255 for v in re.findall(r"\d+", css_colour)[:3])
    return colorsys.rgb_to_hls(r, g, b)[0] * 360


def hue_gap(a: float, b: float) -> float:
    return min(abs(a - b), 360 - abs(a - b))


def assert_tenant_colours_are_not_the_legends(driver: Any) -> None:
    """A tenant's blocks in the legend's red read as fragmentation (in its blue or green, as
    the allocated or reserved line)."""
    legend = {
        name: hue(computed_colours(driver, f".swatch.{name}", "backgroundColor")[0])
        for name in ("fragmentation", "allocated", "reserved")
    }
    tenants = computed_colours(driver, '.block[data-state="active_allocated"]', "backgroundColor")
    assert tenants
    for colour in tenants:
        assert hue_gap(hue(colour), legend["fragmentation"]) >= 40, (colour, legend)
        assert hue_gap(hue(colour), legend["allocated"]) >= 20, (colour, legend)
        assert hue_gap(hue(colour), legend["reserved"]) >= 20, (colour, legend)


def chart_texts(driver: Any, chart: str, axis: str) -> list[str]:
    return list(
        driver.execute_script(
            "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent)",
            f'.chart[data-chart="{chart}"] .{axis} text',
        )
    )


def save_screenshot(driver: Any, name: str) -> None:
    """With TENSORD_DASHBOARD_SCREENSHOTS=DIR, the page as the test leaves it, in DIR/name
    (docs/dashboard.png and docs/images/dashboard-idle.png are made so)."""
    folder = os.environ.get("TENSORD_DASHBOARD_SCREENSHOTS")
    if folder:
        time.sleep(6)  # a few more samples in the charts
        size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = driver.execute_cdp_cmd(  # the whole page, not only the window's part
            "Page.captureScreenshot", {"captureBeyondViewport": True, "clip": clip}
        )
        (Path(folder) / name).write_bytes(base64.b64decode(shot["data"]))


@pytest.mark.slow
def test_dashboard_in_a_browser_shows_segments_and_updates(browser: Any, tmp_path: Path) -> None:
    running = start_server(
        devices=("cpu=256MiB",),
        auth_tokens={"op-token": "ops", "a-token": "alice", "b-token": "bob"},
    )
    endpoints = HttpEndpoints(running.daemon, "127.0.0.1", 0, operator_tenants=["ops"]).start()
    import tensord

    client = tensord.connect(running.address, token="a-token")
    other = tensord.connect(running.address, token="b-token")
    try:
        held = [client.from_numpy(np.ones(n, np.float32)) for n in (1000, 300_000, 3 * MiB)]
        theirs = [other.from_numpy(np.ones(n, np.float32)) for n in (500_000, 1_000_000)]
        pool = running.daemon.devices.get("cpu").pool
        segments = {s["address"] for s in pool.memory_snapshot()["segments"]}
        base = f"http://127.0.0.1:{endpoints.port}/"
        browser.get(base)
        # no token yet: the page asks for one
        assert wait_until(
            lambda: browser.execute_script("return !document.getElementById('login').hidden"), 10
        )
        before = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert before and all("/api/state" in m and "401" in m for m in before), before
        browser.get(base + "#token=op-token")
        browser.refresh()
        assert wait_until(lambda: shown_segments(browser) == segments, 15), (
            shown_segments(browser),
            segments,
        )
        assert "token" not in browser.current_url  # the fragment is dropped once read
        assert len(query_all(browser, '.block[data-tenant="alice"]', "data-state")) == len(held)
        assert len(query_all(browser, '.block[data-tenant="bob"]', "data-state")) == len(theirs)
        assert_tenant_colours_are_not_the_legends(browser)
        held.append(client.from_numpy(np.ones(8 * MiB, np.float32)))  # a new 32 MiB segment
        del theirs[0]  # a hole in bob's segment
        other.flush()
        grown = {s["address"] for s in pool.memory_snapshot()["segments"]}
        assert len(grown) == len(segments) + 1
        assert wait_until(lambda: shown_segments(browser) == grown, 15)
        assert wait_until(lambda: len(query_all(browser, ".chart polyline", "class")) == 3, 15)
        # bytes and the ratio on charts of their own, each with its axis, over a time axis
        assert query_all(browser, '.chart[data-chart="memory"] polyline', "class") == [
            "reserved",
            "allocated",
        ]
        assert query_all(browser, '.chart[data-chart="fragmentation"] polyline', "class") == [
            "fragmentation"
        ]
        memory_ticks = chart_texts(browser, "memory", "y-axis")
        assert memory_ticks[0] == "0 MiB" and all(t.endswith(" MiB") for t in memory_ticks)
        assert chart_texts(browser, "fragmentation", "y-axis") == ["0", "0.25", "0.5", "0.75", "1"]
        assert wait_until(lambda: len(chart_texts(browser, "memory", "time-axis")) >= 2, 15)
        for chart in ("memory", "fragmentation"):
            times = chart_texts(browser, chart, "time-axis")
            assert times and all(re.fullmatch(r"\d\d:\d\d:\d\d", t) for t in times), times
        state = query_all(browser, ".pool-state", "data-state")
        assert state == ["busy"]
        # with the token, no console error at all
        assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
        save_screenshot(browser, "dashboard.png")
    finally:
        client.close()
        other.close()
        endpoints.close()
        running.stop()


@pytest.mark.slow
def test_dashboard_shows_an_idle_cache_as_idle(browser: Any) -> None:
    # every tensor freed, 3 segments cached: the page said "fragmentation 0.524" beside
    # segments labelled "0 B", and the no-auth tenant's blocks were the fragmentation red
    running = start_server(devices=("cpu=256MiB",))
    endpoints = HttpEndpoints(running.daemon, "127.0.0.1", 0).start()
    client = connect(running.address)
    try:
        held = [client.from_numpy(np.ones(n, np.float32)) for n in (1000, 2 * MiB, 5 * MiB)]
        browser.get(f"http://127.0.0.1:{endpoints.port}/")
        assert wait_until(lambda: len(query_all(browser, ".block.allocated", "class")) == 3, 15)
        assert_tenant_colours_are_not_the_legends(browser)  # the tenant "" of a no-auth server
        del held
        client.flush()
        assert wait_until(lambda: query_all(browser, ".pool-state", "data-state") == ["idle"], 15)

        def figure(name: str) -> str:
            return str(
                browser.execute_script(
                    "return document.querySelector(`[data-figure='${arguments[0]}']`).textContent",
                    name,
                )
            )

        assert figure("allocated") == "0 B" and figure("segments") == "3"
        assert figure("fragmentation") == "0.000"
        assert figure("releasable") == figure("reserved") == "42.0 MiB"
        words = browser.find_element("css selector", ".pool-state").text
        assert "nothing allocated" in words and "3 cached segments, all free" in words, words
        definition = browser.find_element("css selector", ".definition").text
        assert "largest free block" in definition and "idle cache reads 0" in definition
        labels = [
            str(t)
            for t in browser.execute_script(
                "return [...document.querySelectorAll('.segment .label')].map(e => e.textContent)"
            )
        ]
        assert len(labels) == 3 and all(label.endswith(": free") for label in labels), labels
        assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
        save_screenshot(browser, "dashboard-idle.png")
    finally:
        client.close()
        endpoints.close()
        running.stop()


def test_refusals_of_the_gate_are_counted() -> None:
    """The metrics interceptor sits outside the admission gate: a health Watch the gate
    refuses (a wrong token) is still counted, by its method and code."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    running = start_server(devices=("cpu=8MiB",), auth_tokens={"op-token": "ops"})
    endpoints = HttpEndpoints(running.daemon, "127.0.0.1", 0, operator_tenants=["ops"]).start()
    try:
        with grpc.insecure_channel(running.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                watch = stub.Watch(
                    health_pb2.HealthCheckRequest(),
                    metadata=[("authorization", "Bearer wrong-token")],
                    timeout=10,
                )
                next(watch)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        samples = scrape(f"http://127.0.0.1:{endpoints.port}/metrics", "op-token")
    finally:
        endpoints.close()
        running.stop()
    counted = (("code", "UNAUTHENTICATED"), ("method", "Watch"))
    assert samples[("tensord_rpc_requests_total", counted)] == 1


@pytest.mark.slow
def test_an_idle_http_connection_is_closed(
    observed: tuple[RunningServer, HttpEndpoints], monkeypatch: pytest.MonkeyPatch
) -> None:
    # found by an attacker's read: each idle connection held a thread for ever (slowloris)
    from tensord_server.observability import dashboard

    monkeypatch.setattr(dashboard, "REQUEST_DEADLINE_S", 0.5)
    _, endpoints = observed
    with socket.create_connection(("127.0.0.1", endpoints.port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n")  # a request line, then nothing
        assert sock.recv(1024) == b""  # the server closed it (before: recv timed out)


def connect_from(source: str, port: int) -> socket.socket:
    """A connection to the endpoints from ``source``: every 127.x.y.z address is loopback on
    Linux, so each stands for a peer of its own."""
    sock = socket.socket()
    sock.settimeout(5)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def closed_unanswered(sock: socket.socket) -> bool:
    """Whether the server closes ``sock`` without answering (waiting at most its timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def closed_yet(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` by now, without waiting; it must not answer."""
    # poll, not select: a long test run holds descriptors past select()'s 1,024
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):
        return False
    try:
        got = sock.recv(1)
    except ConnectionResetError:
        return True
    assert got == b"", f"answered a request that never ended: {got!r}"
    return True


def connection_threads(port: int) -> int:
    return sum(t.name == f"tensord-http-connection:{port}" for t in threading.enumerate())


@pytest.mark.slow
def test_a_trickled_request_is_closed_at_its_deadline_while_a_scrape_is_answered(
    observed: tuple[RunningServer, HttpEndpoints], monkeypatch: pytest.MonkeyPatch
) -> None:
    # each recv had its own timeout: a header byte every few seconds held a thread for ever
    from tensord_server.observability import dashboard

    monkeypatch.setattr(dashboard, "REQUEST_DEADLINE_S", 1.0)
    monkeypatch.setattr(dashboard, "MAX_CONNECTIONS_PER_PEER", 8)
    _, endpoints = observed
    tricklers = [connect_from("127.0.0.2", endpoints.port) for _ in range(8)]
    try:
        for sock in tricklers:
            sock.sendall(b"GET /metrics HTTP/1.0\r\nX-Slow: ")
        # their address holds all its share; another's scrape is answered meanwhile
        status, body = fetch(f"http://127.0.0.1:{endpoints.port}/metrics")
        assert status == 200 and b"tensord_pool_allocated_bytes" in body
        still_open = list(tricklers)
        for _ in range(100):  # a byte each every 0.1 s, for at most 10 deadlines
            time.sleep(0.1)
            for sock in still_open:
                with contextlib.suppress(OSError):
                    sock.send(b"x")
            still_open = [sock for sock in still_open if not closed_yet(sock)]
            if not still_open:
                break
        assert not still_open, f"{len(still_open)} trickled requests were kept past 10 s"
    finally:
        for sock in tricklers:
            sock.close()


def test_connections_beyond_the_caps_are_closed_at_once_holding_no_thread(
    observed: tuple[RunningServer, HttpEndpoints], monkeypatch: pytest.MonkeyPatch
) -> None:
    # every connection got a thread: callers holding connections open took any number
    from tensord_server.observability import dashboard

    monkeypatch.setattr(dashboard, "MAX_CONNECTIONS", 3)
    monkeypatch.setattr(dashboard, "MAX_CONNECTIONS_PER_PEER", 2)
    _, endpoints = observed
    port = endpoints.port
    url = f"http://127.0.0.1:{port}/metrics"
    held: list[socket.socket] = []
    try:
        # silent connections, each holding a thread (the accept loop takes them in order)
        held += [connect_from("127.0.0.2", port) for _ in range(2)]
        with connect_from("127.0.0.2", port) as third:
            assert closed_unanswered(third)  # beyond its address's share
        held.append(connect_from("127.0.0.3", port))  # another address still gets one
        with connect_from("127.0.0.4", port) as fourth:
            assert closed_unanswered(fourth)  # beyond the total
        with pytest.raises(OSError):
            fetch(url)
        assert wait_until(lambda: connection_threads(port) == 3)
        assert not any(closed_yet(sock) for sock in held)
        assert connection_threads(port) == 3  # the refused ones took none
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: connection_threads(port) == 0)
    assert fetch(url)[0] == 200


def test_a_request_longer_than_its_bound_is_closed_unanswered(
    observed: tuple[RunningServer, HttpEndpoints], monkeypatch: pytest.MonkeyPatch
) -> None:
    # http.server alone reads 100 header lines of 64 KiB each: 6.4 MiB a connection
    from tensord_server.observability import dashboard

    monkeypatch.setattr(dashboard, "MAX_REQUEST_BYTES", 4096)
    _, endpoints = observed
    request = b"GET /metrics HTTP/1.0\r\nX-Pad: %s\r\n\r\n"
    with connect_from("127.0.0.1", endpoints.port) as sock:
        sock.sendall(request % (b"a" * 3000))
        assert sock.makefile("rb").readline() == b"HTTP/1.0 200 OK\r\n"
    with connect_from("127.0.0.1", endpoints.port) as sock:
        sock.sendall(request % (b"a" * 5000))
        assert closed_unanswered(sock)


@pytest.mark.slow
def test_an_answer_read_slowly_is_cut_at_its_deadline(
    observed: tuple[RunningServer, HttpEndpoints], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a deadline per send would let a reader that keeps taking a little hold the thread for
    # as long as the answer is long
    from tensord_server.observability import dashboard

    answer = b"x" * (16 * MiB)  # far more than the kernel buffers below hold (4.5 MiB at most)
    monkeypatch.setattr(dashboard, "ANSWER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(dashboard, "static_file", lambda name: answer)
    _, endpoints = observed
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
    sock.settimeout(5)
    received = 0
    with sock:
        sock.connect(("127.0.0.1", endpoints.port))
        sock.sendall(b"GET /static/dashboard.js HTTP/1.0\r\n\r\n")
        for _ in range(1000):  # 64 KiB every 10 ms at most: the whole answer in 2.5 s or more
            piece = sock.recv(64 * 1024)
            if not piece:
                break
            received += len(piece)
            time.sleep(0.01)
    assert 0 < received < len(answer)
