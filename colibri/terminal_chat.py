"""``coli chat``: a terminal chat over the legacy protocol, with the engine as a child process.

The engine runs in its own session so that the terminal's Ctrl-C reaches only us: during an
answer it becomes ``\\x02CANCEL`` (the answer stops, the program stays); at the prompt it is
ignored. ``/reset`` forgets the conversation, ``/more`` continues a cut answer, Ctrl-D or
``/quit`` leaves. A gpt-oss reply in its harmony format shows its answer; its reasoning (the
``analysis`` channel) dim on a terminal and not at all when the output is piped (``Reply``).
"""

from __future__ import annotations

import codecs
import signal
import sys

import trio

from colibri.io import legacy
from colibri.model.harmony import CHANNEL, START, HarmonySplit

HELP = "/reset  forget the conversation   /more  continue the answer   /quit  leave (or Ctrl-D)"
DIM, RESET = "\x1b[2m", "\x1b[0m"


def chat(engine_args: list[str]) -> int:
    return trio.run(_chat, engine_args)


async def _chat(engine_args: list[str]) -> int:
    cmd = [sys.executable, "-m", "colibri", "engine", *engine_args]
    async with trio.open_nursery() as nursery:
        proc = await trio.lowlevel.open_process(
            cmd, stdin=-1, stdout=-1, start_new_session=True  # -1: subprocess.PIPE
        )
        state = {"busy": False}  # an answer is streaming: Ctrl-C cancels it
        nursery.start_soon(_ctrl_c, proc, state)
        reader = legacy.OutputReader()
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        print(f"colibri chat. {HELP}", file=sys.stderr)
        reply = Reply(sys.stdout.isatty())
        try:
            while True:
                try:
                    line = await trio.to_thread.run_sync(_input)
                except EOFError:
                    break
                command = line.strip()
                if command in ("/quit", "/exit"):
                    break
                if not command:
                    continue
                if command == "/help":
                    print(HELP, file=sys.stderr)
                    continue
                frame = {"/reset": legacy.Reset(), "/more": legacy.More()}.get(command, legacy.UserLine(line))
                await proc.stdin.send_all(legacy.encode_input(frame))
                state["busy"] = True
                if not isinstance(frame, legacy.More):  # /more goes on with the same reply
                    reply = Reply(sys.stdout.isatty())
                if not await _print_answer(proc, reader, utf8, reply, quiet=isinstance(frame, legacy.Reset)):
                    print("colibri: the engine stopped", file=sys.stderr)
                    return 1
                state["busy"] = False
        finally:
            await proc.stdin.aclose()  # EOF: the engine finishes and exits
            with trio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
            nursery.cancel_scope.cancel()
    return 0


def _input() -> str:
    return input("> ")


class Reply:
    """A reply's text as shown: through ``HarmonySplit`` (a reply that opens with a harmony header
    is split, any other shown as it comes), the analysis dim on a terminal (``dim``) and left out
    otherwise. One for a user line and the ``/more`` that continue it."""

    def __init__(self, dim: bool) -> None:
        self.dim = dim
        self.split = HarmonySplit(openers=(START, CHANNEL))
        self.reasoning = False  # the last text shown was reasoning

    def feed(self, text: str, final: bool = False) -> None:
        self._write(*self.split.feed(text))
        if final:
            self._write(*self.split.flush())

    def _write(self, reasoning: str, answer: str) -> None:
        if reasoning and self.dim:
            sys.stdout.write(DIM + reasoning + RESET)
            self.reasoning = True
        if answer:
            sys.stdout.write(("\n" if self.reasoning else "") + answer)
            self.reasoning = False
        sys.stdout.flush()


async def _print_answer(proc, reader: legacy.OutputReader, utf8, reply: Reply, quiet: bool) -> bool:
    """Stream the answer to stdout until END; False if the engine went away. A cut answer's
    harmony state stays in ``reply`` for the ``/more`` that continues it."""
    while True:
        data = await proc.stdout.receive_some(1 << 16)
        if not data:
            return False
        for event in reader.receive_data(data):
            match event:
                case legacy.Answer(text=text):
                    if not quiet:
                        reply.feed(utf8.decode(text))
                case legacy.Failed(code=code):
                    print(f"[{code}]", file=sys.stderr)
                case legacy.End(length_limited=cut):
                    if not quiet:
                        reply.feed(utf8.decode(b"", final=True), final=not cut)
                        sys.stdout.write("  [/more continues]\n" if cut else "\n")
                        sys.stdout.flush()
                    return True


async def _ctrl_c(proc, state: dict) -> None:
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            if state["busy"]:
                await proc.stdin.send_all(legacy.encode_input(legacy.CancelAnswer()))
            else:
                print("\n(Ctrl-D or /quit to leave)", file=sys.stderr)
