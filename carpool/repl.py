"""``carpool generate`` and ``carpool chat``: stream tokens to the terminal.

``carpool chat`` behaves like llama.cpp's and Python's REPLs: Ctrl-C while a
reply streams stops that reply (the request is aborted in the engine, its
KV blocks freed) and gives the prompt back; Ctrl-C at the prompt drops the
line and, pressed again right away, quits, as do Ctrl-D and ``/exit``.
Line editing, history and Tab completion of the slash commands come from
the standard ``readline`` module when there is one and stdin is a terminal.
Replies go to stdout and everything else to stderr, so
``carpool chat < questions.txt > answers.txt`` keeps only the answers.
"""
from __future__ import annotations

import dataclasses
import importlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from carpool.config import EngineConfig
from carpool.engine.front import ContextLengthError
from carpool.engine.llm_engine import LLMEngine
from carpool.sampling_params import SamplingParams

# Lines of input history kept (the history file is cut to this on exit).
HISTORY_LENGTH = 1000
HISTORY_FILE = "chat_history"  # in the carpool cache dir

# The slash commands and their /help lines; ALIASES map other spellings.
COMMANDS = {
    "/help": "list these commands",
    "/clear": "forget the conversation, keep the system prompt (also /reset)",
    "/system": "/system TEXT sets the system prompt, /system alone shows it",
    "/exit": "quit (also /quit, Ctrl-D, or Ctrl-C twice at the prompt)",
}
ALIASES = {"/reset": "/clear", "/quit": "/exit"}
BANNER = ("carpool chat: type a message; /help lists the commands, Ctrl-C stops a reply, "
          "Ctrl-D or /exit quits.")
EXIT_HINT = "(To exit, press Ctrl-C again, Ctrl-D, or type /exit.)"


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _note_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass
class ChatIO:
    """The REPL's terminal, injectable for tests.

    ``read(prompt)`` returns one line, or raises ``EOFError`` (Ctrl-D, end
    of piped input) or ``KeyboardInterrupt`` (Ctrl-C); ``write`` receives
    the reply as it streams (stdout); ``note`` one status line (stderr).
    ``prompt`` is empty when stdin is not a terminal, so piped output
    holds only the replies.
    """

    read: Callable[[str], str] = input
    write: Callable[[str], None] = _write_stdout
    note: Callable[[str], None] = _note_stderr
    prompt: str = "> "


def stream_one(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams) -> str:
    """Run one request to completion, printing text as it arrives; Ctrl-C
    stops it between steps and raises ``KeyboardInterrupt`` (exit 130)."""
    stop = threading.Event()
    with ctrl_c_sets(stop):
        text, _ = stream_reply(engine, prompt_ids, params, _write_stdout, stop)
    sys.stdout.write("\n")
    if stop.is_set():
        raise KeyboardInterrupt
    return text


def stream_reply(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams,
                 write: Callable[[str], None], stop: threading.Event) -> tuple[str, bool]:
    """Generate one reply, passing its text to ``write`` as it arrives.

    Stops between engine steps once ``stop`` is set (or ``write`` raises
    ``KeyboardInterrupt``) and aborts the request, which frees its KV
    blocks at once. Returns (the text so far, whether it was stopped).
    """
    request_id = engine.add_request(prompt_ids, params)
    parts: list[str] = []
    try:
        while engine.has_unfinished and not stop.is_set():
            for output in engine.step():
                if output.request_id == request_id and output.delta_text:
                    parts.append(output.delta_text)  # before write: what was shown is kept
                    write(output.delta_text)
    except KeyboardInterrupt:
        stop.set()
    # None when it had already finished: a Ctrl-C after the last token stops nothing.
    stopped = stop.is_set() and engine.abort_request(request_id) is not None
    return "".join(parts), stopped


@contextmanager
def ctrl_c_sets(flag: threading.Event) -> Iterator[None]:
    """While inside, Ctrl-C (SIGINT) sets ``flag`` instead of raising
    ``KeyboardInterrupt``: a reply then stops between engine steps, never
    halfway through one, which could leave the scheduler's books and the
    KV pool out of step. Only the main thread may own signal handlers;
    elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: flag.set())
    try:
        yield
    finally:  # None: the old handler was not set from Python; restore the default
        signal.signal(signal.SIGINT, previous if previous is not None
                      else signal.default_int_handler)


class ChatSession:
    """One conversation on an engine: its turns, its system prompt and the
    REPL loop with its slash commands."""

    def __init__(self, engine: LLMEngine, params: SamplingParams, system: str | None = None,
                 io: ChatIO | None = None) -> None:
        self.engine, self.params, self.system = engine, params, system
        self.io = io or ChatIO()
        self.turns: list[dict[str, str]] = []  # user and assistant messages, in order
        self._stop = threading.Event()

    @property
    def messages(self) -> list[dict[str, str]]:
        """What the chat template renders: the system prompt, then the turns."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns

    def run(self) -> int:
        """Read and answer lines until /exit, end of input, or two Ctrl-C in
        a row at the prompt; returns the exit status (0)."""
        if self.io.prompt:
            self.io.note(BANNER)
        armed = False  # the last thing read was a Ctrl-C at the prompt
        while True:
            try:
                line = self.io.read(self.io.prompt)
            except EOFError:
                self.io.note("")
                return 0
            except KeyboardInterrupt:
                if armed:
                    self.io.note("")
                    return 0
                armed = True
                self.io.note("\n" + EXIT_HINT)
                continue
            armed = False
            try:
                if not self.handle(line):
                    return 0
            except KeyboardInterrupt:  # landed before the reply's own handler was set
                self.io.note("[stopped]")

    def handle(self, line: str) -> bool:
        """Act on one input line; False when it asks to quit. A line that
        starts with ``//`` is sent as a message without its first ``/``."""
        text = line.strip()
        if text.startswith("/") and not text.startswith("//"):
            return self.command(text)
        if text:
            self.reply(text[1:] if text.startswith("//") else text)
        return True

    def command(self, text: str) -> bool:
        """Run one slash command; False for /exit."""
        name, _, argument = text.partition(" ")
        name = ALIASES.get(name.lower(), name.lower())
        if name == "/exit":
            return False
        if name == "/help":
            width = max(map(len, COMMANDS)) + 2
            self.io.note("\n".join(f"{n:<{width}}{line}" for n, line in COMMANDS.items())
                         + "\nStart a message with // to send a line that begins with /.")
        elif name == "/clear":
            self.turns.clear()
            self.io.note("(conversation cleared)")
        elif name == "/system" and argument.strip():
            self.system = argument.strip()
            self.io.note("(system prompt set)")
        elif name == "/system":
            self.io.note(f"system prompt: {self.system!r}" if self.system else "(no system prompt)")
        else:
            self.io.note(f"unknown command {name}; /help lists the commands")
        return True

    def reply(self, text: str) -> None:
        """Answer one user message, streaming the reply; a stopped reply is
        kept as far as it got (as chat UIs do), an empty one with its question
        dropped, so the conversation can go on from there. A message the
        context cannot hold is refused with a hint and not kept."""
        self._stop.clear()
        with ctrl_c_sets(self._stop):
            self.turns.append({"role": "user", "content": text})
            try:
                prompt = self.engine.tokenizer.encode(
                    self.engine.tokenizer.apply_chat_template(self.messages))
                answer, stopped = stream_reply(self.engine, prompt, self._fit(prompt),
                                               self.io.write, self._stop)
            except ValueError as exc:  # e.g. the conversation outgrew the context
                self.turns.pop()
                hint = " (/clear starts over)" if isinstance(exc, ContextLengthError) else ""
                self.io.note(f"carpool: {exc}{hint}")
                return
            self.io.write("\n")
            if answer:
                self.turns.append({"role": "assistant", "content": answer})
            else:
                self.turns.pop()
        if stopped:
            self.io.note("[stopped]")

    def _fit(self, prompt: list[int]) -> SamplingParams:
        """The sampling params with max_tokens cut to the context left, so a
        long conversation gets shorter replies, as in llama.cpp, until the
        prompt alone fills the context (then the engine refuses it)."""
        room = self.engine.max_model_len - len(prompt)
        if 0 < room < self.params.max_tokens:
            return dataclasses.replace(self.params, max_tokens=room)
        return self.params


def _import_readline() -> ModuleType | None:
    try:
        return importlib.import_module("readline")
    except ImportError:  # e.g. Windows, or a Python built without it
        return None


def _complete_commands(readline: ModuleType) -> None:
    names = sorted([*COMMANDS, *ALIASES])

    def complete(text: str, state: int) -> str | None:
        matches = [n for n in names if n.startswith(text)] if text.startswith("/") else []
        return matches[state] if state < len(matches) else None

    readline.set_completer(complete)
    readline.set_completer_delims(" \t\n")  # "/" belongs to a command's name
    libedit = "libedit" in (readline.__doc__ or "")  # macOS's stand-in binds differently
    readline.parse_and_bind("bind ^I rl_complete" if libedit else "tab: complete")


@contextmanager
def line_editing(history: Path | None) -> Iterator[None]:
    """Line editing, Tab completion of the slash commands and a history
    kept in ``history`` (at most HISTORY_LENGTH lines) for ``input()``,
    through the standard ``readline`` module. Without the module, or with
    ``history`` None, plain ``input()``; an unreadable or unwritable
    history file is skipped, never an error."""
    readline = _import_readline() if history is not None else None
    if readline is None:
        yield
        return
    readline.set_history_length(HISTORY_LENGTH)
    try:
        readline.read_history_file(str(history))
    except OSError:  # the first run, or unreadable
        pass
    _complete_commands(readline)
    try:
        yield
    finally:
        try:
            history.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(str(history))  # cut to HISTORY_LENGTH lines
        except OSError:
            pass


def chat_history_path(config: EngineConfig) -> Path:
    """``chat_history`` in the cache dir (``--cache-dir``, $CARPOOL_CACHE or
    ~/.cache/carpool)."""
    from carpool.paths import default_cache_dir

    cache = Path(config.model.cache_dir) if config.model.cache_dir else default_cache_dir()
    return cache / HISTORY_FILE


def run_generate(config: EngineConfig, prompt: str, params: SamplingParams, raw: bool) -> int:
    """``carpool generate``: one prompt, the reply streamed to stdout."""
    engine = LLMEngine.from_config(config, kernels_in_background=True)
    if not raw:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    stream_one(engine, engine.tokenizer.encode(prompt), params)
    return 0


def run_chat(config: EngineConfig, params: SamplingParams, system: str | None,
             io: ChatIO | None = None) -> int:
    """``carpool chat``: the REPL on a freshly loaded engine. With stdin a
    terminal it shows a prompt and keeps a history; piped, it answers each
    line and prints only the replies."""
    engine = LLMEngine.from_config(config, kernels_in_background=True)
    interactive = sys.stdin.isatty()
    io = io or ChatIO(prompt="> " if interactive else "")
    with line_editing(chat_history_path(config) if interactive else None):
        return ChatSession(engine, params, system, io).run()
