"""``carpool chat``: the REPL driven by a scripted terminal on the tiny
random-weight model, and once as a subprocess with piped stdin."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

from carpool.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.repl import HISTORY_LENGTH, ChatIO, ChatSession, line_editing
from carpool.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    config = EngineConfig.from_dict({"model": str(tiny_model_dir), "attention_backend": "torch",
                                     "kv_cache_memory": "16MiB"})
    return LLMEngine.from_config(config)


def params(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class Terminal:
    """Scripted input (a line, an exception class to raise, or a function
    that returns the line; EOF after the last), the reply text written and
    the status notes."""

    def __init__(self, *lines, on_write=None) -> None:
        self.lines = list(lines)
        self.written: list[str] = []
        self.notes: list[str] = []
        self.on_write = on_write

    def read(self, prompt: str) -> str:
        if not self.lines:
            raise EOFError
        line = self.lines.pop(0)
        if isinstance(line, type):
            raise line
        return line() if callable(line) else line

    def write(self, text: str) -> None:
        self.written.append(text)
        if self.on_write is not None:
            self.on_write(text)

    @property
    def io(self) -> ChatIO:
        return ChatIO(self.read, self.write, self.notes.append, "> ")

    @property
    def notes_text(self) -> str:
        return "\n".join(self.notes)


def idle(engine: LLMEngine) -> bool:
    """No request queued or running, and every KV block back in the pool."""
    scheduler = engine.scheduler
    return (not engine.has_unfinished and not scheduler.running and not scheduler.waiting
            and scheduler.kv.stats().used_blocks == 0)


def test_help_lists_the_commands_and_an_unknown_one_gets_a_hint(engine):
    term = Terminal("/help", "/bogus now")
    assert ChatSession(engine, params(), io=term.io).run() == 0  # EOF after the script
    help_text = term.notes[1]  # after the banner
    for name in ("/help", "/clear", "/reset", "/system", "/exit", "/quit", "//"):
        assert name in help_text
    assert term.notes[2] == "unknown command /bogus; /help lists the commands"
    assert term.written == []  # nothing was sent to the model


def test_clear_forgets_the_conversation_but_keeps_the_system_prompt(engine):
    def answer(session, text):
        term = Terminal()
        session.io = term.io
        session.handle(text)
        return "".join(term.written)

    session = ChatSession(engine, params(), system="Be terse.")
    fresh = answer(session, "The quick brown fox")
    answer(session, "and then?")
    assert [m["role"] for m in session.messages] == ["system"] + ["user", "assistant"] * 2
    session.handle("/reset")
    assert session.turns == [] and session.messages == [{"role": "system",
                                                         "content": "Be terse."}]
    # Greedy: after /clear the same question gets the same answer as at first.
    assert answer(session, "The quick brown fox") == fresh
    session.handle("/clear")
    session.handle("/system Answer in French.")
    assert session.messages == [{"role": "system", "content": "Answer in French."}]


def test_ctrl_c_during_a_reply_aborts_it_and_the_chat_goes_on(engine):
    interrupts = [KeyboardInterrupt]

    def ctrl_c_on_third_token(_text):
        if len(term.written) == 3 and interrupts:
            raise interrupts.pop()

    def next_line_sees_the_engine():
        seen.append(idle(engine))
        return "Continue"

    seen: list[bool] = []
    term = Terminal("Tell me a long story", next_line_sees_the_engine,
                    on_write=ctrl_c_on_third_token)
    session = ChatSession(engine, params(200), io=term.io)
    assert session.run() == 0
    assert term.notes.count("[stopped]") == 1
    assert seen == [True], "the stopped request still held the engine at the next prompt"
    assert idle(engine)
    # The stopped reply is kept as far as it got; the next one runs to max_tokens.
    first, second = session.turns[1]["content"], session.turns[3]["content"]
    assert first == "".join(term.written[:3]) and first
    assert len(engine.tokenizer.encode(second)) >= 150  # about 200 tokens, re-tokenized
    assert [m["role"] for m in session.turns] == ["user", "assistant"] * 2


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers belong to the main thread")
def test_a_real_sigint_stops_the_reply_between_steps(engine):
    returned = []
    before = signal.getsignal(signal.SIGINT)

    def sigint_on_first_token(_text):
        if not returned:
            signal.raise_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends
            returned.append(True)  # not reached if SIGINT raised KeyboardInterrupt here

    term = Terminal("Tell me a long story", on_write=sigint_on_first_token)
    session = ChatSession(engine, params(200), io=term.io)
    assert session.run() == 0
    assert returned and term.notes.count("[stopped]") == 1
    assert len(term.written) <= 3  # the first token and the line end, not 200 tokens
    assert idle(engine)
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back


def test_ctrl_c_at_the_prompt_warns_then_a_second_one_exits(engine):
    term = Terminal(KeyboardInterrupt, "hello", KeyboardInterrupt, KeyboardInterrupt, "unread")
    assert ChatSession(engine, params(), io=term.io).run() == 0
    assert term.notes_text.count("press Ctrl-C again") == 2
    assert term.written  # "hello" was answered: one Ctrl-C does not quit
    assert term.lines == ["unread"]


def test_exit_and_quit_and_eof_end_the_loop(engine):
    for script in (["/exit", "unread"], ["/QUIT", "unread"], []):
        term = Terminal(*script)
        assert ChatSession(engine, params(), io=term.io).run() == 0
        assert term.lines == script[1:]


def test_a_too_long_conversation_is_refused_with_a_hint_and_not_kept(engine):
    term = Terminal("fox " * 600, "//slash")
    session = ChatSession(engine, params(), io=term.io)
    session.run()
    assert any("maximum context length" in n and "/clear starts over" in n for n in term.notes)
    assert session.turns[0] == {"role": "user", "content": "/slash"}  # // sends the line
    assert idle(engine)


def test_a_reply_is_cut_to_the_context_left_instead_of_refused(engine):
    term = Terminal("hello")
    session = ChatSession(engine, params(10_000), io=term.io)  # far past the 512 context
    session.run()
    assert [m["role"] for m in session.turns] == ["user", "assistant"]
    assert not any(n.startswith("carpool:") for n in term.notes)
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(session.turns[:1]))
    room = engine.max_model_len - len(prompt)
    assert room // 2 < len(term.written) - 1 <= room  # one write per token or so, then "\n"
    assert idle(engine)


def test_history_is_bounded_and_kept_in_a_file(tmp_path):
    readline = pytest.importorskip("readline")
    path = tmp_path / "cache" / "chat_history"
    try:
        with line_editing(path):
            for i in range(HISTORY_LENGTH + 5):
                readline.add_history(f"line {i}")
        readline.clear_history()
        readline.read_history_file(str(path))
        assert readline.get_current_history_length() == HISTORY_LENGTH
        assert readline.get_history_item(HISTORY_LENGTH) == f"line {HISTORY_LENGTH + 4}"
        assert readline.get_completer()("/he", 0) == "/help"
    finally:
        readline.clear_history()
        readline.set_completer(None)


def test_without_readline_input_is_plain_and_no_file_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "readline", None)  # import readline now fails
    path = tmp_path / "chat_history"
    with line_editing(path):
        pass
    assert not path.exists()


def test_carpool_chat_with_piped_stdin_answers_and_exits(tiny_model_dir, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "chat", "--model", str(tiny_model_dir),
         "--attention-backend", "torch", "--kv-cache-memory", "16MiB", "--max-tokens", "5",
         "--cache-dir", str(tmp_path)],
        input="Hello there\n/bogus\n/help\nAnd again\n", capture_output=True, text=True,
        timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() and not result.stdout.startswith(">")  # no prompt when piped
    assert result.stdout.endswith("\n") and len(result.stdout) >= 4
    assert "unknown command /bogus" in result.stderr and "/system" in result.stderr
    assert not (tmp_path / "chat_history").exists()  # piped input is not history
