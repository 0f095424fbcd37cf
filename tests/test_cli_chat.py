"""`chatcore chat` against a real server: the client runs as a subprocess (`python -m chatcore.cli chat`),
reading a pipe or a pseudo-terminal, and what it prints is checked against what the server stored."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_helpers import STARTUP_TIMEOUT_S, LiveServer, free_port, start_server
from tests.tcp_proxy import TcpProxy

pytestmark = pytest.mark.model
CLIENT = [sys.executable, "-m", "chatcore.cli", "chat"]
STORY = "Write a long story about a brave knight and a dragon."  # runs past 100 tokens at temperature 0
DEADLINE_S = 180


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(tmp_path_factory.mktemp("chat-server"))
    yield live
    live.stop()


@pytest.fixture
def client_dir(tmp_path: Path) -> Path:
    return tmp_path / "client"


def chat(url: str, data_dir: Path, *args: str, lines: str, max_tokens: int = 24) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLIENT, "--url", url, "--data-dir", str(data_dir), "--temperature", "0",
                           "--max-tokens", str(max_tokens), *args],
                          input=lines, capture_output=True, text=True, timeout=DEADLINE_S)


def stored(server: LiveServer, session_id: str) -> dict:
    status, detail = server.get(f"/v1/sessions/{session_id}")
    assert status == 200, detail
    return detail


def session_of(stdout: str) -> str:
    first, _, _ = stdout.partition("\n")
    assert first.startswith("session: "), stdout
    return first.removeprefix("session: ")


class Output:
    """What a child process writes to `fd`, read with a deadline: never a sleep to wait for it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""

    def until(self, wanted: str, start: int = 0, deadline_s: float = DEADLINE_S) -> int:
        """Read until `wanted` appears at or after `start`; returns where it ends."""
        deadline = time.monotonic() + deadline_s
        while (found := self.text.find(wanted, start)) < 0:
            left = deadline - time.monotonic()
            assert left > 0, f"{wanted!r} did not appear in {deadline_s:g} s; output so far: {self.text!r}"
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:  # a pty whose child exited: EIO
                    data = b""
                assert data, f"the output ended before {wanted!r}: {self.text!r}"
                self.text += data.decode(errors="replace")
        return found + len(wanted)

    def rest(self) -> str:
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                return self.text
            if not data:
                return self.text
            self.text += data.decode(errors="replace")


def test_a_piped_chat_answers_prints_the_history_and_exits_on_exit(server: LiveServer, client_dir: Path) -> None:
    done = chat(server.ws_url, client_dir, lines="Hello! Who are you?\n/history\n/exit\nnever sent\n")
    assert done.returncode == 0, done.stderr
    session_id = session_of(done.stdout)
    history = stored(server, session_id)["history"]
    assert [m["role"] for m in history] == ["user", "assistant"]  # /exit ended it: the last line was not sent
    answer = history[1]["content"]
    assert answer
    assert done.stdout == (f"session: {session_id}\n{answer}\n"
                           f"user: Hello! Who are you?\nassistant: {answer}\n")
    assert "Traceback" not in done.stderr and "\x1b[" not in done.stdout + done.stderr  # a pipe: no colours
    tokens = client_dir / "chat" / "sessions.json"
    assert tokens.stat().st_mode & 0o777 == 0o600 and tokens.parent.stat().st_mode & 0o777 == 0o700
    assert session_id in tokens.read_text()


def test_a_session_resumes_by_id_after_the_client_exits(server: LiveServer, client_dir: Path) -> None:
    first = chat(server.ws_url, client_dir, lines="My name is Ada.\n")  # the end of the input ends it too
    assert first.returncode == 0, first.stderr
    session_id = session_of(first.stdout)
    second = chat(server.ws_url, client_dir, f"--session={session_id}", lines="What is my name?\n")
    assert second.returncode == 0, second.stderr
    assert session_of(second.stdout) == session_id  # no token typed: the client kept it
    history = stored(server, session_id)["history"]
    assert [m["content"] for m in history[::2]] == ["My name is Ada.", "What is my name?"]
    assert second.stdout == f"session: {session_id}\n{history[3]['content']}\n"
    elsewhere = chat(server.ws_url, client_dir.parent / "other-client", f"--session={session_id}", lines="Hi\n")
    assert elsewhere.returncode == 2 and elsewhere.stdout == ""
    assert elsewhere.stderr.count("\n") == 1 and "--resume-token" in elsewhere.stderr
    token = stored_token(client_dir, session_id, server.ws_url)
    given = chat(server.ws_url, client_dir.parent / "other-client", f"--session={session_id}",
                 f"--resume-token={token}", lines="/exit\n")
    assert given.returncode == 0 and session_of(given.stdout) == session_id
    wrong = chat(server.ws_url, client_dir.parent / "other-client", f"--session={session_id}",
                 "--resume-token", "not-the-token", lines="/exit\n")
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "--resume-token" in wrong.stderr


def stored_token(client_dir: Path, session_id: str, url: str) -> str:
    return json.loads((client_dir / "chat" / "sessions.json").read_text())["servers"][url][session_id]


def test_new_system_and_sessions(server: LiveServer, client_dir: Path) -> None:
    done = chat(server.ws_url, client_dir, lines="/system You answer in French.\n/sessions\n/new\n/exit\n")
    assert done.returncode == 0, done.stderr
    ids = [line.removeprefix("session: ") for line in done.stdout.splitlines() if line.startswith("session: ")]
    assert len(ids) == 3 and len(set(ids)) == 3
    assert stored(server, ids[1])["system_prompt"] == "You answer in French."
    assert stored(server, ids[2])["system_prompt"] == "You answer in French."  # /new keeps the set prompt
    listed = [line for line in done.stdout.splitlines() if not line.startswith("session: ")]
    assert f"* {ids[1]}  0 turns  (untitled)" in listed  # the current one marked
    assert any(line.startswith(f"  {ids[0]}") for line in listed)


@pytest.mark.parametrize("form", ["origin", "host:port"])
def test_the_address_the_server_prints_is_the_url(server: LiveServer, client_dir: Path, form: str) -> None:
    """`--url http://HOST:PORT` (what the UI, the README and `serve` show) or `HOST:PORT` reaches the
    same WebSocket API as ws://HOST:PORT/v1/ws, and the turn is stored on that server."""
    url = server.base_url if form == "origin" else server.base_url.removeprefix("http://")
    done = chat(url, client_dir, lines="Hello!\n/exit\n")
    assert done.returncode == 0, done.stderr
    history = stored(server, session_of(done.stdout))["history"]
    assert [m["role"] for m in history] == ["user", "assistant"] and history[1]["content"] in done.stdout
    refused = chat("ftp://127.0.0.1:1", client_dir, lines="Hello!\n")
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.count("\n") == 1
    assert "http://HOST:PORT" in refused.stderr and "Traceback" not in refused.stderr


def test_bad_input_is_one_line_and_never_a_traceback(server: LiveServer, client_dir: Path) -> None:
    done = chat(server.ws_url, client_dir, lines="/bogus\n/history extra\n/system\n/exit\n")
    assert done.returncode == 0
    hints = done.stderr.splitlines()
    assert len(hints) == 3 and hints[0].startswith("[unknown command /bogus; commands: /exit")
    assert stored(server, session_of(done.stdout))["history"] == []  # none of them was sent as a turn
    url = f"ws://127.0.0.1:{free_port()}/v1/ws"
    down = chat(url, client_dir, lines="Hello\n")
    assert down.returncode == 1 and down.stdout == ""
    assert down.stderr.count("\n") == 1 and url in down.stderr and "Traceback" not in down.stderr
    missing = chat(server.ws_url, client_dir, "--session", "no-such-session", "--resume-token", "x", lines="Hi\n")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "Traceback" not in missing.stderr


def test_a_dropped_connection_mid_answer_prints_the_rest_once(server: LiveServer, client_dir: Path) -> None:
    """The proxy cuts the socket mid-answer; the turn runs on; the client comes back with `last_seq`."""
    proxy = TcpProxy(int(server.base_url.rsplit(":", 1)[1]))
    try:
        proc, out = start_piped(f"ws://127.0.0.1:{proxy.port}/v1/ws", client_dir, f"{STORY}\n/exit\n")
        end = out.until("\n", out.until("session: "))
        out.until(" ", end + 1)  # some of the answer is printed
        proxy.drop()
        assert proc.wait(timeout=DEADLINE_S) == 0
        text = out.rest()
        session_id = session_of(text)
        answer = stored(server, session_id)["history"][1]["content"]
        assert text == f"session: {session_id}\n{answer}\n"  # nothing twice, nothing lost
        assert proxy.accepted == 2  # it reconnected: the drop came before `done` (after it, /exit needs no socket)
        assert "reconnecting" in proc.stderr.read()
    finally:
        proxy.close()


def test_an_answer_that_ends_while_the_connection_is_down_is_printed_whole(server: LiveServer,
                                                                          client_dir: Path) -> None:
    """Reconnects are refused until the turn is stored: the rest comes from the history, and its replay is not
    printed again."""
    proxy = TcpProxy(int(server.base_url.rsplit(":", 1)[1]))
    try:
        proc, out = start_piped(f"ws://127.0.0.1:{proxy.port}/v1/ws", client_dir, f"{STORY}\n/exit\n",
                                max_tokens=120)
        end = out.until("\n", out.until("session: "))
        session_id = out.text[:end].split("session: ", 1)[1].strip()
        out.until(" ", end + 1)
        proxy.refusing = True
        proxy.drop()
        deadline = time.monotonic() + DEADLINE_S
        while len(stored(server, session_id)["history"]) < 2:  # polling the server's state, with a deadline
            assert time.monotonic() < deadline
            time.sleep(0.2)
        proxy.refusing = False
        assert proc.wait(timeout=DEADLINE_S) == 0
        answer = stored(server, session_id)["history"][1]["content"]
        assert out.rest() == f"session: {session_id}\n{answer}\n"
        assert proxy.accepted == 2
    finally:
        proxy.close()


def test_a_server_restart_mid_answer(server: LiveServer, client_dir: Path) -> None:
    """SIGTERM mid-answer ends the turn (`disconnected`, its partial answer stored); the client waits for the
    server to come back, prints what it had not, and the next line is a turn of the same session."""
    proc, out = start_piped(server.ws_url, client_dir, f"{STORY}\nThank you.\n/exit\n", max_tokens=200)
    end = out.until("\n", out.until("session: "))
    session_id = out.text[:end].split("session: ", 1)[1].strip()
    out.until(" ", end + 1)
    server.stop()
    restart(server)
    assert proc.wait(timeout=DEADLINE_S) == 0
    history = stored(server, session_id)["history"]
    assert [m["finish_reason"] for m in history[1::2]][0] == "disconnected"
    assert out.rest() == f"session: {session_id}\n{history[1]['content']}\n{history[3]['content']}\n"
    assert "reconnected" in proc.stderr.read()


def start_piped(url: str, data_dir: Path, lines: str, max_tokens: int = 200) -> tuple[subprocess.Popen[str], Output]:
    proc = subprocess.Popen([*CLIENT, "--url", url, "--data-dir", str(data_dir), "--temperature", "0",
                             "--max-tokens", str(max_tokens)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(lines)
    proc.stdin.close()
    return proc, Output(proc.stdout.fileno())


def restart(server: LiveServer) -> None:
    """`chatcore serve` again on the same port and data folder; returns once /healthz answers."""
    with server.log_path.open("ab") as log:
        server.proc = subprocess.Popen([sys.executable, "-m", "chatcore.cli", "serve"], env=server.env, stdout=log,
                                       stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.log()
        try:
            with urllib.request.urlopen(server.base_url + "/healthz", timeout=2):
                return
        except OSError:
            time.sleep(0.2)  # polling for the port to open, not synchronising on work
    raise AssertionError(f"the server did not come back:\n{server.log()}")


def test_ctrl_c_in_a_terminal_cancels_the_answer_not_the_program_and_quits_at_the_prompt(server: LiveServer, client_dir: Path) -> None:
    pid, master = pty.fork()
    if pid == 0:  # the child: a session leader whose controlling terminal is the pty
        os.execvpe(sys.executable, [*CLIENT, "--url", server.ws_url, "--data-dir", str(client_dir),
                                    "--temperature", "0", "--max-tokens", "400"], os.environ)
    out = Output(master)
    try:
        end = out.until(">>> ", out.until("session: "))  # a terminal gets a prompt
        session_id = out.text[: end].split("session: ", 1)[1].split()[0]
        os.write(master, f"{STORY}\n".encode())
        out.until(" ", out.until(STORY, end) + 2)  # the line echoed, then some of the answer
        os.write(master, b"\x03")  # Ctrl-C: the terminal sends SIGINT to the client
        end = out.until(">>> ", out.until("cancelled"))  # the answer ended; the program asks for the next line
        entry = stored(server, session_id)["history"]
        assert [m["role"] for m in entry] == ["user", "assistant"] and entry[1]["finish_reason"] == "cancelled"
        os.write(master, b"/history\n")
        out.until(">>> ", out.until("assistant: ", end))
        os.write(master, b"\x03")  # at the prompt, with no answer running, Ctrl-C quits
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.waitstatus_to_exitcode(status) == 130
        assert "Traceback" not in out.rest() and "\x1b[" in out.text  # a terminal: colours
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(master)


def test_keyed_mode_takes_the_api_key_and_names_it_when_missing(tmp_path: Path) -> None:
    """A keyed server: with `--api-key` the chat runs as the key's tenant; without one, one line names the option."""
    import types

    from tests.server_helpers import create_key

    data = tmp_path / "keyed"
    data.mkdir()
    key = create_key(types.SimpleNamespace(env={**os.environ, "CHATCORE_DATA_DIR": str(data)}), "alice")
    live = start_server(data, max_tokens_limit=8)
    try:
        url = live.ws_url
        done = chat(url, tmp_path / "client", "--api-key", key, lines="Hello.\n/sessions\n/exit\n", max_tokens=4)
        assert done.returncode == 0, done.stderr
        session_id = session_of(done.stdout)
        assert session_id in done.stdout.split("\n", 1)[1]  # /sessions lists it: the key's tenant holds it
        refused = chat(url, tmp_path / "client", lines="Hello.\n/exit\n", max_tokens=4)
        assert refused.returncode != 0 and "--api-key" in refused.stderr and refused.stderr.count("\n") == 1
        assert "Traceback" not in refused.stderr
    finally:
        live.stop()


HOSTILE = ("Hi \x1b]52;c;c3RvbGVu\x07there\x1b[2J\x1b[H, \x1b]0;owned\x1b\\see "
           "\x1b]8;;http://evil.example\x1b\\this\x1b]8;;\x1b\\\x9b31m now\x08\x7f\r\tand\nmore")
CONTROLS = [chr(c) for c in (*range(0x00, 0x09), *range(0x0b, 0x20), *range(0x7f, 0xa0))]


def test_server_text_reaches_the_terminal_without_control_sequences(server: LiveServer, client_dir: Path) -> None:
    """History, titles and ids from the server print with every escape and control stripped, newlines and tabs
    kept; an import's title holding ESC is refused."""
    exchange = [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": HOSTILE}]
    status, refused = server.request("POST", "/v1/sessions/import",
                                     {"title": "a\x1b]0;title\x07", "messages": exchange})
    assert status == 400 and "control characters" in refused["error"]["message"], refused
    status, imported = server.request("POST", "/v1/sessions/import", {"title": "Plain", "messages": exchange})
    assert status == 201, imported
    done = chat(server.ws_url, client_dir, f"--session={imported['id']}", f"--resume-token={imported['resume_token']}",
                lines="/history\n/sessions\n/exit\n")
    assert done.returncode == 0, done.stderr
    assert not [c for c in CONTROLS if c in done.stdout + done.stderr], repr(done.stdout)
    assert "assistant: Hi there, see this now\tand\nmore\n" in done.stdout
    assert f"{imported['id']}  1 turns  Plain" in done.stdout
    assert stored(server, imported["id"])["history"][1]["content"] == HOSTILE  # stored as sent: only printing strips


def test_resume_tokens_are_bound_to_their_server_and_the_folder_to_0700(server: LiveServer, client_dir: Path) -> None:
    """`--session ID --url OTHER` finds no token of another server and connects nowhere; a token stored for
    OTHER is the one sent there, and the first server's session frames leave it alone."""
    (client_dir / "chat").mkdir(parents=True, mode=0o777)
    os.chmod(client_dir / "chat", 0o777)
    first = chat(server.ws_url, client_dir, lines="/exit\n")
    assert first.returncode == 0, first.stderr
    assert (client_dir / "chat").stat().st_mode & 0o777 == 0o700
    session_id = session_of(first.stdout)
    proxy = TcpProxy(int(server.base_url.rsplit(":", 1)[1]))  # the same server under another URL
    try:
        other = f"ws://127.0.0.1:{proxy.port}/v1/ws"
        elsewhere = chat(other, client_dir, f"--session={session_id}", lines="/exit\n")
        assert elsewhere.returncode == 2 and "--resume-token" in elsewhere.stderr and proxy.accepted == 0
        tokens = client_dir / "chat" / "sessions.json"
        store = json.loads(tokens.read_text())
        store["servers"][other] = {session_id: "a-token-of-the-other-server"}
        tokens.write_text(json.dumps(store))
        os.chmod(client_dir / "chat", 0o777)  # loosened again: the next run writes no token, and still fixes it
        again = chat(server.ws_url, client_dir, f"--session={session_id}", lines="/exit\n")
        assert again.returncode == 0 and session_of(again.stdout) == session_id, again.stderr
        assert (client_dir / "chat").stat().st_mode & 0o777 == 0o700
        assert stored_token(client_dir, session_id, other) == "a-token-of-the-other-server"
        sent_there = chat(other, client_dir, f"--session={session_id}", lines="/exit\n")
        assert sent_there.returncode == 2 and "resume token" in sent_there.stderr and proxy.accepted == 1
    finally:
        proxy.close()


def test_a_frame_over_the_clients_bound_ends_the_chat_in_one_line() -> None:
    """A server whose `session` frame is bigger than the client reads: one line, no reconnect loop."""
    from websockets.asyncio.server import serve

    from chatcore.chat.connection import MAX_FRAME_BYTES, Connection
    from chatcore.chat.errors import ChatError

    async def answer(ws) -> None:  # noqa: ANN001
        await ws.recv()
        await ws.send(json.dumps({"type": "session", "pad": "x" * MAX_FRAME_BYTES}))

    async def run() -> str:
        async with serve(answer, "127.0.0.1", 0, max_size=None) as listener:
            port = listener.sockets[0].getsockname()[1]
            with pytest.raises(ChatError) as refused:
                await Connection(f"ws://127.0.0.1:{port}/v1/ws", None, print).open(None, None, None)
            return str(refused.value)

    message = asyncio.run(run())
    assert f"over {MAX_FRAME_BYTES} bytes" in message and "\n" not in message
