"""Bad input from the command line or the network is one clear line, never a traceback or a
volunteer retrying for ever (issue 15, item 8): malformed URLs, URLs where another web
server answers, TLS on the wrong side, a project path through a file."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator

import click
import msgpack
import pytest

from kernels import frames
from tests.procs import poll, start_volunteer, stop, tilehive, volunteer_status

USAGE = "give http://HOST:PORT or https://HOST:PORT (e.g. http://127.0.0.1:8470)"
NOT_TILEHIVE = "is not a tilehive coordinator"


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The refusal: exit 1, nothing on stdout, one line on stderr, no traceback."""
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    return lines[0]


def said_once(result: subprocess.CompletedProcess) -> str:
    """A volunteer that gave up: exit 1, its reason once as an `Error:` line (the log lines
    of its start around it), no traceback."""
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


class Page(http.server.BaseHTTPRequestHandler):
    """Another web server: `body` with `status` and `content_type` to every request."""

    status = 200
    content_type = "text/html"
    body = b"<!DOCTYPE html><html><body><h1>It works!</h1></body></html>"

    def do_GET(self) -> None:
        self.answer()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.answer()

    def answer(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args) -> None:
        pass


def serve(handler: type, context: ssl.SSLContext | None = None) -> Iterator[str]:
    """An http.server on a loopback port in a thread; yields its http:// URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def page(status: int, content_type: str = "text/html", body: bytes | None = None) -> type:
    fields = {"status": status, "content_type": content_type}
    return type("Answer", (Page,), fields if body is None else {**fields, "body": body})


@pytest.fixture
def html() -> Iterator[str]:
    yield from serve(page(200))


@pytest.fixture
def html_404() -> Iterator[str]:
    yield from serve(page(404))


@pytest.fixture
def html_501() -> Iterator[str]:
    """A server that implements no POST (`python3 -m http.server` answers so)."""
    yield from serve(page(501))


@pytest.fixture
def html_large() -> Iterator[str]:
    """A page of more than a megabyte: the volunteer reads it into one buffer, in pieces."""
    yield from serve(page(200, body=Page.body + b" " * (2 << 20)))


@pytest.fixture
def tls(tmp_path) -> Iterator[str]:
    """A web server speaking TLS (a self-signed certificate made with openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    yield from serve(page(200), context)


BAD_URLS = [
    ("http://", "names no host"),
    ("http://127.0.0.1:99999", "Port out of range"),
    ("http://127.0.0.1:0", "has port 0"),
    ("ftp://x", "not an http:// or https:// URL"),
    ("localhost:8470", "not an http:// or https:// URL"),
    # urlsplit drops a newline before it parses: the URL checked was not the one used.
    ("http://127.0.0.1:8470/\nExecStartPre=/bin/true", "a space, a backslash or a control"),
    ("http://127.0.0.1:8470/\\", "a space, a backslash or a control"),
    # read as a host name "u:p@127.0.0.1" before: "Name or service not known"
    ("http://u:p@127.0.0.1:8470", "holds a user name or password"),
    ("http://127.0.0.1:8470/?project=x", "has a query or a fragment"),
]


def test_the_apis_own_path_is_refused_with_the_base_url_to_give():
    """`status http://H:P/v1/status` said the coordinator was no tilehive coordinator."""
    for command in (["status"], ["volunteer", "start"]):
        line = one_line_error(tilehive(*command, "http://127.0.0.1:8470/v1/status"))
        assert (
            "is a path of the coordinator's API: give its base URL, http://127.0.0.1:8470" in line
        )


# ---- URLs that are not URLs of a coordinator -----------------------------------------------


@pytest.mark.parametrize(("url", "reason"), BAD_URLS)
def test_a_volunteer_refuses_a_malformed_url_before_anything(tmp_path, url, reason):
    state = tmp_path / "vol"
    line = one_line_error(tilehive("volunteer", "start", url, "--state-dir", str(state)))
    assert reason in line and USAGE in line and repr(url) in line
    assert not state.exists()


@pytest.mark.parametrize(
    "command",
    [
        ("init", ""),
        ("init", "{tmp}/p", "--corpus", ""),
        ("volunteer", "start", "http://127.0.0.1:9", "--state-dir", ""),
        ("status", ""),
        ("logs", "tasks", " "),
    ],
)
def test_an_empty_path_is_refused_not_taken_for_the_working_directory(tmp_path, command):
    said = tilehive(*(part.format(tmp=tmp_path) for part in command), cwd=tmp_path)
    assert said.returncode == 2 and "an empty" in said.stderr, said.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written where the command ran


def test_a_since_that_does_not_parse_says_so_once():
    from coordinator.cli.main import _since

    with pytest.raises(click.BadParameter) as refused:
        _since("10x")
    said = refused.value.format_message()
    assert said.count("--since") == 1 and "'10x': use a duration like 90s" in said, said


@pytest.mark.parametrize("command", [("logs", "validation"), ("logs", "tasks"), ("train",)])
def test_a_url_where_a_folder_belongs_is_refused_as_a_url(tmp_path, command):
    """`logs https://host:8470` named `https:/host:8470`, a folder nobody meant."""
    said = tilehive(*command, "https://example.org:8470", cwd=tmp_path)
    assert said.returncode == 2 and "https://example.org:8470 is a URL" in said.stderr, said
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "command",
    [
        # NaN seconds of backoff retried about 4,000 times a second; a NaN stop timeout
        # killed the volunteer at once; a NaN temperature was a traceback.
        ("volunteer", "start", "http://127.0.0.1:9", "--max-backoff", "nan"),
        ("volunteer", "stop", "--timeout", "nan", "--state-dir", "{tmp}/v"),
        ("volunteer", "stop", "--timeout", "inf", "--state-dir", "{tmp}/v"),
        ("sample", "{tmp}/p", "--temperature", "nan"),
        ("emulate", "http://127.0.0.1:9", "--duration", "inf"),
    ],
)
def test_a_number_that_is_not_finite_is_refused(tmp_path, command):
    said = tilehive(*(part.format(tmp=tmp_path) for part in command), cwd=tmp_path)
    assert said.returncode == 2 and "is not a finite number" in said.stderr, said.stderr
    assert "Traceback" not in said.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("daemon", [(), ("--daemon",)], ids=["foreground", "daemon"])
def test_more_threads_than_memory_for_them_names_the_threads(tmp_path, daemon):
    command = ("volunteer", "start", "http://127.0.0.1:9", "--threads", "4096", *daemon)
    said = said_once(tilehive(*command, "--state-dir", str(tmp_path / "v")))
    assert "--max-memory 200 MB is too small" in said and "for each of its 4096 threads" in said
    assert said.endswith("or fewer --threads")


def test_a_volunteer_refuses_a_state_directory_that_takes_no_files(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for daemon in ((), ("--daemon",)):
        command = ("volunteer", "start", "http://127.0.0.1:9", "--state-dir")
        line = one_line_error(tilehive(*command, str(blocker / "vol"), *daemon))
        assert f"cannot use the state directory {blocker / 'vol'}: Not a directory" in line


@pytest.mark.parametrize("name", ["x" * 65, "two\nlines", ""])
def test_a_volunteer_refuses_a_name_no_coordinator_takes_before_anything(tmp_path, name):
    state = tmp_path / "vol"
    command = ("volunteer", "start", "http://127.0.0.1:9", "--name", name, "--state-dir")
    line = one_line_error(tilehive(*command, str(state)))
    assert "a name is 1 to 64 printable characters" in line and repr(name) in line
    assert not state.exists()


def test_a_volunteer_refuses_a_name_of_digits_that_would_read_as_another_hosts_id(tmp_path):
    state = tmp_path / "vol"
    command = ("volunteer", "start", "http://127.0.0.1:9", "--name", "1", "--state-dir")
    line = one_line_error(tilehive(*command, str(state)))
    assert "--name '1': a name must not be digits alone" in line
    assert not state.exists()


@pytest.mark.parametrize(("url", "reason"), [u for u in BAD_URLS if "://" in u[0]])
def test_status_and_admin_refuse_a_malformed_url(url, reason):
    for command in (["status", url], ["admin", "pause", url, "--token", "x"]):
        line = one_line_error(tilehive(*command))
        assert reason in line and USAGE in line


# ---- something else answers ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("server", "status"),
    [("html", 200), ("html_404", 404), ("html_501", 501), ("html_large", 200)],
)
def test_a_volunteer_stops_at_another_web_server(tmp_path, request, server, status):
    url = request.getfixturevalue(server)
    result = tilehive("volunteer", "start", url, "--state-dir", str(tmp_path / "vol"))
    line = said_once(result)
    assert line == (
        f"Error: {url} {NOT_TILEHIVE}: POST /v1/hosts answered {status} text/html "
        "('<!DOCTYPE html><html><body><h1>It works!'...)"
    )
    assert volunteer_status(tmp_path / "vol")["note"] == line.removeprefix("Error: ")


def test_a_volunteer_stops_at_tls_spoken_to_a_plain_port_and_plain_http_to_tls(tmp_path, html, tls):
    https = html.replace("http://", "https://")
    line = said_once(tilehive("volunteer", "start", https, "--state-dir", str(tmp_path / "a")))
    assert line == f"Error: {https} does not speak TLS (the handshake failed): " + (
        "is it http:// rather than https://?"
    )
    line = said_once(tilehive("volunteer", "start", tls, "--state-dir", str(tmp_path / "b")))
    assert line == f"Error: {tls} speaks TLS: use https:// rather than http://"
    secure = tls.replace("http://", "https://")
    line = said_once(tilehive("volunteer", "start", secure, "--state-dir", str(tmp_path / "c")))
    assert line.startswith(f"Error: {secure}: the TLS certificate is not trusted (")


def test_a_daemon_at_another_web_server_ends_and_says_why(tmp_path, html):
    state = tmp_path / "vol"
    started = tilehive("volunteer", "start", html, "--daemon", "--state-dir", str(state))
    assert started.returncode == 0, started.stderr
    poll(
        lambda: tilehive("volunteer", "status", "--state-dir", str(state)).returncode == 3,
        what="the daemon's end",
    )
    assert NOT_TILEHIVE in volunteer_status(state)["note"]
    log = (state / "volunteer.log").read_text()
    assert log.count(NOT_TILEHIVE) == 1 and "Traceback" not in log
    # Why before what (the log said it stopped, then why).
    assert log.index(NOT_TILEHIVE) < log.index("volunteer stopped after"), log


def test_a_coordinator_out_of_reach_is_said_with_its_address_and_the_reason(tmp_path, reaper):
    """Retried, as a coordinator not up yet is; the note says where and why, not only the
    exception's class (a typo in the address looked like any other failure)."""
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]  # closed below: nothing listens there
    volunteer = reaper(start_volunteer(f"http://127.0.0.1:{port}", tmp_path / "vol"))
    try:
        poll(
            lambda: (
                f"127.0.0.1:{port}: Connection refused"
                in volunteer_status(tmp_path / "vol").get("note", "")
            ),
            what="the note to name the address and the refusal",
        )
        assert volunteer.poll() is None  # retried, not given up
    finally:
        assert stop(volunteer) == 0
    assert f"127.0.0.1:{port}: Connection refused" in (tmp_path / "vol" / "out").read_text()


def test_an_address_that_takes_connections_and_says_nothing_is_said_in_seconds(tmp_path, reaper):
    """A port that accepts and never answers was two minutes of silence: the volunteer's
    note said only that it was starting, and `emulate` ended with an empty reason."""
    listener = socket.create_server(("127.0.0.1", 0))  # the backlog takes the connections
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        volunteer = reaper(start_volunteer(url, tmp_path / "vol"))
        try:
            poll(
                lambda: "no answer in 15s" in volunteer_status(tmp_path / "vol").get("note", ""),
                timeout=45,
                what="the note to say that nothing answers",
            )
            assert volunteer.poll() is None  # retried, as a coordinator not up yet is
        finally:
            assert stop(volunteer) == 0
        said = one_line_error(tilehive("emulate", url, "--hosts", "1", "--duration", "1"))
        assert said == f"Error: cannot reach a coordinator at {url}: no answer in 15s"
    finally:
        listener.close()


def test_a_server_that_drops_connections_is_retried_not_abandoned(tmp_path, reaper):
    """Resets are what a coordinator that is restarting does: back off, do not give up."""
    listener = socket.create_server(("127.0.0.1", 0))
    closing = threading.Event()

    def drop() -> None:
        while not closing.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            connection.close()  # a reset, with nothing said

    thread = threading.Thread(target=drop, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    volunteer = reaper(start_volunteer(url, tmp_path / "vol"))
    try:
        poll(
            lambda: (
                volunteer_status(tmp_path / "vol").get("state") == "offline"
                and volunteer_status(tmp_path / "vol").get("errors", 0) >= 3
            ),
            what="three failed attempts",
        )
        assert volunteer.poll() is None
    finally:
        assert stop(volunteer) == 0
        closing.set()
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone would not)
        listener.close()
        thread.join()
    assert NOT_TILEHIVE not in (tmp_path / "vol" / "out").read_text()


@pytest.fixture
def mangled_frames() -> Iterator[str]:
    """Answers in tilehive's framed content type whose document overruns the body."""
    yield from serve(page(200, frames.CONTENT_TYPE, b"THF1\xff\x00\x00\x00" + b"x" * 10))


def test_a_malformed_framed_answer_is_retried_as_a_broken_reply(tmp_path, reaper, mangled_frames):
    """A reply that broke off or was mangled on the way: retried after a backoff and named
    so, not taken for another web server nor for a coordinator that cannot be reached."""
    volunteer = reaper(start_volunteer(mangled_frames, tmp_path / "vol"))
    try:
        poll(
            lambda: volunteer_status(tmp_path / "vol").get("errors", 0) >= 2,
            what="two failed attempts",
        )
        status = volunteer_status(tmp_path / "vol")
        assert status["state"] == "offline" and volunteer.poll() is None
        assert status["note"].startswith("a reply from the coordinator broke off")
    finally:
        assert stop(volunteer) == 0
    out = (tmp_path / "vol" / "out").read_text()
    assert NOT_TILEHIVE not in out and "Traceback" not in out


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (page(200), "200 text/html ('<!DOCTYPE html>"),
        (page(404), "404 text/html ('<!DOCTYPE html>"),
        (page(200, "application/json", b'{"hello": "world"}'), "200 application/json ("),
        (page(200, "text/plain", b"not json"), "200 text/plain ('not json')"),
        # JSON with a field of a status, in another shape: not printed as one
        (page(200, "application/json", b'{"workunits": 5}'), "200 application/json ("),
    ],
)
def test_status_and_admin_name_another_web_server(answer, said):
    for url in serve(answer):
        line = one_line_error(tilehive("status", url))
        assert line.startswith(f"Error: {url} {NOT_TILEHIVE}: GET /v1/status answered {said}")
        line = one_line_error(tilehive("emulate", url, "--hosts", "1", "--duration", "1"))
        assert line.startswith(f"Error: {url} {NOT_TILEHIVE}: GET /v1/status answered {said}")
        line = one_line_error(tilehive("admin", "pause", url, "--token", "x"))
        assert line.startswith(f"Error: {url} {NOT_TILEHIVE}: POST /v1/admin/pause answered")


def test_status_and_admin_print_what_a_server_says_escaped_on_one_line():
    """Words from the network reach the operator's terminal escaped: a newline or a Unicode
    line separator in them could otherwise print a line the coordinator never wrote."""
    forged = "all is well\nwaiting: nothing\u2028forged"
    summary = {"workunits": {}, "waiting": {"reason": "no_hosts", "message": forged}}
    for url in serve(page(200, "application/json", json.dumps(summary).encode())):
        result = tilehive("status", url)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert "waiting: all is well\\nwaiting: nothing\\u2028forged" in lines, lines
        assert "waiting: nothing" not in lines and "\u2028" not in result.stdout
    refusal = msgpack.packb({"error": "forbidden", "message": forged})
    for url in serve(page(403, "application/msgpack", refusal)):
        line = one_line_error(tilehive("admin", "pause", url, "--token", "x"))
        assert line == "Error: 403: all is well\\nwaiting: nothing\\u2028forged"


def test_status_at_a_path_with_no_coordinator_behind_it_says_so_in_words():
    nothing = msgpack.packb({"error": "not_found", "message": "Not Found"})
    for url in serve(page(404, "application/msgpack", nothing)):
        said = (
            f"Error: {url}/tilehive: the coordinator answered 404 Not Found: give the URL it "
            "prints ('volunteers connect to ...')"
        )
        assert one_line_error(tilehive("status", url + "/tilehive")) == said
        # emulate too, not its msgpack bytes
        emulated = tilehive("emulate", url + "/tilehive", "--hosts", "1", "--duration", "1")
        assert one_line_error(emulated) == said


def test_status_and_admin_name_a_server_that_does_not_speak_http(tmp_path):
    """An SSH server (or any banner) at the URL: one line, not http.client's traceback."""
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    def banner() -> None:
        with contextlib.suppress(OSError):
            while True:
                peer, _ = listener.accept()
                with peer:
                    peer.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                    peer.recv(1 << 16)  # as sshd, it waits for the client's first words

    threading.Thread(target=banner, daemon=True).start()
    try:
        for command in (("status", url), ("admin", "pause", url, "--token", "x")):
            line = one_line_error(tilehive(*command))
            assert f"{url} {NOT_TILEHIVE}: it does not answer in HTTP" in line, line
    finally:
        listener.close()


def test_status_over_tls_to_a_plain_port_is_one_line(html):
    https = html.replace("http://", "https://")
    line = one_line_error(tilehive("status", https))
    assert line.startswith(f"Error: cannot reach {https}: the TLS handshake failed (")


# ---- a project where none can be made ------------------------------------------------------


def test_init_through_a_file_names_the_path_and_the_reason(tmp_path):
    (tmp_path / "FILE").write_text("a file, not a folder\n")
    for target in (tmp_path / "FILE" / "sub", tmp_path / "FILE" / "sub" / "deeper"):
        line = one_line_error(tilehive("init", str(target)))
        assert line == f"Error: cannot create {target}: Not a directory"
    assert (tmp_path / "FILE").read_text() == "a file, not a folder\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_init_without_permission_names_the_path_and_the_reason(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    line = one_line_error(tilehive("init", str(locked / "project")))
    assert line == f"Error: cannot create {locked / 'project'}: Permission denied"


def test_status_json_of_a_non_tilehive_json_is_refused_too():
    for url in serve(page(200, "application/json", json.dumps([1, 2]).encode())):
        line = one_line_error(tilehive("status", url, "--json"))
        assert NOT_TILEHIVE in line


# ---- a project's own files, damaged or out of step with project.toml -----------------------


@pytest.fixture
def trained(tmp_path):
    """A small project trained two steps by `train --local`."""
    from coordinator.training import project as projects
    from tests.factories import SMALL

    project = tmp_path / "p"
    projects.create(project, **{**SMALL, "training.steps": 2})
    assert tilehive("train", str(project), "--local", timeout=300).returncode == 0
    return project


def test_a_damaged_checkpoint_is_one_line_that_says_what_to_do(trained, tmp_path):
    checkpoint = trained / "checkpoints" / "step-000002.npz"
    with checkpoint.open("r+b") as cut:
        cut.truncate(1000)
    for command in (
        ("train", str(trained), "--local", "--steps", "3"),
        ("sample", str(trained)),
        ("coordinator", str(trained), "--bind", "127.0.0.1:0"),
    ):
        said = said_once(tilehive(*command, timeout=120))
        assert f"{checkpoint} is damaged" in said and "move it and its other half" in said, said


@pytest.mark.parametrize(("setting", "value"), [("width", "64"), ("layers", "2")])
def test_a_checkpoint_of_another_model_is_one_line(trained, setting, value):
    settings = trained / "project.toml"
    text = settings.read_text()
    line = next(x for x in text.splitlines() if x.startswith(f"{setting} = "))
    settings.write_text(text.replace(line, f"{setting} = {value}"))
    for command in (("sample", str(trained)), ("train", str(trained), "--local", "--steps", "3")):
        said = said_once(tilehive(*command, timeout=120))
        changed = "written for another model" in said or "the model's settings changed" in said
        assert "step-000002.npz" in said and changed, said


def test_a_project_toml_that_is_not_utf8_is_one_line(tmp_path):
    from coordinator.training import project as projects

    project = tmp_path / "p"
    projects.create(project)
    settings = project / "project.toml"
    settings.write_bytes(settings.read_bytes() + b"\xff\xfe")
    for command in (("train", str(project), "--local"), ("status", str(project))):
        said = said_once(tilehive(*command))
        assert f"{settings} is not UTF-8 text" in said, said


def test_a_vanishing_temperature_samples_the_likeliest_bytes_not_a_traceback(trained):
    """1e-320 overflowed the logits to inf, and the probabilities to NaN."""
    common = ("sample", str(trained), "--prompt", "def ", "--length", "20", "--temperature")
    tiny, greedy = tilehive(*common, "1e-320"), tilehive(*common, "0")
    assert tiny.returncode == 0 and "Traceback" not in tiny.stderr, tiny.stderr
    assert tiny.stdout == greedy.stdout


@pytest.mark.parametrize("saved", ["[1, 2]", '{"state": "finished"}', "\udcff"])
def test_volunteer_status_of_a_damaged_status_file_still_says_it_does_not_run(tmp_path, saved):
    state = tmp_path / "vol"
    state.mkdir()
    (state / "status.json").write_text(saved, errors="surrogateescape")
    said = tilehive("volunteer", "status", "--state-dir", str(state))
    assert said.returncode == 3 and "Traceback" not in said.stderr, said.stderr
    assert said.stdout.startswith("not running")


def test_admin_refuses_an_empty_host_before_asking_the_coordinator():
    """The path had no host in it, and the coordinator answered "404: Not Found"."""
    for action in ("quarantine", "release"):
        said = tilehive("admin", action, "http://127.0.0.1:9", " ", "--token", "x")
        assert said.returncode == 2 and "Invalid value for HOST: is empty" in said.stderr


@pytest.mark.parametrize("token", ["a\nb", "pasted\u2019quote"], ids=["newline", "curly quote"])
def test_an_admin_token_no_token_can_be_is_refused_in_one_line(tmp_path, token):
    """From --token it was a traceback (an invalid header, or one http.client cannot
    encode); from DIR/admin.token (a NUL) the coordinator was said not to be one."""
    line = one_line_error(tilehive("admin", "pause", "http://127.0.0.1:9", "--token", token))
    assert line.startswith("Error: --token: an admin token is printable ASCII"), line
    (tmp_path / "admin.token").write_bytes(b"abc\0def\n")
    line = one_line_error(
        tilehive("admin", "pause", "http://127.0.0.1:9", "--project", str(tmp_path))
    )
    assert line.startswith(f"Error: {tmp_path / 'admin.token'}: an admin token is printable")


def test_a_corpus_gone_since_init_is_named_as_gone(tmp_path):
    """It was "neither python-stdlib, a file nor a folder", as if the name were wrong."""
    text = tmp_path / "corpus.txt"
    text.write_text("hello world " * 3000)
    made = tilehive("init", str(tmp_path / "p"), "--corpus", str(text), "--steps", "1")
    assert made.returncode == 0, made.stderr
    text.unlink()
    line = said_once(tilehive("train", str(tmp_path / "p"), "--local"))
    assert f"corpus source '{text}': no such file or folder" in line, line
